"""Composition of parallelisms, in one documented order, behind one small interface for the trainer.

Order: build the model, then tensor parallel -> activation checkpointing -> pipeline split ->
data/ZeRO/FSDP wrapping, each step returning the model. ``apply_parallel`` returns a ``Layout``:
what the trainer runs forward on, the optimizer, how gradients are synchronized and clipped, and how
state is saved and loaded. The trainer never asks which strategy is underneath.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from plait.comm.collectives import Comm
from plait.config import Config, ConfigError
from plait.parallel.checkpointing import apply_activation_checkpointing
from plait.parallel.data import GradReducer, LocalGrads, TorchDDP, apply_data_parallel
from plait.topology import Topology
from plait.train.optim import build_optimizer, materialize_optimizer_state, param_groups


class Layout:
    """Data parallelism (plait's reducer, DDP, or one rank) with a replicated torch optimizer."""

    def __init__(self, model: nn.Module, cfg: Config, engine: GradReducer | TorchDDP | LocalGrads | None = None):
        self.model = model  # the unwrapped model: parameter names of the single-process model
        self.engine = engine
        self.module: nn.Module = engine.module if engine is not None else model  # forward runs on this
        self.optimizer = build_optimizer(model, cfg.optim)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Context for non-final accumulation micro-steps: no gradient communication."""
        return self.engine.no_sync()

    def finish(self) -> None:
        """Complete gradient synchronization (the wait is the step's exposed communication)."""
        self.engine.finish()

    def grads(self) -> list[torch.Tensor]:
        """The gradient tensors the optimizer will read (for loss-scale unscaling)."""
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip to ``max_norm`` (inf: measure only); returns the global pre-clip norm."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False))

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def state_dicts(self) -> tuple[dict, dict]:
        """(model, optimizer) state keyed by the single-process model's parameter names; the optimizer
        state is created first if no step has run, so the result can serve as a load template."""
        materialize_optimizer_state(self.optimizer)
        return get_state_dict(self.module, self.optimizer)

    def load_state_dicts(self, model_sd: dict, optim_sd: dict) -> None:
        set_state_dict(self.module, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

    def full_model_state(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights on rank 0, for export; every rank calls it."""
        return self.model.state_dict()


class ZeroLayout(Layout):
    """ZeRO stages 1-2: plait's sharded optimizer owns gradient synchronization."""

    def __init__(self, model: nn.Module, cfg: Config, topo: Topology) -> None:
        from plait.parallel.zero import ZeroOptimizer

        o = cfg.optim
        self.model = self.module = model
        self.engine = None
        self.optimizer = ZeroOptimizer(
            model, param_groups(model, o.weight_decay), torch.optim.AdamW, group=topo.dp_group,
            stage=cfg.parallel.zero, bucket_mb=cfg.parallel.bucket_mb,
            offload=cfg.parallel.offload == "optimizer", lr=o.lr, betas=(o.beta1, o.beta2), foreach=False,
        )

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.optimizer.no_sync()

    def finish(self) -> None:
        self.optimizer.finish_grad_sync()

    def grads(self) -> list[torch.Tensor]:
        return [b.grad_shard for b in self.optimizer.buckets]

    def clip_grad_norm(self, max_norm: float) -> float:
        return float(self.optimizer.clip_grad_norm_(max_norm))

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def state_dicts(self) -> tuple[dict, dict]:
        return self.model.state_dict(), self.optimizer.state_dict()

    def load_state_dicts(self, model_sd: dict, optim_sd: dict) -> None:
        self.model.load_state_dict(model_sd)
        self.optimizer.load_state_dict(optim_sd)


class FsdpLayout(Layout):
    """ZeRO stage 3 on FSDP2: parameters, gradients and optimizer states sharded."""

    def __init__(self, model: nn.Module, cfg: Config, topo: Topology) -> None:
        from plait.parallel.fsdp import apply_fsdp

        p = cfg.parallel
        param_dtype = torch.bfloat16 if cfg.train.precision == "bf16" else None
        self.model = self.module = apply_fsdp(model, topo.mesh["dp_replicate"], param_dtype=param_dtype,
                                              offload=p.offload, reshard_after_forward=p.reshard_after_forward)
        self.engine = None
        self.optimizer = build_optimizer(model, cfg.optim)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def finish(self) -> None:
        """FSDP2 waits for its reduce-scatters at the end of backward."""

    def grads(self) -> list[torch.Tensor]:
        return [p.grad.to_local() for p in self.model.parameters() if p.grad is not None]

    def clip_grad_norm(self, max_norm: float) -> float:
        from plait.parallel.fsdp import clip_grad_norm_

        return float(clip_grad_norm_(self.model, max_norm))

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def full_model_state(self) -> dict[str, torch.Tensor]:
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def apply_parallel(model: nn.Module, topo: Topology, cfg: Config, comm: Comm) -> Layout:
    """Apply the configured layout to ``model`` in the composition order; returns the trainer's Layout."""
    p, t = cfg.parallel, cfg.train
    if p.tp > 1 or p.pp > 1 or p.ep > 1:
        raise ConfigError(
            f"parallel.tp={p.tp}, parallel.pp={p.pp}, parallel.ep={p.ep}: this build of plait trains with "
            "data parallelism and ZeRO only; set them to 1"
        )
    model = apply_activation_checkpointing(model, t.activation_checkpointing, t.checkpoint_every_k)
    if p.zero in (1, 2):
        return ZeroLayout(model, cfg, topo)
    if p.zero == 3:
        return FsdpLayout(model, cfg, topo)
    engine = apply_data_parallel(model, topo.dp_group, topo.dp, p.impl, p.bucket_mb, comm)
    return Layout(model, cfg, engine)
