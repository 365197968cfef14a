"""Where each parameter element lives: one flat order shared by workers and servers, cut into shards.

The flat order is the optimizer's: parameter group by parameter group, each group's parameters in
order. Server ``s`` of ``S`` holds the contiguous range ``[s * n // S, (s + 1) * n // S)`` of the ``n``
elements, so shards differ in size by at most one element whatever the tensor sizes (a large tensor is
split over several servers, small ones share one). Within a shard, each parameter group is one
contiguous segment, so the server's optimizer sees one flat tensor per group and applies that group's
hyperparameters to it. Workers and servers build the same ``FlatLayout`` from the same model and
optimizer factory (every rank runs ``Plait.setup``), so nothing about the layout is ever sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Segment:
    """The part of parameter group ``group`` held by a shard: ``[start, end)`` in the shard's local
    offsets."""

    group: int
    start: int
    end: int


class FlatLayout:
    """The flat order of an optimizer's parameters and its split over ``num_servers`` shards."""

    def __init__(self, optimizer: torch.optim.Optimizer, num_servers: int) -> None:
        seen: set[int] = set()
        self.params: list[nn.Parameter] = []
        self.group_bounds: list[tuple[int, int]] = []
        offset = 0
        for g in optimizer.param_groups:
            start = offset
            for p in g["params"]:
                if id(p) in seen:
                    continue
                seen.add(id(p))
                self.params.append(p)
                offset += p.numel()
            self.group_bounds.append((start, offset))
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1 or not all(d.is_floating_point for d in dtypes):
            raise ValueError(f"parallel.mode=ps needs parameters of one floating-point dtype; got "
                             f"{sorted(map(str, dtypes))}")
        self.dtype = next(iter(dtypes)) if dtypes else torch.float32
        self.numel = offset
        self.num_servers = num_servers
        self.bounds = [s * offset // num_servers for s in range(num_servers + 1)]

    def shard_range(self, server: int) -> tuple[int, int]:
        """``[lo, hi)`` of shard ``server`` in the flat order."""
        return self.bounds[server], self.bounds[server + 1]

    def segments(self, server: int) -> list[Segment]:
        """The shard's intersection with each parameter group (empty intersections left out)."""
        lo, hi = self.shard_range(server)
        out = []
        for i, (a, b) in enumerate(self.group_bounds):
            start, end = max(a, lo), min(b, hi)
            if start < end:
                out.append(Segment(i, start - lo, end - lo))
        return out

    @torch.no_grad()
    def flatten_params(self) -> torch.Tensor:
        """All parameters, detached, in the flat order (a new tensor)."""
        if not self.params:
            return torch.zeros(0, dtype=self.dtype)
        return torch.cat([p.detach().reshape(-1).cpu() for p in self.params])

    @torch.no_grad()
    def flatten_grads(self) -> torch.Tensor:
        """All gradients in the flat order (zeros for a parameter without one this step)."""
        if not self.params:
            return torch.zeros(0, dtype=self.dtype)
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).cpu()
                          for p in self.params]).to(self.dtype)

    @torch.no_grad()
    def copy_range_into_params(self, values: torch.Tensor, lo: int) -> None:
        """Copy ``values``, the elements ``[lo, lo + len(values))`` of the flat order (one shard), into the
        parameters they belong to (no flat copy of the whole model)."""
        hi = lo + values.numel()
        offset = 0
        for p in self.params:
            n = p.numel()
            a, b = max(lo, offset), min(hi, offset + n)
            if a < b:
                src = values[a - lo:b - lo]
                if p.is_contiguous():
                    p.view(-1)[a - offset:b - offset].copy_(src)
                else:
                    flat = p.detach().reshape(-1).clone()
                    flat[a - offset:b - offset] = src.to(flat.device)
                    p.copy_(flat.view_as(p))
            offset += n
            if offset >= hi:
                break

    @torch.no_grad()
    def unflatten_into(self, flat: torch.Tensor, tensors: list[torch.Tensor] | None = None) -> None:
        """Copy ``flat`` (the flat order) into the parameters (or into ``tensors``, one per parameter)."""
        offset = 0
        for i, p in enumerate(self.params):
            n = p.numel()
            target = p if tensors is None else tensors[i]
            target.copy_(flat[offset:offset + n].view_as(target))
            offset += n
