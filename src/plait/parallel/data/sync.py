"""Replicated data parallelism as gradient-sync policies: plait's bucketed reducer (``Reducer``, the default) and
PyTorch DDP (``Ddp``, ``parallel.impl = "torch"``), each with a replicated torch optimizer.

The reducer works on each parameter's local tensor (a tensor-parallel DTensor's shard is copied into its bucket,
``plait.parallel.data.reducer``), so it synchronises the whole model, a pipeline's stages or a tensor-parallel model
alike. BatchNorm: each rank normalises with its own batch's statistics (as DDP does) and the running mean and
variance are averaged after every step (``GradSync.after_step``); ``parallel.sync_batchnorm`` normalises with the
whole data-parallel batch's instead.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
from torch import nn

from plait.config import Config, ConfigError, ParallelConfig
from plait.parallel.data.reducer import GradReducer, LocalGrads, TorchDDP
from plait.parallel.grad_sync import GradSync, register_grad_sync


@register_grad_sync
class Reducer(GradSync):
    """plait's bucketed, overlapped all-reduce (one rank: nothing to communicate)."""

    name = "data"

    @classmethod
    def chosen(cls, p: ParallelConfig) -> bool:
        return p.zero == 0 and p.impl == "plait"

    @classmethod
    def check(cls, cfg: Config, degrees: dict[str, int]) -> None:
        p = cfg.parallel
        if p.sync_batchnorm and (p.tp > 1 or p.pp > 1):
            raise ConfigError("parallel.sync_batchnorm applies to data parallelism and ZeRO; set it false with "
                              "tp/pp")

    def attach(self, holder: nn.Module, params: list[nn.Parameter]) -> None:
        super().attach(holder, params)
        p = self.cfg.parallel
        self.engine = (GradReducer(holder, self.group, self.comm, p.bucket_mb, broadcast=False) if self.ranks > 1
                       else LocalGrads(holder))

    def set_sync(self, enabled: bool) -> None:
        self.engine.set_sync(enabled)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.engine.no_sync()

    def finish(self) -> None:
        self.engine.finish()

    def _flat_grads(self) -> list[torch.Tensor] | None:
        """The reducer's buckets when every gradient is a view into them (None otherwise): unscaling and clipping
        then touch a few flat buffers instead of every parameter's gradient."""
        if isinstance(self.engine, GradReducer) and not self.engine.copy_grads:
            return [b.flat for b in self.engine.buckets]
        return None

    def grads(self) -> list[torch.Tensor]:
        flats = self._flat_grads()
        return flats if flats is not None else super().grads()

    def clip_alone(self, max_norm: float) -> torch.Tensor:
        """torch's clip, as the user's own loop computes it (``clip_grad_norm_``, coefficient ``max_norm / (norm +
        1e-6)`` at most 1, multiplied on the device): on the bucket buffers where they hold every gradient (a
        parameter without a gradient this step holds zeros there: the same norm)."""
        flats = self._flat_grads()
        if flats is None:
            params = self.params
            if math.isinf(max_norm):
                grads = [q.grad for q in params if q.grad is not None]
                return torch.nn.utils.get_total_norm(grads, foreach=None) if grads else torch.zeros(())
            return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=None)
        total = torch.nn.utils.get_total_norm(flats, foreach=None)
        if not math.isinf(max_norm):
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for f in flats:
                f.mul_(coef)
        return total

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def describe(self) -> str:
        return "data-parallel" if self.ranks > 1 else ""


@register_grad_sync
class Ddp(Reducer):
    """PyTorch DDP (``parallel.impl = "torch"``): the reference plait's reducer is measured against."""

    name = "ddp"

    @classmethod
    def chosen(cls, p: ParallelConfig) -> bool:
        return p.zero == 0 and p.impl == "torch"

    @classmethod
    def check(cls, cfg: Config, degrees: dict[str, int]) -> None:
        p, c = cfg.parallel, cfg.comm
        if p.impl != "torch":
            return
        if p.zero:
            raise ConfigError(f"parallel.impl=torch selects PyTorch DDP, which does not shard "
                              f"(parallel.zero={p.zero}); use parallel.impl=plait with ZeRO")
        if p.tp > 1 or p.pp > 1:
            raise ConfigError(f"parallel.tp={p.tp}/pp={p.pp} compose with plait's data-parallel reducer or with "
                              "parallel.zero=3, not with PyTorch DDP; set parallel.impl=plait")
        if c.compress != "none" or c.allreduce != "backend":
            raise ConfigError("parallel.impl=torch (PyTorch DDP) runs its own all-reduce, so comm.compress and "
                              "comm.allreduce do not apply to it; set parallel.impl=plait to use them")

    def attach(self, holder: nn.Module, params: list[nn.Parameter]) -> None:
        GradSync.attach(self, holder, params)
        self.engine = (TorchDDP(holder, self.group, self.cfg.parallel.bucket_mb) if self.ranks > 1
                       else LocalGrads(holder))

    def forward_wrapper(self) -> Callable | None:
        return self.engine.module if isinstance(self.engine, TorchDDP) else None

    @property
    def torch_collectives(self) -> bool:  # type: ignore[override]
        return isinstance(getattr(self, "engine", None), TorchDDP)

    def describe(self) -> str:
        return "data-parallel" if self.ranks > 1 else ""
