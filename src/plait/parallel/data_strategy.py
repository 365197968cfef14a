"""Data-parallel strategies: plait's reducer or DDP (``DataParallel``), ZeRO-1/2 (``Zero``), ZeRO-3 on FSDP2
(``Fsdp``). Each holds a full replica's computation; they differ in what each rank stores of the model's
state and how gradients are synchronised.

The optimizer comes from a factory called with ``strategy.model`` once the layout is applied, so it
always holds the parameters the layout trains (DTensor shards under FSDP2). ZeRO-1/2 calls the factory
too, then rebuilds the same optimizer class with the same groups and hyperparameters over its flat shards.

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
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from plait.comm.collectives import Comm
from plait.components.optim import optimizer_recipe
from plait.config import Config, ConfigError, ParallelConfig
from plait.parallel.apply import ModelSpec
from plait.parallel.data import GradReducer, TorchDDP, apply_data_parallel
from plait.parallel.strategy import LayoutError, OptimizerFactory, Strategy, register_strategy
from plait.parallel.units import batchnorm_buffers, is_expert
from plait.parallel.zero import validate_zero
from plait.topology import Topology

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

    def clip_grad_norm(self, max_norm: float) -> float:
        flats = self._flat_grads()
        if flats is None:
            return super().clip_grad_norm(max_norm)
        # torch's formula (coefficient max_norm / (norm + 1e-6), at most 1) on the bucket buffers:
        # a parameter without a gradient this step holds zeros there, so the norm is the same.
        total = torch.nn.utils.get_total_norm(flats, foreach=None)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if coef < 1.0:
            for f in flats:
                f.mul_(coef)
        return float(total)

    def zero_grad(self) -> None:
        self.engine.zero_grad()


@register_strategy
class Zero(BatchNormAveraging, Strategy):
    """ZeRO stages 1-2: plait's sharded optimizer owns gradient synchronisation."""

    name = "zero"
    priority = 20
    shards_gradients = True

    @classmethod
    def applies(cls, p: ParallelConfig) -> bool:
        return p.zero in (1, 2)

    @classmethod
    def check(cls, cfg: Config, degrees: dict[str, int]) -> None:
        import torch.cuda

        p = cfg.parallel
        dp = degrees["dp_replicate"] * degrees["dp_shard"] * degrees["ep"]
        try:
            validate_zero(p.zero, dp, p.offload, "cuda" if torch.cuda.is_available() else "cpu")
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def __init__(self, model: nn.Module, cfg: Config, topo: Topology, comm: Comm,
                 spec: ModelSpec | None = None) -> None:
        super().__init__(model, cfg, topo, comm, spec)
        self._track_batchnorm(model, cfg, topo)

    def build_optimizer(self, factory: OptimizerFactory) -> Any:
        from plait.parallel.zero import ZeroOptimizer

        probe = factory(self.model)  # holds no state: only its class, groups and hyperparameters are used
        cls, defaults, groups = optimizer_recipe(probe)
        check_elementwise(cls, f"parallel.zero={self.cfg.parallel.zero}", "Use parallel.zero=3 or 0")
        p = self.cfg.parallel
        self.optimizer = ZeroOptimizer(self.model, groups, cls, group=self.topo.dp_group, stage=p.zero,
                                       bucket_mb=p.bucket_mb, offload=p.offload == "optimizer", **defaults)
        self.optimizer.use_comm(self.comm)  # its collectives go through the comm layer: counted, guarded
        return self.optimizer

    def scheduler_target(self) -> torch.optim.Optimizer:
        return self.optimizer.optimizer  # the inner torch optimizer: its param_groups are the ones stepped

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


@register_strategy
class Fsdp(BatchNormAveraging, Strategy):
    """ZeRO stage 3 on FSDP2: parameters, gradients and optimizer states sharded over the data-parallel ranks,
    or, with ``parallel.dp_shard = N`` (hybrid sharding, HSDP), over groups of N ranks and replicated across
    the ``dp / N`` groups: the same strategy on the 2-D mesh ``Topology.fsdp_mesh`` (``plait.parallel.fsdp``).
    Its check owns ``parallel.dp_shard`` for every layout that shards with FSDP2 (tensor and pipeline too)."""

    name = "fsdp"
    priority = 10
    torch_collectives = True
    shards_gradients = True
    shards_meta = True

    @classmethod
    def applies(cls, p: ParallelConfig) -> bool:
        return p.zero == 3

    @classmethod
    def check(cls, cfg: Config, degrees: dict[str, int]) -> None:
        p, c = cfg.parallel, cfg.comm
        if p.zero == 3 and (c.compress != "none" or c.allreduce != "backend"):
            raise ConfigError("parallel.zero=3 reduces gradients inside FSDP2, which comm.compress and comm.allreduce "
                              "do not reach; use parallel.zero=0, 1 or 2 with them")
        check_dp_shard(p)

    def __init__(self, model: nn.Module, cfg: Config, topo: Topology, comm: Comm,
                 spec: ModelSpec | None = None) -> None:
        from plait.parallel.fsdp import apply_fsdp

        super().__init__(model, cfg, topo, comm, spec)
        p = cfg.parallel
        param_dtype = torch.bfloat16 if cfg.train.precision == "bf16" else None
        # Expert-parallel parameters: sharded by FSDP2 over their expert-data-parallel ranks when there are
        # several (plait.parallel.expert.fsdp_shard_experts), else kept out of FSDP and reduced over ep.
        experts = {q for q in model.parameters() if is_expert(q)}
        if experts and topo.dp > topo.ep:
            from plait.parallel.expert import fsdp_shard_experts

            fsdp_shard_experts(model, topo, param_dtype=param_dtype, reshard_after_forward=p.reshard_after_forward)
            experts = set()
        self.model = apply_fsdp(model, topo.fsdp_mesh, param_dtype=param_dtype, offload=p.offload,
                                reshard_after_forward=p.reshard_after_forward, ignored_params=experts or None)
        self._track_batchnorm(model, cfg, topo)

    def uses_autocast(self) -> bool:
        # bf16 runs forward in bf16 through FSDP2's mixed-precision policy instead of autocast
        return self.precision not in ("fp32", "bf16")

    def set_sync(self, enabled: bool) -> None:
        self.model.set_requires_gradient_sync(enabled)

    def no_sync(self) -> contextlib.AbstractContextManager:
        from plait.parallel.fsdp import no_gradient_sync

        return no_gradient_sync(self.model)

    def grads(self) -> list[torch.Tensor]:
        return [p.grad.to_local() for p in self.model.parameters() if p.grad is not None]

    def clip_grad_norm(self, max_norm: float) -> float:
        from plait.parallel.fsdp import clip_grad_norm_

        return float(clip_grad_norm_(self.model, max_norm))

    def full_model_state(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        # cpu_offload: torch gathers the full tensors to rank 0's CPU memory only
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=rank0_only))


def check_dp_shard(p: ParallelConfig) -> None:
    """``parallel.dp_shard`` (hybrid sharding) needs ZeRO-3, more than one rank per shard group and, in this
    build, no expert parallelism; its divisibility is the topology's (``plait.topology.resolve_degrees``)."""
    if not p.dp_shard:
        return
    if p.zero != 3:
        raise ConfigError(f"parallel.dp_shard={p.dp_shard} sets the shard groups of hybrid sharding, which shards "
                          f"parameters with FSDP2 (ZeRO-3); set parallel.zero=3, or parallel.dp_shard=0 with "
                          f"parallel.zero={p.zero}")
    if p.dp_shard == 1:
        raise ConfigError("parallel.dp_shard=1 makes shard groups of one rank, which shard nothing: use "
                          "parallel.zero=0 to replicate, or dp_shard >= 2 (0 shards over every data-parallel rank)")
    if p.ep > 1:
        raise ConfigError(f"parallel.dp_shard={p.dp_shard} with parallel.ep={p.ep}: hybrid sharding does not compose "
                          "with expert parallelism in this build; set parallel.dp_shard=0 (ZeRO-3 over every "
                          "data-parallel rank)")


def check_elementwise(cls: type, what: str, instead: str) -> None:
    """A ``LayoutError`` unless ``cls`` is one of torch's elementwise optimizers, whose update on flat
    shards equals the unsharded one."""
    if cls.__name__ not in ELEMENTWISE or not cls.__module__.startswith("torch.optim"):
        raise LayoutError(f"{what} shards each optimizer state into flat slices, which computes the unsharded "
                          f"update only for elementwise optimizers ({', '.join(ELEMENTWISE)} from torch.optim); "
                          f"{cls.__module__}.{cls.__name__} is not one of them. {instead}")
