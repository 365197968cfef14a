"""ZeRO-3 and hybrid sharding (HSDP) on FSDP2 as a strategy (``Fsdp``): parameters, gradients and optimizer
states sharded over the data-parallel ranks (``plait.parallel.fsdp.shard`` wraps the model), the optimizer
built over the DTensor shards. ``check_dp_shard`` owns ``parallel.dp_shard`` for every layout that shards with
FSDP2 (tensor and pipeline parallelism too).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from plait.comm.collectives import Comm
from plait.config import Config, ConfigError, ParallelConfig
from plait.parallel.apply import ModelSpec
from plait.parallel.data.strategy import BatchNormAveraging
from plait.parallel.strategy import Strategy, register_strategy
from plait.parallel.units import is_expert
from plait.topology import Topology


@register_strategy
class Fsdp(BatchNormAveraging, Strategy):
    """ZeRO stage 3 on FSDP2: parameters, gradients and optimizer states sharded over the data-parallel ranks,
    or, with ``parallel.dp_shard = N`` (hybrid sharding, HSDP), over groups of N ranks and replicated across
    the ``dp / N`` groups: the same strategy on the 2-D mesh ``Topology.fsdp_mesh`` (``plait.parallel.fsdp.shard``).
    Its check owns ``parallel.dp_shard`` for every layout that shards with FSDP2 (tensor and pipeline too)."""

    name = "fsdp"
    compile_blocks_because = "FSDP2 gathers each block's parameters around that block's forward"
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
        from plait.parallel.fsdp.shard import apply_fsdp

        super().__init__(model, cfg, topo, comm, spec)
        p = cfg.parallel
        param_dtype = torch.bfloat16 if cfg.train.compute_precision == "bf16" else None
        # Expert-parallel parameters: sharded by FSDP2 over their expert-data-parallel ranks when there are
        # several (plait.parallel.expert.dispatch.fsdp_shard_experts), else kept out of FSDP and reduced over ep.
        experts = {q for q in model.parameters() if is_expert(q)}
        if experts and topo.dp > topo.ep:
            from plait.parallel.expert.dispatch import fsdp_shard_experts

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
        from plait.parallel.fsdp.shard import no_gradient_sync

        return no_gradient_sync(self.model)

    def grads(self) -> list[torch.Tensor]:
        return [p.grad.to_local() for p in self.model.parameters() if p.grad is not None]

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        from plait.parallel.fsdp.shard import clip_grad_norm_

        return clip_grad_norm_(self.model, max_norm, self.trainable())

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

