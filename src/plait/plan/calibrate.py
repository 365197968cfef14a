"""``plait calibrate``: measure this machine into a hardware profile (``kind = "cpu"``).

What is timed (each the fastest of repeated runs after a warm-up, torch's threads set per measurement;
matmuls and memory-bound kernels cycle through enough copies of their operands to fill 64 MB, so they
read them from memory as a training step's operators do, not from a cache kept warm by the loop):

* matmul: ``torch.mm`` over a grid of ``(m, n, k)`` shapes for each thread count (1 .. cores), fp32 and
  bf16; shapes above ``MAX_GEMM_FLOPS`` are skipped;
* memory-bound kernels, one representative per kind the cost model prices (``plait.plan.ops``): add
  (``copy``), layer norm and its backward, tanh-GELU and its backward, log-softmax and its backward, a
  row sum (``reduce``), the embedding backward, and one AdamW step of the optimizer ``[optim]`` builds,
  at several sizes; a kind's rate is the bytes the cost model counts for it over the time;
* attention: causal ``scaled_dot_product_attention`` forward and backward at several sequence lengths
  and head dims;
* overheads: one operator on one-element tensors (the dispatcher), one autograd node in backward, what
  DTensor adds to one operator (at world 2; the full calibration replaces it by the figure of
  ``plait.plan.calibrate_paths``, which also measures the per-event host work of tensor-parallel
  collectives, FSDP2 units and pipeline actions on plait's own code paths; ``--quick`` leaves those 0);
* collectives: all-reduce, all-gather, reduce-scatter, all-to-all, broadcast and point-to-point send/recv on the
  backend plait trains with (gloo on CPU) at world sizes 2-4 (one spawned process per rank, one thread
  each), message sizes 4 KB-64 MB; ``alpha + beta x bytes`` fitted per collective and world size
  (least squares on relative error), raw samples kept.

``--quick`` measures a coarse subset (a few seconds) for tests on a fresh machine. The profile is a TOML
file (``plait.plan.hardware`` reads it); default ``~/.cache/plait/local-cpu.toml``.
"""

from __future__ import annotations

import itertools
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from plait.config import Config
from plait.plan.hardware import default_profile_path

MAX_GEMM_FLOPS = 2 * 2048 * 2048 * 2048
COLD_BYTES, MAX_COPIES = 64 * 2**20, 64  # operand sets a matmul or kernel measurement cycles through
FULL = {"min_time": 0.02, "dims": (32, 128, 512, 2048), "kernel_sizes": (2**16, 2**18, 2**20, 2**22, 2**24, 2**26),
        "attention": ((64, 32), (128, 32), (256, 32), (512, 32), (128, 64), (512, 64)),
        "comm_sizes": tuple(2**e for e in range(12, 27, 2)), "worlds": (2, 3, 4), "dtypes": ("fp32", "bf16")}
QUICK = {"min_time": 0.004, "dims": (64, 512), "kernel_sizes": (2**18, 2**22), "attention": ((128, 32),),
         "comm_sizes": (2**12, 2**18, 2**22), "worlds": (2,), "dtypes": ("fp32",)}


def timed(fn: Callable[[], Any], min_time: float, repeats: int = 5) -> float:
    """Seconds of one ``fn()``: the fastest of ``repeats`` samples, each enough calls to last ``min_time``
    (after a warm-up). The fastest, not the median: other processes on a shared machine only ever slow a
    sample down, so the minimum is the least disturbed estimate of what this machine does."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    calls = max(1, int(min_time / once))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return min(samples)


def copies(nbytes: int) -> int:
    """How many independent operand sets of ``nbytes`` each a measurement cycles through: enough to fill
    ``COLD_BYTES`` (at most ``MAX_COPIES``), so an operator reads its operands from memory as it does in a
    training step (where other operators ran in between), not from the cache a loop over one set keeps warm."""
    return max(1, min(MAX_COPIES, -(-COLD_BYTES // max(nbytes, 1))))


def _matmul(dims: tuple[int, ...], threads: list[int], dtypes: tuple[str, ...], min_time: float) -> list[list[Any]]:
    rows = []
    for dtype in dtypes:
        tdtype = torch.float32 if dtype == "fp32" else torch.bfloat16
        size = torch.finfo(tdtype).bits // 8
        for t in threads:
            torch.set_num_threads(t)
            for m in dims:
                for n in dims:
                    for k in dims:
                        if 2 * m * n * k > MAX_GEMM_FLOPS:
                            continue
                        sets = [(torch.randn(m, k, dtype=tdtype), torch.randn(k, n, dtype=tdtype))
                                for _ in range(copies(size * (m * k + k * n)))]
                        cycle = itertools.cycle(sets)
                        rows.append([dtype, t, m, n, k, timed(lambda c=cycle: torch.mm(*next(c)), min_time)])
    return rows


def _kernel_fns(n: int, cfg: Config) -> dict[str, tuple[Callable[[], Any], float]]:
    """For each kind: a representative call on about ``n`` fp32 elements and the bytes the cost model counts."""
    width = 512
    rows = max(1, n // width)
    x, y, out = torch.randn(rows, width), torch.randn(rows, width), torch.empty(rows, width)
    w, b = torch.ones(width), torch.zeros(width)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [width], w, b, 1e-5)
    logp = torch.log_softmax(x, -1)
    ids = torch.randint(0, width, (rows,))
    from plait.plan.derive import optimizer_traffic
    from plait.train.optim import adamw

    _, per_element = optimizer_traffic(cfg)
    param = torch.nn.Parameter(torch.randn(rows * width))
    param.grad = torch.randn_like(param)
    opt = adamw([("w", param)], cfg.optim)
    opt.step()
    e = rows * width * 4
    return {
        "copy": (lambda: torch.add(x, y, out=out), 3 * e),
        "norm": (lambda: torch.ops.aten.native_layer_norm(x, [width], w, b, 1e-5), 2 * e),
        "norm_bwd": (lambda: torch.ops.aten.native_layer_norm_backward(y, x, [width], mean, rstd, w, b,
                                                                       [True, True, True]), 3 * e),
        "act": (lambda: F.gelu(x, approximate="tanh"), 2 * e),
        "act_bwd": (lambda: torch.ops.aten.gelu_backward(y, x, approximate="tanh"), 3 * e),
        "softmax": (lambda: torch.log_softmax(x, -1), 2 * e),
        "softmax_bwd": (lambda: torch.ops.aten._log_softmax_backward_data(y, logp, -1, torch.float32), 3 * e),
        "reduce": (lambda: x.sum(0), e),
        "embed_bwd": (lambda: torch.ops.aten.embedding_dense_backward(y, ids, width, -1, False),
                      width * width * 4 + 2 * e),
        "optimizer": (opt.step, per_element * rows * width),
    }


def _kernels(sizes: tuple[int, ...], threads: list[int], cfg: Config, min_time: float) -> list[list[Any]]:
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        for nbytes in sizes:
            sets = [_kernel_fns(nbytes // 4, cfg) for _ in range(copies(4 * nbytes))]  # about 4 tensors each
            for kind, (_, counted) in sets[0].items():
                cycle = itertools.cycle([fns[kind][0] for fns in sets])
                rows.append([kind, t, int(counted), timed(lambda c=cycle: next(c)(), min_time)])
    return rows


def _attention(shapes: tuple[tuple[int, int], ...], threads: list[int], min_time: float) -> list[list[Any]]:
    rows, bh = [], 16
    for t in threads:
        torch.set_num_threads(t)
        for seq, dim in shapes:
            qkv = [torch.randn(1, bh, seq, dim, requires_grad=True) for _ in range(3)]

            def fwd(qkv: list = qkv) -> torch.Tensor:
                return F.scaled_dot_product_attention(*qkv, is_causal=True)

            def both(qkv: list = qkv) -> None:
                F.scaled_dot_product_attention(*qkv, is_causal=True).sum().backward()

            f = timed(fwd, min_time)
            rows.append([t, bh, seq, dim, f, max(timed(both, min_time) - f, f)])
    return rows


def _overheads(threads: list[int], min_time: float) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {"op": {}, "autograd": {}}
    a, b = torch.ones(1), torch.ones(1)
    x = torch.ones(1, requires_grad=True)

    def forward_only(n: int = 50) -> torch.Tensor:
        y = x
        for _ in range(n):
            y = y * 1.0001
        return y

    for t in threads:
        torch.set_num_threads(t)
        out["op"][str(t)] = timed(lambda: torch.add(a, b), min_time)
        chain = timed(lambda: forward_only().backward(), min_time)
        out["autograd"][str(t)] = max(chain - timed(forward_only, min_time), 0.0) / 50
    return out


def calibrate(path: str | Path | None = None, *, quick: bool = False, cfg: Config | None = None,
              log: Callable[[str], None] = print) -> Path:
    """Measure this machine (see the module docstring) and write the profile to ``path``; returns it."""
    grid = QUICK if quick else FULL
    cfg = cfg or Config()
    cores = os.cpu_count() or 1
    threads = sorted({1, cores})
    saved_threads = torch.get_num_threads()
    t0 = time.perf_counter()
    min_time = grid["min_time"]
    try:
        log(f"calibrate: matmul grid ({len(grid['dims']) ** 3} shapes x {len(threads)} thread counts)")
        matmul = _matmul(grid["dims"], threads, grid["dtypes"], min_time)
        log("calibrate: memory-bound kernels")
        kernels = _kernels(grid["kernel_sizes"], threads, cfg, min_time)
        log("calibrate: attention and overheads")
        attention = _attention(grid["attention"], threads, min_time)
        overhead = _overheads(threads, min_time)
    finally:
        torch.set_num_threads(saved_threads)
    log(f"calibrate: collectives at world {', '.join(map(str, grid['worlds']))}")
    from plait.plan.calibrate_comm import measure_collectives

    collectives, dtensor = measure_collectives(grid["worlds"], grid["comm_sizes"], min_time=grid["min_time"] / 2)
    overhead["dtensor"] = {"1": dtensor}
    out = Path(path) if path else default_profile_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(_render(matmul, kernels, attention, overhead, collectives, threads, cores, quick))
    if not quick and 2 in grid["worlds"]:
        from plait.plan.calibrate_paths import calibrate_paths, write_overheads
        from plait.plan.hardware import load_profile

        log("calibrate: code paths (tensor parallel, ZeRO-3, pipeline) on a tiny GPT at world 2")
        write_overheads(out, calibrate_paths(load_profile(out), log=log))
    log(f"calibrate: wrote {out} in {time.perf_counter() - t0:.1f} s")
    return out


def _memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def _toml(v: Any) -> str:
    if isinstance(v, str):
        return '"' + v.replace('"', '\\"') + '"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:.6g}" if "e" in f"{v:.6g}" or "." in f"{v:.6g}" else f"{v:.6g}.0"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + "}"
    return str(v)


def _render(matmul: list, kernels: list, attention: list, overhead: dict, collectives: list, threads: list[int],
            cores: int, quick: bool) -> str:
    best = {d: max(2 * m * n * k / s for dd, _, m, n, k, s in matmul if dd == d) for d in {r[0] for r in matmul}}
    copy_rates = [b / s for kind, t, b, s in kernels if kind == "copy" and t == max(threads)]
    ar2 = next((c for c in collectives if c["op"] == "all_reduce" and c["world"] == 2), None)
    link_bw = 1.0 / max(ar2["beta_s_per_byte"], 1e-15) if ar2 else 1e9
    link_lat = ar2["alpha_s"] if ar2 else 1e-4
    lines = [
        f"# Calibrated by `plait calibrate{' --quick' if quick else ''}` on {platform.node()} "
        f"({platform.machine()}, {cores} cores, torch {torch.__version__}) at {time.strftime('%Y-%m-%d %H:%M:%S')}.",
        "# Measured tables in [calibration]; the scalar figures above them summarise those tables.",
        'name = "local-cpu"', 'kind = "cpu"',
        f'description = "{platform.processor() or platform.machine()}, {cores} cores (measured)"', "",
        "[device]", f"memory_bytes = {_memory_bytes()}", "usable_memory_fraction = 0.8",
        f"memory_bandwidth = {_toml(max(copy_rates) if copy_rates else 1e10)}", f"cores = {cores}", "",
        "[device.peak_flops]  # the best measured matmul rate with all cores",
        f"fp32 = {_toml(best['fp32'])}", f"bf16 = {_toml(best.get('bf16', best['fp32']))}",
        f"fp16 = {_toml(best.get('bf16', best['fp32']))}", "",
        "[efficiency]  # unused for a calibrated profile: the tables below are used instead",
        "matmul = 1.0", "attention = 1.0", "memory = 1.0", f"kernel_overhead_s = {_toml(overhead['op']['1'])}", "",
        "[network]  # every rank of a job on this machine; inter-node figures copy the loopback ones (not measured)",
        f"devices_per_node = {cores}", "",
        "[network.intra]", 'name = "loopback (backend: gloo)"', f"bandwidth = {_toml(link_bw)}",
        f"latency_s = {_toml(link_lat)}", "efficiency = 1.0", "",
        "[network.inter]", 'name = "not measured (copy of loopback)"', f"bandwidth = {_toml(link_bw)}",
        f"latency_s = {_toml(link_lat)}", "efficiency = 1.0", "",
        "[calibration]", f"threads = {_toml(threads)}",
        "# matmul rows: dtype, threads, m, n, k, seconds", f"matmul = {_toml(matmul)}",
        "# kernel rows: kind, threads, bytes counted, seconds", f"kernels = {_toml(kernels)}",
        "# attention rows: threads, batch x heads, sequence, head dim, forward s, backward s",
        f"attention = {_toml(attention)}",
        f"collectives = {_toml(collectives)}", "",
        "[calibration.overhead]  # seconds per operator, by threads: dispatcher, autograd node, DTensor",
        f"op = {_toml(overhead['op'])}", f"autograd = {_toml(overhead['autograd'])}",
        f"dtensor = {_toml(overhead['dtensor'])}", "",
    ]
    return "\n".join(lines)
