"""Canonical optimizer state dicts for the ZeRO-1/2 optimizer.

The exported layout is exactly what ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``
gives for the same ``torch.optim`` optimizer on the unsharded model: ``{"state": {fqn: {key: tensor of
the parameter's natural shape, "step": scalar}}, "param_groups": [{hyperparameters..., "params":
[fqn, ...]}]}``. So a checkpoint written through ``torch.distributed.checkpoint`` by a zero=2, dp=2 run
loads into a zero=0, dp=1 run (and the reverse) with no conversion step.

A parameter that is a DTensor (tensor parallelism) has DTensor states: this rank's local shard of each state,
placed on the parameter's mesh as the parameter is, so DCP writes the global tensor and reads it back into any
tp degree and any ZeRO stage (FSDP2's states, or a plain optimizer's).

Memory: exporting gathers the states bucket by bucket and every rank returns full per-parameter
tensors, so saving briefly holds the full optimizer state on each rank (the bucket all-gathers are
bounded by one bucket; the returned dict is the full state). DCP then writes each replicated tensor
once. Loading reads full tensors and keeps only this rank's chunk.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from plait.comm.collectives import all_gather_flat
from plait.components.optim import materialize_optimizer_state
from plait.parallel.zero.buckets import Bucket

# (the ZeroOptimizer, plait.parallel.zero.optimizer, which imports this module)
ZeroOptimizer = Any


def init_state(zopt: ZeroOptimizer) -> None:
    """Create the inner optimizer's state if it has none yet (a template with every key is needed
    before a checkpoint can be loaded into it). No communication; parameters do not change."""
    materialize_optimizer_state(zopt.optimizer, keep_grads=False)


def _is_sharded(value: Any, bucket: Bucket) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == bucket.chunk


@torch.no_grad()
def gather_state_dict(zopt: ZeroOptimizer) -> dict[str, Any]:
    """Full canonical optimizer state on every rank (see module docstring).

    Communication: one all-gather per (bucket, sharded state key) over the ZeRO group; no backward.
    Every rank must call it (it is collective).
    """
    init_state(zopt)
    state: dict[str, dict[str, Any]] = {}
    for b in zopt.buckets:
        st = zopt.optimizer.state[b.master]
        for key in sorted(st):
            value = st[key]
            if _is_sharded(value, b):
                full = torch.empty(b.numel, dtype=value.dtype, device=b.flat.device)
                all_gather_flat(full, value.to(b.flat.device).contiguous(), group=zopt.group)
                for i, p in enumerate(b.params):
                    state.setdefault(zopt._fqn[p], {})[key] = _placed_like(p, b.view(i, full).clone())
            else:  # per-tensor scalars (AdamW's step): identical on every chunk of every rank
                for p in b.params:  # one tensor per parameter, as the unsharded optimizer has
                    copy = value.clone() if torch.is_tensor(value) else value
                    state.setdefault(zopt._fqn[p], {})[key] = copy
    groups = []
    for g, fqns in zip(zopt.optimizer.param_groups, zopt._group_fqns, strict=True):
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(fqns)})
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def scatter_state_dict(zopt: ZeroOptimizer, state_dict: dict[str, Any]) -> None:
    """Load a canonical optimizer state dict, keeping this rank's chunk of every state tensor.

    No communication: every rank reads the full tensors it was given. Raises ValueError when the
    checkpoint's parameter names or groups do not match this model's.
    """
    groups = state_dict.get("param_groups")
    if groups is None or "state" not in state_dict:
        raise ValueError("not an optimizer state dict: expected keys 'state' and 'param_groups'")
    if [sorted(g["params"]) for g in groups] != [sorted(f) for f in zopt._group_fqns]:
        raise ValueError("the checkpoint's optimizer param groups do not match this model's parameters; "
                         "load a checkpoint saved from the same model and param-group layout")
    init_state(zopt)
    for g, saved in zip(zopt.optimizer.param_groups, groups, strict=True):
        for k, v in saved.items():
            if k != "params":
                g[k] = v
    states = state_dict["state"]
    for b in zopt.buckets:
        st = zopt.optimizer.state[b.master]
        first = states.get(zopt._fqn[b.params[0]])
        if first is None:
            raise ValueError(f"the checkpoint has no optimizer state for {zopt._fqn[b.params[0]]!r}")
        for key, value in list(st.items()):
            if not _is_sharded(value, b):
                saved = first[key]
                st[key] = saved.clone().to(value.device) if torch.is_tensor(saved) else saved
                continue
            full = torch.zeros(b.numel, dtype=value.dtype)
            for i, p in enumerate(b.params):
                saved = states[zopt._fqn[p]][key]
                b.view(i, full).copy_(saved.to_local() if isinstance(saved, DTensor) else saved)
            value.copy_(full[zopt.rank * b.chunk:(zopt.rank + 1) * b.chunk])


def _placed_like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (a state of ``p``'s local tensor) as ``p`` is placed: a DTensor of the global shape on ``p``'s mesh
    where ``p`` is one, else itself."""
    if not isinstance(p, DTensor):
        return local
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
