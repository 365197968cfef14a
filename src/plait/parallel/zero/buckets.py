"""The flat buckets of plait's ZeRO-1/2 optimizer (``plait.parallel.zero.optimizer``, whose docstring gives the
design): which parameters share a bucket (``build_buckets``: one param group and one sharding pattern each, in the
order backward produces gradients), and each bucket's flat buffer, whose slices the model's parameters become (a
DTensor parameter's local tensor), its gradient buffers and this rank's chunk (``Bucket``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from plait.parallel.grad_sync import shard_groups
from plait.parallel.units import is_expert
from plait.plan.buckets import padded, zero_groups


class Bucket:
    """One flat parameter buffer, its gradient buffers and this rank's chunk of it. Each parameter's slice holds
    its local tensor (a DTensor's shard); ``shard_groups``: the process groups the parameters are sharded over
    besides ZeRO's (tp for tensor-parallel shards; empty for plain and tp-replicated parameters)."""

    def __init__(self, params: list[nn.Parameter], group_index: int, world: int, rank: int) -> None:
        self.params = params
        self.group_index = group_index
        self.shard_groups = shard_groups(params[0])  # the same for every parameter of the bucket
        local = [local_tensor(p) for p in params]
        self.local_shapes = [tuple(t.shape) for t in local]
        self.sizes = [t.numel() for t in local]
        self.offsets: list[int] = []
        total = 0
        for n in self.sizes:
            self.offsets.append(total)
            total += n
        self.numel = padded(total, world)  # so the N chunks are equal
        # What the flat buffer holds, padding included: PowerSGD compresses each matrix on its own.
        self.shapes = self.local_shapes + ([(self.numel - total,)] if self.numel > total else [])
        self.chunk = self.numel // world
        self.flat = torch.zeros(self.numel, dtype=local[0].dtype, device=local[0].device)
        with torch.no_grad():
            for i, (p, t) in enumerate(zip(params, local, strict=True)):
                view = self.view(i, self.flat)
                view.copy_(t.detach())
                set_local(p, view)
        self.shard = self.flat[rank * self.chunk:(rank + 1) * self.chunk]  # view: updated in place
        self.grad_full: torch.Tensor | None = None  # local (unreduced) gradient, (numel,)
        self.grad_shard = torch.zeros(self.chunk, dtype=torch.float32, device=self.flat.device)
        self.master: torch.Tensor = self.shard
        self.ready: set[int] = set()
        self.work: Any = None
        self.launched = False

    def view(self, index: int, flat: torch.Tensor) -> torch.Tensor:
        """Parameter ``index``'s slice of a (numel,) buffer of this bucket, shaped like its local tensor."""
        off = self.offsets[index]
        return flat[off:off + self.sizes[index]].view(self.local_shapes[index])

    def ensure_grad_full(self) -> torch.Tensor:
        if self.grad_full is None:
            self.grad_full = torch.zeros(self.numel, dtype=torch.float32, device=self.flat.device)
        return self.grad_full


def partial_grad(g: torch.Tensor | None) -> bool:
    """Whether gradient ``g`` is a DTensor still to be summed over a mesh axis (``Partial``)."""
    return isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements)


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The tensor a rank holds of ``p``: a DTensor's local shard, else ``p`` itself."""
    return p._local_tensor if isinstance(p, DTensor) else p


def set_local(p: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``view`` the storage of ``p``: a DTensor's local tensor (it stays the DTensor its plan made), a plain
    parameter's data."""
    if isinstance(p, DTensor):
        p._local_tensor = view
    else:
        p.data = view


def normalize_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """The optimizer's param groups (dicts with ``"params"``, or a plain iterable of parameters: one group), each
    holding only its trainable parameters."""
    items = list(params)
    if not items:
        raise ValueError("ZeroOptimizer got no parameters; pass the model's trainable parameters")
    if not isinstance(items[0], dict):
        items = [{"params": items}]
    return [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in items]


def param_fqns(model: nn.Module) -> dict[nn.Parameter, str]:
    """First name of each parameter (a tied weight keeps its first name, as torch's state dicts do)."""
    # Activation checkpointing inserts a wrapper level into module names; state dicts do not show it.
    out: dict[nn.Parameter, str] = {}
    for name, p in model.named_parameters():
        out.setdefault(p, name.replace("_checkpoint_wrapped_module.", ""))
    return out


def build_buckets(model: nn.Module, groups: list[dict[str, Any]], bucket_mb: float, world: int,
                  rank: int, experts: bool = False) -> list[Bucket]:
    """``model``'s trainable parameters (its expert-parallel ones with ``experts``, else the others) in buckets of
    about ``bucket_mb`` in launch order, each of one param group of ``groups`` and one sharding pattern, chunked
    ``world`` ways with this ``rank``'s chunk; the parameters become views into the buckets' flat buffers. Raises
    ValueError when the groups do not cover those parameters exactly once, or they mix dtypes or devices."""
    owner: dict[nn.Parameter, int] = {}
    for gi, g in enumerate(groups):
        for p in g["params"]:
            if p in owner:
                raise ValueError("a parameter appears in two param groups; list each parameter once")
            owner[p] = gi
    # Dense and expert-parallel parameters are sharded by two instances over two groups
    # (plait.parallel.expert.dispatch).
    trainable = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad
                 and is_expert(p) == experts]
    missing = [p for p in trainable if p not in owner]
    if missing or len(owner) != len(trainable):
        raise ValueError("the param groups must cover the model's trainable parameters exactly "
                         f"({len(trainable)} in the model, {len(owner)} in the groups)")
    kinds = {(p.dtype, p.device) for p in trainable}
    if len(kinds) != 1:
        raise ValueError(f"ZeroOptimizer needs one dtype and device for all parameters; got {kinds}")
    # A bucket holds one param group and one sharding pattern (its squares are summed over one set of groups).
    patterns: dict[tuple[int, ...], int] = {}
    keys = [(owner[p], patterns.setdefault(tuple(id(g) for g in shard_groups(p)), len(patterns))) for p in trainable]
    index = {k: i for i, k in enumerate(sorted(set(keys)))}  # by param group first: the order of one pattern
    key_of = {i: k for k, i in index.items()}
    limit = max(1, int(bucket_mb * 2**20 / trainable[0].element_size()))
    groups = zero_groups([local_tensor(p).numel() for p in trainable], [index[k] for k in keys], limit)
    return [Bucket([trainable[i] for i in members], key_of[gi][0], world, rank) for gi, members in groups]
