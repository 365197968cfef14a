"""The engine's view of a parallel layout: gradient sync, clipping, the optimizer step, state.

``Layout`` is data parallelism (plait's reducer, DDP, or one rank) with a replicated optimizer;
``ZeroLayout`` is ZeRO-1/2 (plait's sharded optimizer); ``FsdpLayout`` is ZeRO-3 on FSDP2. Tensor and
pipeline layouts are in ``mp_layout``. The engine (``plait.engine.Plait``) calls only the methods
defined on ``Layout``; the user runs forward on ``layout.model``, which keeps the original model's
attributes and state-dict keys.

The optimizer comes from a factory called with ``layout.model`` once the layout is applied, so it
always holds the parameters the layout trains (DTensor shards under FSDP2 and tensor parallelism).
ZeRO-1/2 calls the factory too, then rebuilds the same optimizer class with the same groups and
hyperparameters over its flat shards.

BatchNorm: each data-parallel rank normalises with its own batch's statistics (as DDP does), and after
every optimizer step the running mean and variance are averaged over the data-parallel ranks (one
all-reduce of all of them), so every rank holds the same buffers. The averaged running mean equals
the single-process one for equal per-rank batches; the averaged running variance is the mean of the
ranks' variances (it lacks the spread between the ranks' batch means). ``parallel.sync_batchnorm``
normalises with the statistics of the whole data-parallel batch instead.
"""

from __future__ import annotations

import contextlib
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
from plait.parallel.units import batchnorm_buffers, is_expert
from plait.topology import Topology
from plait.train.optim import materialize_optimizer_state, optimizer_recipe

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
# The elementwise torch optimizers: sharding their flat buffers computes exactly what they compute whole.
ELEMENTWISE = ("Adam", "AdamW", "SGD", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop", "Adadelta", "ASGD",
               "Rprop")


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


class LayoutError(ValueError):
    """A model or optimizer this layout cannot take; the message says what to do."""


class Layout:
    """Data parallelism (plait's reducer, DDP, or one rank) with a replicated torch optimizer."""

    # Whether torch issues this layout's collectives (DDP, FSDP2, DTensor, pipelining) rather than
    # plait's Comm: the engine then counts them with plait.comm.accounting.TorchCollectiveCounter.
    torch_collectives = False
    pipelined = False
    optimizer: Any = None

    def __init__(self, model: nn.Module, cfg: Config, topo: Topology, comm: Comm,
                 engine: GradReducer | TorchDDP | LocalGrads) -> None:
        self.model = model  # what the user runs forward on: the original model object
        self.engine = engine
        self.topo, self.comm = topo, comm
        self.torch_collectives = isinstance(engine, TorchDDP)
        self._bn = batchnorm_buffers(model) if topo.dp > 1 and not cfg.parallel.sync_batchnorm else []

    # -- building ---------------------------------------------------------------------------------
    def build_optimizer(self, factory: OptimizerFactory) -> Any:
        self.optimizer = factory(self.model)
        return self.optimizer

    def scheduler_target(self) -> torch.optim.Optimizer:
        """The torch optimizer an LR scheduler should be attached to."""
        return self.optimizer

    def forward_wrapper(self) -> Callable | None:
        """A callable that runs the model's forward through the layout's wrapper (DDP), or None."""
        if isinstance(self.engine, TorchDDP):
            return self.engine.module
        return None

    # -- one step ---------------------------------------------------------------------------------
    def set_sync(self, enabled: bool) -> None:
        """Whether the next backward communicates gradients (False on non-final accumulation micro-steps)."""
        self.engine.set_sync(enabled)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Context for non-final accumulation micro-steps: no gradient communication."""
        return self.engine.no_sync()

    def context(self) -> contextlib.AbstractContextManager:
        """Context that forward and backward must run in (loss parallelism); none here."""
        return contextlib.nullcontext()

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
            if not params:
                return 0.0
            # foreach=None: torch's choice, the per-tensor loop on the CPU, multi-tensor kernels on a GPU
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=None))
        # torch's formula (coefficient max_norm / (norm + 1e-6), at most 1) on the bucket buffers:
        # a parameter without a gradient this step holds zeros there, so the norm is the same.
        total = torch.nn.utils.get_total_norm(flats, foreach=None)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if coef < 1.0:
            for f in flats:
                f.mul_(coef)
        return float(total)

    def step(self) -> None:
        self.optimizer.step()

    def after_step(self) -> None:
        """BatchNorm running statistics averaged over the data-parallel ranks (see the module docstring).

        Communication: one all-reduce of every running mean and variance, flattened; none in backward."""
        if self._bn:
            reduce_in_place(self._bn, self.comm, self.topo.dp_group, self.topo.dp, "batchnorm statistics")

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def report(self, run_dir: Path | None) -> dict[str, Any]:
        """Layout-specific results for summary.json (collective where the layout needs it)."""
        return {}

    # -- state ------------------------------------------------------------------------------------
    def state_dicts(self) -> tuple[dict, dict]:
        """(model, {"state": optimizer states}) keyed by the single-process model's parameter names, the
        one checkpoint format of every layout. The optimizer state is created first if no step has run,
        so the result can serve as a load template."""
        materialize_optimizer_state(self.optimizer)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        self._param_groups = optim_sd["param_groups"]
        return model_sd, {"state": optim_sd["state"]}

    def load_state_dicts(self, model_sd: dict, optim_sd: dict) -> None:
        """Load a checkpoint's states; hyperparameters stay this run's (an LR scheduler restores its own)."""
        full = {"state": optim_sd["state"], "param_groups": self._param_groups}
        set_state_dict(self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=full)

    def full_model_state(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights under the single-process names; every rank calls it. With
        ``rank0_only`` other ranks may get an empty dict (layouts that gather save the memory)."""
        return self.model.state_dict()

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's trainable parameters under the single-process model's names."""
        return [(n.replace("_checkpoint_wrapped_module.", ""), p) for n, p in self.model.named_parameters()]


class ZeroLayout(Layout):
    """ZeRO stages 1-2: plait's sharded optimizer owns gradient synchronization."""

    def __init__(self, model: nn.Module, cfg: Config, topo: Topology, comm: Comm) -> None:
        self.model = model
        self.engine = None
        self.topo, self.comm, self.cfg = topo, comm, cfg
        self._bn = batchnorm_buffers(model) if not cfg.parallel.sync_batchnorm else []

    def build_optimizer(self, factory: OptimizerFactory) -> Any:
        from plait.parallel.zero import ZeroOptimizer

        probe = factory(self.model)  # holds no state: only its class, groups and hyperparameters are used
        cls, defaults, groups = optimizer_recipe(probe)
        if cls.__name__ not in ELEMENTWISE or not cls.__module__.startswith("torch.optim"):
            raise LayoutError(
                f"parallel.zero={self.cfg.parallel.zero} shards each optimizer state into flat slices, which "
                f"computes the unsharded update only for elementwise optimizers ({', '.join(ELEMENTWISE)} from "
                f"torch.optim); {cls.__module__}.{cls.__name__} is not one of them. Use parallel.zero=3 or 0")
        p = self.cfg.parallel
        self.optimizer = ZeroOptimizer(self.model, groups, cls, group=self.topo.dp_group, stage=p.zero,
                                       bucket_mb=p.bucket_mb, offload=p.offload == "optimizer", **defaults)
        self.optimizer.use_comm(self.comm)  # its collectives go through the comm layer: counted, guarded
        return self.optimizer

    def scheduler_target(self) -> torch.optim.Optimizer:
        return self.optimizer.optimizer  # the inner torch optimizer: its param_groups are the ones stepped

    def forward_wrapper(self) -> Callable | None:
        return None

    def set_sync(self, enabled: bool) -> None:
        self.optimizer.set_sync(enabled)

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

    def __init__(self, model: nn.Module, cfg: Config, topo: Topology, comm: Comm) -> None:
        from plait.parallel.fsdp import apply_fsdp

        p = cfg.parallel
        param_dtype = torch.bfloat16 if cfg.train.precision == "bf16" else None
        # Expert-parallel parameters: sharded by FSDP2 over their expert-data-parallel ranks when there are
        # several (plait.parallel.expert.fsdp_shard_experts), else kept out of FSDP and reduced over ep.
        experts = {q for q in model.parameters() if is_expert(q)}
        if experts and topo.dp > topo.ep:
            from plait.parallel.expert import fsdp_shard_experts

            fsdp_shard_experts(model, topo, param_dtype=param_dtype, reshard_after_forward=p.reshard_after_forward)
            experts = set()
        self.model = apply_fsdp(model, topo.dp_mesh, param_dtype=param_dtype, offload=p.offload,
                                reshard_after_forward=p.reshard_after_forward, ignored_params=experts or None)
        self.engine = None
        self.topo, self.comm = topo, comm
        self._bn = batchnorm_buffers(model) if not p.sync_batchnorm else []

    def forward_wrapper(self) -> Callable | None:
        return None

    def set_sync(self, enabled: bool) -> None:
        self.model.set_requires_gradient_sync(enabled)

    def no_sync(self) -> contextlib.AbstractContextManager:
        from plait.parallel.fsdp import no_gradient_sync

        return no_gradient_sync(self.model)

    def finish(self) -> None:
        """FSDP2 waits for its reduce-scatters at the end of backward."""

    def grads(self) -> list[torch.Tensor]:
        return [p.grad.to_local() for p in self.model.parameters() if p.grad is not None]

    def clip_grad_norm(self, max_norm: float) -> float:
        from plait.parallel.fsdp import clip_grad_norm_

        return float(clip_grad_norm_(self.model, max_norm))

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def full_model_state(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        # cpu_offload: torch gathers the full tensors to rank 0's CPU memory only
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=rank0_only))
