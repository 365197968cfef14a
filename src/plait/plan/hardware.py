"""Hardware profiles: what one device computes and how fast devices talk, read from TOML.

A profile describes one kind of device in one kind of cluster. Shipped profiles (``profiles/*.toml``:
``a100-80gb``, ``h100-sxm``, ``h200-sxm``) come from public specifications plus a few efficiency constants, each
stated and explained in its file; ``plait calibrate`` writes a profile of this machine from
measurements (``kind = "cpu"``, with a ``[calibration]`` section of measured tables). One set of
constants per profile: nothing in it is fitted to a particular model or layout.

Schema (every key required unless marked optional; a missing or mistyped key is a ``ConfigError``
naming it and the file; ``base = "<shipped profile>"`` starts from that profile's tables and replaces the
keys the file gives)::

    name, kind ("gpu" | "cpu"), description
    [device]      memory_bytes, usable_memory_fraction, memory_bandwidth (bytes/s),
                  cores (cpu only), [device.peak_flops] fp32, bf16, fp16 (FLOP/s, dense; tf32 optional;
                  fp8 optional, where the device multiplies in float8: train.precision = "fp8"),
                  host_bandwidth (optional, gpu: bytes/s per direction between the device and pinned host
                  memory that a copy sustains, for activation offload; a cpu's host is its own memory)
    [efficiency]  matmul, attention, memory (fractions of peak), kernel_overhead_s
    [network]     devices_per_node, [network.intra] and [network.inter]: bandwidth (bytes/s per
                  device per direction; across nodes each GPU's share of its node's NICs, which
                  [network.inter] may give instead as nics_per_node x nic_bandwidth), latency_s
                  (point-to-point), efficiency
    [network.nccl] (optional, gpu) NCCL's tuning-model constants: see ``plait.plan.nccl``; without it
                  collectives take the alpha-beta model of ``plait.plan.network``
    [calibration] (cpu profiles, written by ``plait calibrate``): see ``plait.plan.calibrate``
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from plait.config import ConfigError
from plait.plan.nccl import NcclTuning, parse_tuning

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
# Per-event costs of plait's code paths on a calibrated cpu (``plait.plan.calibrate_paths``): what DTensor
# adds to one operator, the host work around one tensor-parallel collective, FSDP2's work around one
# unit's all-gather or reduce-scatter, one pipeline action's schedule and point-to-point handling.
# ``step``: plait's own host work once per optimizer step outside any operator (the engine's bookkeeping).
# Optional: a profile without them prices each at 0.
OPTIONAL_OVERHEADS = ("dtensor", "tp_collective", "fsdp_unit", "pipeline_action", "step")


@dataclass(frozen=True)
class Link:
    """One level of the network: inside a node (NVLink, loopback) or between nodes (the NICs)."""

    name: str
    bandwidth: float  # bytes/s per device per direction
    latency_s: float  # per step of a collective algorithm
    efficiency: float  # fraction of ``bandwidth`` a large collective reaches


@dataclass(frozen=True)
class Calibration:
    """Measured tables of a calibrated (cpu) profile; see ``plait.plan.calibrate`` for how each is taken.

    ``matmul``: rows ``(dtype, threads, m, n, k, seconds)``; ``kernels``: ``(kind, threads, bytes, seconds)``
    for each memory-bound op kind; ``attention``: ``(threads, heads_x_batch, seq, head_dim, forward_s,
    backward_s)`` of causal scaled-dot-product attention; ``overhead``: seconds per operator by threads
    (``op`` dispatcher, ``autograd`` per backward node, and the optional ``OPTIONAL_OVERHEADS``:
    ``dtensor`` per DTensor operator, ``tp_collective`` per tensor-parallel collective, ``fsdp_unit`` per
    FSDP2 unit all-gather or reduce-scatter, ``pipeline_action`` per pipeline schedule action); ``collectives``: per
    ``(op, world)`` the fitted ``alpha_s`` and ``beta_s_per_byte`` and the raw ``(bytes, seconds)`` samples.
    """

    matmul: list[tuple[str, int, int, int, int, float]]
    kernels: list[tuple[str, int, int, float]]
    attention: list[tuple[int, int, int, int, float, float]]
    overhead: dict[str, dict[int, float]]
    collectives: dict[tuple[str, int], dict[str, Any]]
    threads: list[int]


@dataclass(frozen=True)
class HardwareProfile:
    """A device, its efficiency constants and its network; see the module docstring for the schema."""

    name: str
    kind: str
    description: str
    memory_bytes: float
    usable_memory_fraction: float
    memory_bandwidth: float
    peak_flops: dict[str, float]
    matmul_efficiency: float
    attention_efficiency: float
    memory_efficiency: float
    kernel_overhead_s: float
    devices_per_node: int
    intra: Link
    inter: Link
    cores: int = 0
    calibration: Calibration | None = None
    source: str = ""
    nccl: NcclTuning | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    host_bandwidth: float = 0.0  # bytes/s per direction to pinned host memory (0: not given)

    @property
    def usable_memory_bytes(self) -> float:
        """Memory a rank may fill with model states, activations and buffers."""
        return self.memory_bytes * self.usable_memory_fraction

    def peak(self, dtype: str) -> float:
        """Peak dense FLOP/s of one device for matmuls in ``dtype`` (fp32, tf32, bf16, fp16, fp8)."""
        if dtype == "tf32" and "tf32" not in self.peak_flops:
            dtype = "fp32"
        if dtype not in self.peak_flops:
            raise ConfigError(f"hardware profile {self.name!r} gives no peak FLOP/s for {dtype}; add "
                              f"[device.peak_flops] {dtype} = ... to {self.source or 'it'}")
        return self.peak_flops[dtype]


# -- reading and checking ---------------------------------------------------------------------------
def _get(table: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str, src: str) -> Any:
    if not isinstance(table, dict) or key not in table:
        raise ConfigError(f"hardware profile {src} is missing {where}{key}; every profile needs it "
                          "(see plait.plan.hardware for the schema)")
    value = table[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        name = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ConfigError(f"hardware profile {src}: {where}{key} must be a {name}; got {value!r}")
    return value


def _positive(value: float, where: str, src: str, upper: float | None = None) -> float:
    if value <= 0 or (upper is not None and value > upper):
        bound = f" and at most {upper}" if upper is not None else ""
        raise ConfigError(f"hardware profile {src}: {where} must be positive{bound}; got {value}")
    return value


def _share(sub: dict[str, Any], where: str, src: str, devices: int) -> float:
    """Bytes/s per device: ``nics_per_node x nic_bandwidth / devices_per_node`` when given (each GPU's share of
    its node's NICs when every GPU of the node communicates at once, as symmetric layouts do; it replaces a
    ``bandwidth`` a base profile gives), else ``bandwidth``."""
    if "nics_per_node" in sub:
        nics = _positive(_get(sub, "nics_per_node", float, where, src), where + "nics_per_node", src)
        per_nic = _positive(_get(sub, "nic_bandwidth", float, where, src), where + "nic_bandwidth", src)
        return nics * per_nic / devices
    return _positive(_get(sub, "bandwidth", float, where, src), where + "bandwidth", src)


def _link(table: dict[str, Any], level: str, src: str, devices: int = 1) -> Link:
    where = f"[network.{level}] "
    sub = _get(table, level, dict, "[network] ", src)
    return Link(name=str(sub.get("name", level)), bandwidth=_share(sub, where, src, devices),
                latency_s=_get(sub, "latency_s", float, where, src),
                efficiency=_positive(_get(sub, "efficiency", float, where, src), where + "efficiency", src, 1.0))


def _calibration(data: dict[str, Any], src: str) -> Calibration:
    cal = _get(data, "calibration", dict, "", src)
    where = "[calibration] "
    matmul = [(str(r[0]), int(r[1]), int(r[2]), int(r[3]), int(r[4]), float(r[5]))
              for r in _get(cal, "matmul", list, where, src)]
    kernels = [(str(r[0]), int(r[1]), int(r[2]), float(r[3])) for r in _get(cal, "kernels", list, where, src)]
    attention = [(int(r[0]), int(r[1]), int(r[2]), int(r[3]), float(r[4]), float(r[5]))
                 for r in _get(cal, "attention", list, where, src)]
    over = _get(cal, "overhead", dict, where, src)
    overhead = {k: {int(t): float(s) for t, s in _get(over, k, dict, where + "overhead.", src).items()}
                for k in ("op", "autograd")}
    for key in OPTIONAL_OVERHEADS:  # older profiles lack them: 0, the per-event cost left out
        overhead[key] = {int(t): float(s) for t, s in over.get(key, {"1": 0.0}).items()}
    collectives: dict[tuple[str, int], dict[str, Any]] = {}
    for row in _get(cal, "collectives", list, where, src):
        for key in ("op", "world", "alpha_s", "beta_s_per_byte"):
            _get(row, key, (str, int, float), where + "collectives[].", src)
        collectives[(str(row["op"]), int(row["world"]))] = row
    if not matmul or not kernels:
        raise ConfigError(f"hardware profile {src}: [calibration] holds no matmul or kernel measurements; "
                          "run plait calibrate again")
    threads = sorted({int(t) for t in _get(cal, "threads", list, where, src)})
    return Calibration(matmul, kernels, attention, overhead, collectives, threads)


def parse_profile(data: dict[str, Any], src: str) -> HardwareProfile:
    """A profile from parsed TOML ``data``; ``src`` names it in errors. Raises ``ConfigError``."""
    kind = _get(data, "kind", str, "", src)
    if kind not in ("gpu", "cpu"):
        raise ConfigError(f"hardware profile {src}: kind must be gpu or cpu; got {kind!r}")
    dev = _get(data, "device", dict, "", src)
    peaks_table = _get(dev, "peak_flops", dict, "[device] ", src)
    peaks = {}
    for dtype in ("fp32", "bf16", "fp16"):
        peaks[dtype] = _positive(_get(peaks_table, dtype, float, "[device.peak_flops] ", src),
                                 f"[device.peak_flops] {dtype}", src)
    for dtype in ("tf32", "fp8"):  # optional: fp8 where the device has float8 tensor cores (H100, H200)
        if dtype in peaks_table:
            peaks[dtype] = _positive(_get(peaks_table, dtype, float, "[device.peak_flops] ", src),
                                     f"[device.peak_flops] {dtype}", src)
    eff = _get(data, "efficiency", dict, "", src)
    net = _get(data, "network", dict, "", src)
    cores = int(_get(dev, "cores", int, "[device] ", src)) if kind == "cpu" else int(dev.get("cores", 0))
    return HardwareProfile(
        name=_get(data, "name", str, "", src), kind=kind, description=str(data.get("description", "")),
        memory_bytes=_positive(_get(dev, "memory_bytes", float, "[device] ", src), "[device] memory_bytes", src),
        usable_memory_fraction=_positive(_get(dev, "usable_memory_fraction", float, "[device] ", src),
                                         "[device] usable_memory_fraction", src, 1.0),
        memory_bandwidth=_positive(_get(dev, "memory_bandwidth", float, "[device] ", src),
                                   "[device] memory_bandwidth", src),
        peak_flops=peaks,
        matmul_efficiency=_positive(_get(eff, "matmul", float, "[efficiency] ", src), "[efficiency] matmul", src, 1.0),
        attention_efficiency=_positive(_get(eff, "attention", float, "[efficiency] ", src),
                                       "[efficiency] attention", src, 1.0),
        memory_efficiency=_positive(_get(eff, "memory", float, "[efficiency] ", src), "[efficiency] memory", src, 1.0),
        kernel_overhead_s=_get(eff, "kernel_overhead_s", float, "[efficiency] ", src),
        devices_per_node=int(_positive(_get(net, "devices_per_node", int, "[network] ", src),
                                       "[network] devices_per_node", src)),
        intra=_link(net, "intra", src), inter=_link(net, "inter", src, int(net.get("devices_per_node", 1))),
        cores=cores, calibration=_calibration(data, src) if kind == "cpu" else None, source=src,
        nccl=_nccl(net, src),
        host_bandwidth=_positive(float(dev["host_bandwidth"]), "[device] host_bandwidth", src)
        if "host_bandwidth" in dev else 0.0,
    )


def _nccl(net: dict[str, Any], src: str) -> NcclTuning | None:
    if "nccl" not in net:
        return None
    try:
        return parse_tuning(_get(net, "nccl", dict, "[network] ", src))
    except KeyError as e:
        raise ConfigError(f"hardware profile {src} is missing [network.nccl] {e.args[0]}; see plait.plan.nccl "
                          "for NCCL's tuning constants") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"hardware profile {src}: [network.nccl] {e}") from None


def builtin_profiles() -> dict[str, Path]:
    """Shipped profile names and their files (``plait/plan/profiles/*.toml``)."""
    root = resources.files("plait.plan") / "profiles"
    return {Path(str(p)).stem: Path(str(p)) for p in root.iterdir() if str(p).endswith(".toml")}


def default_profile_path() -> Path:
    """Where ``plait calibrate`` writes this machine's profile unless told otherwise."""
    return Path.home() / ".cache" / "plait" / "local-cpu.toml"


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A shipped profile by name (``a100-80gb``, ``h100-sxm``, ``h200-sxm``), ``local`` (this machine's calibration at
    ``default_profile_path()``), or a TOML file's path. Raises ``ConfigError`` naming what is wrong."""
    text = str(name_or_path)
    shipped = builtin_profiles()
    if text in shipped:
        path = shipped[text]
    elif text == "local":
        path = default_profile_path()
        if not path.is_file():
            raise ConfigError(f"no calibrated profile at {path}; run plait calibrate first (it measures this "
                              "machine and writes that file), or pass --hardware a100-80gb / h100-sxm")
    else:
        path = Path(text)
        if not path.is_file():
            raise ConfigError(f"hardware profile {text!r} is neither a shipped profile ({', '.join(sorted(shipped))}, "
                              "local) nor a TOML file; pass one of those names or a path")
    return parse_profile(_read(path, shipped), str(path))


def _read(path: Path, shipped: dict[str, Path], depth: int = 0) -> dict[str, Any]:
    """A profile's TOML; ``base = "<shipped profile>"`` takes that profile's tables and replaces the keys given."""
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"hardware profile {path} is not valid TOML: {e}") from None
    base = data.pop("base", None)
    if base is None:
        return data
    if base not in shipped or depth > 4:
        raise ConfigError(f"hardware profile {path}: base = {base!r} must name a shipped profile "
                          f"({', '.join(sorted(shipped))})")
    return _merged(_read(shipped[base], shipped, depth + 1), data)


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
