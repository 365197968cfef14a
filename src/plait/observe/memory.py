"""Memory a rank measures of itself: the model-state bytes it holds (parameters, gradients, optimizer
states, each storage counted once), its peak, and the summary's per-rank block next to the prediction of
``plait.plan.memory``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.plan.memory import Precision, predict_model_state_bytes


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _count(tensors: Any, seen: dict[int, int]) -> int:
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        ptr, nbytes = _storage_key(t)
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


def memory_report(num_params: int, stage: int, dp: int, precision: Precision, measured: dict[str, int] | None,
                  device: torch.device, predict: bool = True) -> dict[str, Any]:
    """Per-rank lists (index = global rank) of predicted and measured model-state bytes and peak bytes,
    for a run's summary. Collective: one all-gather of small objects over the world."""
    import torch.distributed as dist

    predicted = predict_model_state_bytes(num_params, stage=stage, dp=dp, precision=precision) if predict else None
    mine = {"predicted": predicted, "measured": measured, "peak_bytes": peak_memory_bytes(device)}
    ranks: list[Any] = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    return {
        "predicted_model_state_bytes": [r["predicted"]["total"] if r["predicted"] else None for r in ranks],
        "measured_model_state_bytes": [r["measured"]["total"] if r["measured"] else None for r in ranks],
        "peak_bytes": [r["peak_bytes"] for r in ranks], "breakdown": ranks}
