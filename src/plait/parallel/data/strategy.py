"""The data-parallel strategy: plait's bucketed reducer, or PyTorch DDP (``DataParallel``), with a replicated
torch optimizer; and what the other data-parallel layouts share with it (BatchNorm averaging, gradient sync by an
engine, a flat in-place all-reduce).

The optimizer comes from a factory called with ``strategy.model`` once the layout is applied, so it
always holds the parameters the layout trains.

BatchNorm: each data-parallel rank normalises with its own batch's statistics (as DDP does), and after
every optimizer step the running mean and variance are averaged over the data-parallel ranks (one
all-reduce of all of them), so every rank holds the same buffers. The averaged running mean equals
the single-process one for equal per-rank batches; the averaged running variance is the mean of the
ranks' variances (it lacks the spread between the ranks' batch means). ``parallel.sync_batchnorm``
normalises with the statistics of the whole data-parallel batch instead.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait.comm.collectives import Comm
from plait.config import Config, ConfigError, ParallelConfig
from plait.parallel.apply import ModelSpec
from plait.parallel.data.reducer import GradReducer, TorchDDP, apply_data_parallel
from plait.parallel.strategy import Strategy, register_strategy
from plait.parallel.units import batchnorm_buffers
from plait.topology import Topology


def reduce_in_place(tensors: list[torch.Tensor], comm: Comm, group: Any, divisor: float, name: str) -> None:
    """Sum ``tensors`` over ``group`` in one all-reduce of them flattened (float32; none when ``group`` is
    None), divide by ``divisor`` and write the result back into each tensor."""
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    if group is not None:
        comm.all_reduce_sum(flat, group, name=name)
    flat /= divisor
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()



class BatchNormAveraging:
    """Mixin: BatchNorm running statistics averaged over the data-parallel ranks after every step (see the
    module docstring); nothing with ``parallel.sync_batchnorm`` (already synchronised) or one rank."""

    _bn: list[torch.Tensor]

    def _track_batchnorm(self, model: nn.Module, cfg: Config, topo: Topology) -> None:
        self._bn = batchnorm_buffers(model) if topo.dp > 1 and not cfg.parallel.sync_batchnorm else []

    def after_step(self) -> None:
        """Communication: one all-reduce of every running mean and variance, flattened; none in backward."""
        if self._bn:
            reduce_in_place(self._bn, self.comm, self.topo.dp_group, self.topo.dp, "batchnorm statistics")



class ReducerSync:
    """Mixin: gradient synchronisation by a data-parallel engine (``self.engine``: plait's reducer, DDP, or
    one rank's ``LocalGrads``), armed per micro-step and completed after backward."""

    engine: Any

    def set_sync(self, enabled: bool) -> None:
        self.engine.set_sync(enabled)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.engine.no_sync()

    def finish(self) -> None:
        self.engine.finish()



@register_strategy
class DataParallel(ReducerSync, BatchNormAveraging, Strategy):
    """Data parallelism (plait's bucketed reducer, or PyTorch DDP with ``parallel.impl=torch``; one rank
    needs neither) with a replicated torch optimizer. The strategy when no other applies."""

    name = "data"
    priority = 0

    @classmethod
    def applies(cls, p: ParallelConfig) -> bool:
        return True

    @classmethod
    def check(cls, cfg: Config, degrees: dict[str, int]) -> None:
        p, c = cfg.parallel, cfg.comm
        if p.zero and p.impl == "torch":
            raise ConfigError(f"parallel.impl=torch selects PyTorch DDP, which does not shard "
                              f"(parallel.zero={p.zero}); use parallel.impl=plait with ZeRO")
        if (p.tp > 1 or p.pp > 1) and p.impl == "torch":
            raise ConfigError(f"parallel.tp={p.tp}/pp={p.pp} compose with plait's data-parallel reducer or with "
                              "parallel.zero=3, not with PyTorch DDP; set parallel.impl=plait")
        if p.impl == "torch" and (c.compress != "none" or c.allreduce != "backend"):
            raise ConfigError("parallel.impl=torch (PyTorch DDP) runs its own all-reduce, so comm.compress and "
                              "comm.allreduce do not apply to it; set parallel.impl=plait to use them")
        if p.sync_batchnorm and (p.tp > 1 or p.pp > 1):
            raise ConfigError("parallel.sync_batchnorm applies to data parallelism and ZeRO; set it false with "
                              "tp/pp")

    def __init__(self, model: nn.Module, cfg: Config, topo: Topology, comm: Comm,
                 spec: ModelSpec | None = None) -> None:
        super().__init__(model, cfg, topo, comm, spec)
        p = cfg.parallel
        self.engine = apply_data_parallel(model, topo.dp_group, topo.dp, p.impl, p.bucket_mb, comm, broadcast=False)
        self.torch_collectives = isinstance(self.engine, TorchDDP)
        self._track_batchnorm(model, cfg, topo)

    def forward_wrapper(self) -> Callable | None:
        return self.engine.module if isinstance(self.engine, TorchDDP) else None

    def _flat_grads(self) -> list[torch.Tensor] | None:
        """plait's reducer buckets when every gradient is a view into them (None otherwise): unscaling
        and clipping then touch a few flat buffers instead of every parameter's gradient."""
        if isinstance(self.engine, GradReducer) and not self.engine.copy_grads:
            return [b.flat for b in self.engine.buckets]
        return None

    def grads(self) -> list[torch.Tensor]:
        flats = self._flat_grads()
        return flats if flats is not None else super().grads()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor | float:
        flats = self._flat_grads()
        if flats is None:
            return super().clip_grad_norm(max_norm)
        # torch's formula (coefficient max_norm / (norm + 1e-6), at most 1) on the bucket buffers, on the device:
        # a parameter without a gradient this step holds zeros there, so the norm is the same.
        total = torch.nn.utils.get_total_norm(flats, foreach=None)
        if not math.isinf(max_norm):
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for f in flats:
                f.mul_(coef)
        return total

    def zero_grad(self) -> None:
        self.engine.zero_grad()

