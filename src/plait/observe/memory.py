"""Memory a rank measures of itself: the model-state bytes it holds (parameters, gradients, optimizer
states, each storage counted once), its peak, the peak of setup (``SetupMeter``), and the summary's per-rank
block next to the predictions of ``plait.plan.memory``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.plan.memory import Precision, predict_model_state_bytes, predict_setup_bytes


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s bytes on this rank: a DTensor's local shard, a wrapper subclass's inner
    tensors (torchao's float8 weights under FSDP2), else ``t`` itself."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return _plain(t.to_local())
    if type(t) is not torch.Tensor and type(t) is not nn.Parameter and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [x for name in names for x in _plain(getattr(t, name))]
    return [t]


def _count(tensors: Any, seen: dict[int, int]) -> int:
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        for plain in _plain(t):
            s = plain.untyped_storage()
            ptr, nbytes = s.data_ptr(), s.nbytes()
            if ptr == 0 or ptr in seen:
                continue  # empty, or a storage already counted (views of one flat buffer, tied weights)
            seen[ptr] = nbytes
            total += nbytes
    return total


def measure_model_state_bytes(model: nn.Module, optimizer: Any) -> dict[str, int]:
    """Bytes this rank actually holds for parameters, gradients and optimizer states.

    Counts tensor storages, each storage once across all three categories (in that order), so
    parameters that are views of one flat buffer, a tied weight, or an optimizer master that is a
    view of the parameters are counted once. DTensors count their local shard. Gradients include
    the model's ``.grad`` and those of the optimizer's own parameters (the ZeRO shards). ``optimizer``
    may be a list: a composite (expert parallelism under ZeRO keeps the experts' own optimizer).
    """
    seen: dict[int, int] = {}
    opts = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    opt_params = [p for o in opts for g in o.param_groups for p in g["params"]]
    params = _count(list(model.parameters()) + opt_params, seen)
    grads = _count([p.grad for p in list(model.parameters()) + opt_params if p.grad is not None], seen)
    for o in opts:
        extra = getattr(o, "grad_buffers", None)
        if callable(extra):
            grads += _count(extra(), seen)
    states = _count([v for o in opts for st in o.state.values() for v in st.values()], seen)
    return {"params": params, "grads": grads, "optimizer": states, "total": params + grads + states}


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process so far: allocated CUDA memory on a GPU, resident set size on CPU
    (which also counts the interpreter and libraries, so compare CPU peaks between runs, not with the
    model-state prediction)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _host_status() -> dict[str, int]:
    """This process's resident set now (``VmRSS``) and its high-water mark (``VmHWM``), in bytes; empty where
    ``/proc`` does not exist."""
    try:
        text = open("/proc/self/status").read()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


class SetupMeter:
    """Peak memory of a phase (``Plait.setup``), measured by this rank on itself between ``start`` and ``stop``
    (or as a context manager): ``reading`` holds, in bytes, the host resident set before, at its peak and
    after, and on a GPU the allocated device memory likewise.

    The host peak is the kernel's high-water mark, reset when the phase starts (Linux: ``/proc/self/clear_refs``),
    so it is the phase's own peak (``host_peak_source = "phase"``); where it cannot be reset it is the
    process's peak since it started (``"process"``, an upper bound). The device peak is torch's
    ``max_memory_allocated`` after resetting it. A resident set sees memory the allocator keeps after freeing
    it too, so compare increases of one run's ranks with the prediction, not bytes across machines."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reading: dict[str, Any] = {}

    def __enter__(self) -> SetupMeter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> SetupMeter:
        """Note the memory now and reset the peaks."""
        source = "process"
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current resident set
            source = "phase"
        except OSError:
            pass
        status = _host_status()
        self.reading = {"host_before_bytes": status.get("VmRSS"), "host_peak_source": source}
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.reading["device_before_bytes"] = int(torch.cuda.memory_allocated(self.device))
        return self

    def stop(self) -> dict[str, Any]:
        """The reading of the phase since ``start`` (also kept in ``reading``)."""
        status = _host_status()
        r = self.reading
        peak = status.get("VmHWM") if r["host_peak_source"] == "phase" else peak_memory_bytes(torch.device("cpu"))
        r.update(host_peak_bytes=peak, host_after_bytes=status.get("VmRSS"))
        if r.get("host_before_bytes") is not None and peak is not None:
            r["host_increase_bytes"] = peak - r["host_before_bytes"]
        if self.device.type == "cuda":
            r["device_peak_bytes"] = int(torch.cuda.max_memory_allocated(self.device))
            r["device_after_bytes"] = int(torch.cuda.memory_allocated(self.device))
            r["device_increase_bytes"] = r["device_peak_bytes"] - r["device_before_bytes"]
        return r


def memory_report(num_params: int, stage: int, dp: int, precision: Precision, measured: dict[str, int] | None,
                  device: torch.device, predict: bool = True, setup: dict[str, Any] | None = None,
                  setup_predicted: dict[str, int] | None = None) -> dict[str, Any]:
    """Per-rank lists (index = global rank) of predicted and measured model-state bytes and peak bytes,
    for a run's summary; with ``setup`` (a ``SetupMeter`` reading) also the peak of setup measured, next to
    ``setup_predicted`` (``plait.plan.memory.predict_setup_bytes``). Collective: one all-gather of small
    objects over the world."""
    import torch.distributed as dist

    predicted = predict_model_state_bytes(num_params, stage=stage, dp=dp, precision=precision) if predict else None
    mine = {"predicted": predicted, "measured": measured, "peak_bytes": peak_memory_bytes(device),
            "setup": {"measured": setup, "predicted": setup_predicted}}
    ranks: list[Any] = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    setups = [r.pop("setup") for r in ranks]

    def column(part: str, key: str) -> list[Any]:
        return [(s[part] or {}).get(key) for s in setups]
    return {
        "predicted_model_state_bytes": [r["predicted"]["total"] if r["predicted"] else None for r in ranks],
        "measured_model_state_bytes": [r["measured"]["total"] if r["measured"] else None for r in ranks],
        "peak_bytes": [r["peak_bytes"] for r in ranks], "breakdown": ranks,
        "setup": {"host_peak_bytes": column("measured", "host_peak_bytes"),
                  "host_increase_bytes": column("measured", "host_increase_bytes"),
                  "device_peak_bytes": column("measured", "device_peak_bytes"),
                  "device_increase_bytes": column("measured", "device_increase_bytes"),
                  "predicted_peak_bytes": column("predicted", "peak"),
                  "predicted_increase_bytes": column("predicted", "increase"),
                  "ranks": setups}}


def layout_memory(params: list[torch.Tensor], buffers: list[torch.Tensor], topo: Any, p: Any, precision: str,
                  meta: bool, measured: dict[str, int] | None, device: torch.device,
                  setup: dict[str, Any] | None) -> dict[str, Any]:
    """A layout's memory block of the run summary (``memory_report``): this rank's ``params`` (each once) and
    ``buffers`` over the topology ``topo`` under the ``[parallel]`` section ``p``; the model-state prediction and the
    setup prediction where the model runs whole on each rank (no tensor or pipeline split; ``meta``: each rank
    allocated only its part). ZeRO shards over the shard group: every data-parallel rank, or dp_shard of them under
    HSDP. Collective, as ``memory_report``."""
    data_parallel_only = topo.degree("tp") == topo.degree("pp") == 1
    predicted_setup = None
    if data_parallel_only:  # the whole model given on every rank, or (meta-built) each rank allocating its part
        predicted_setup = predict_setup_bytes(sum(q.numel() * q.element_size() for q in params),
                                              sum(b.numel() * b.element_size() for b in buffers),
                                              world=topo.world_size, zero=p.zero, dp=topo.degree("dp_cp"),
                                              shard=topo.shard_degree, bucket_mb=p.bucket_mb,
                                              source="shards" if meta else "whole")
    return memory_report(sum(q.numel() for q in params), p.zero, topo.shard_degree,
                         "bf16" if precision != "fp32" else "fp32", measured or None, device,
                         predict=data_parallel_only, setup=setup, setup_predicted=predicted_setup)
