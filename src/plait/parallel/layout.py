"""The trainer's view of a parallel layout: forward/backward, gradient sync, clipping, state.

``Layout`` is data parallelism (plait's reducer, DDP, or one rank) with a replicated optimizer;
``ZeroLayout`` is ZeRO-1/2 (plait's sharded optimizer); ``FsdpLayout`` is ZeRO-3 on FSDP2. Tensor and
pipeline layouts are in ``mp_layout``. The trainer calls only the methods defined on ``Layout``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from plait.comm.collectives import Comm
from plait.config import Config
from plait.parallel.data import GradReducer, LocalGrads, TorchDDP
from plait.topology import Topology
from plait.train.optim import adamw_options, build_optimizer, materialize_optimizer_state, param_groups

AmpFactory = Callable[[], contextlib.AbstractContextManager]


class Layout:
    """Data parallelism (plait's reducer, DDP, or one rank) with a replicated torch optimizer."""

    # Whether torch issues this layout's collectives (DDP, FSDP2, DTensor, pipelining) rather than
    # plait's Comm: the trainer then counts them with plait.comm.accounting.TorchCollectiveCounter.
    torch_collectives = False

    def __init__(self, model: nn.Module, cfg: Config, engine: GradReducer | TorchDDP | LocalGrads | None = None):
        self.model = model  # the unwrapped model: parameter names of the single-process model
        self.engine = engine
        self.module: nn.Module = engine.module if engine is not None else model  # forward runs on this
        self.optimizer = build_optimizer(model, cfg.optim)
        self.torch_collectives = isinstance(engine, TorchDDP)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Context for non-final accumulation micro-steps: no gradient communication."""
        return self.engine.no_sync()

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, factor: float, amp: AmpFactory,
                         times: dict[str, float]) -> torch.Tensor:
        """Forward and backward of one micro-batch with the loss multiplied by ``factor``
        (1 / accumulation x loss scale); returns the unscaled loss, detached."""
        t0 = time.perf_counter()
        with amp():
            loss = self.module(x, y) * factor
        t1 = time.perf_counter()
        loss.backward()
        times["forward_s"] += t1 - t0
        times["backward_s"] += time.perf_counter() - t1
        return loss.detach() / factor

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor, amp: AmpFactory) -> torch.Tensor:
        """Mean loss of one validation micro-batch (forward only)."""
        with amp():
            return self.module(x, y).detach()

    def report(self, run_dir: Path) -> dict[str, Any]:
        """Layout-specific results for summary.json (collective where the layout needs it)."""
        return {}

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """This rank's loss as a plain tensor every rank of its data-parallel replica agrees on."""
        return loss

    def finish(self) -> None:
        """Complete gradient synchronization (the wait is the step's exposed communication)."""
        self.engine.finish()

    def _flat_grads(self) -> list[torch.Tensor] | None:
        """plait's reducer buckets when every gradient is a view into them (None otherwise): unscaling
        and clipping then touch a few flat buffers instead of every parameter's gradient."""
        if isinstance(self.engine, GradReducer) and not self.engine.copy_grads:
            return [b.flat for b in self.engine.buckets]
        return None

    def grads(self) -> list[torch.Tensor]:
        """The gradient tensors the optimizer will read (for loss-scale unscaling)."""
        flats = self._flat_grads()
        if flats is not None:
            return flats
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip to ``max_norm`` (inf: measure only); returns the global pre-clip norm."""
        flats = self._flat_grads()
        if flats is None:
            params = [p for p in self.model.parameters() if p.grad is not None]
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False))
        # torch's formula (coefficient max_norm / (norm + 1e-6), at most 1) on the bucket buffers:
        # a parameter without a gradient this step holds zeros there, so the norm is the same.
        total = torch.nn.utils.get_total_norm(flats, foreach=False)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if coef < 1.0:
            for f in flats:
                f.mul_(coef)
        return float(total)

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def state_dicts(self) -> tuple[dict, dict]:
        """(model, {"state": optimizer states}) keyed by the single-process model's parameter names, the
        one checkpoint format of every layout. The optimizer state is created first if no step has run,
        so the result can serve as a load template."""
        materialize_optimizer_state(self.optimizer)
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        self._param_groups = optim_sd["param_groups"]
        return model_sd, {"state": optim_sd["state"]}

    def load_state_dicts(self, model_sd: dict, optim_sd: dict) -> None:
        """Load a checkpoint's states; hyperparameters stay this run's (they come from its config)."""
        full = {"state": optim_sd["state"], "param_groups": self._param_groups}
        set_state_dict(self.module, self.optimizer, model_state_dict=model_sd, optim_state_dict=full)

    def full_model_state(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights on rank 0, for export; every rank calls it."""
        return self.model.state_dict()


class ZeroLayout(Layout):
    """ZeRO stages 1-2: plait's sharded optimizer owns gradient synchronization."""

    def __init__(self, model: nn.Module, cfg: Config, topo: Topology, comm: Comm) -> None:
        from plait.parallel.zero import ZeroOptimizer

        o = cfg.optim
        self.model = self.module = model
        self.engine = None
        self.optimizer = ZeroOptimizer(
            model, param_groups(model.named_parameters(), o.weight_decay), torch.optim.AdamW, group=topo.dp_group,
            stage=cfg.parallel.zero, bucket_mb=cfg.parallel.bucket_mb,
            offload=cfg.parallel.offload == "optimizer", **adamw_options(o),
        )
        self.optimizer.use_comm(comm)  # its collectives go through the comm layer: counted, guarded, compressed

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
        optim_sd = self.optimizer.state_dict()  # collective: gathers the canonical (unsharded) layout
        self._param_groups = optim_sd["param_groups"]
        return self.model.state_dict(), {"state": optim_sd["state"]}

    def load_state_dicts(self, model_sd: dict, optim_sd: dict) -> None:
        self.model.load_state_dict(model_sd)
        self.optimizer.load_state_dict({"state": optim_sd["state"], "param_groups": self._param_groups})


class FsdpLayout(Layout):
    """ZeRO stage 3 on FSDP2: parameters, gradients and optimizer states sharded."""

    torch_collectives = True

    def __init__(self, model: nn.Module, cfg: Config, topo: Topology) -> None:
        from plait.parallel.fsdp import apply_fsdp

        p = cfg.parallel
        param_dtype = torch.bfloat16 if cfg.train.precision == "bf16" else None
        self.model = self.module = apply_fsdp(model, topo.mesh["dp_replicate"], param_dtype=param_dtype,
                                              offload=p.offload, reshard_after_forward=p.reshard_after_forward)
        self.engine = None
        self.optimizer = build_optimizer(model, cfg.optim)

    def no_sync(self) -> contextlib.AbstractContextManager:
        from plait.parallel.fsdp import no_gradient_sync

        return no_gradient_sync(self.module)

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
