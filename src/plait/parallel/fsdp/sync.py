"""ZeRO-3 and hybrid sharding (HSDP) on FSDP2 as a gradient-sync policy (``Fsdp``): parameters, gradients and
optimizer states sharded over the data-parallel ranks (``plait.parallel.fsdp.shard`` makes the units), the optimizer
built over the DTensor shards.

It wraps whatever it is given: the whole model (its repeated blocks one unit each, the rest the root unit), or each
pipeline stage before it becomes a ``PipelineStage`` (the model's blocks that stage holds, then the stage's root),
tensor-parallel DTensors included (2-D: dim 0 sharded over dp, the Megatron placement kept over tp). Expert-parallel
parameters are sharded again over the ranks holding the same experts (``fsdp_shard_experts``; under HSDP over those of
a shard group, replicated across the replicas) where there are several, else left out and reduced by the expert sync.
Under a pipeline, torch's schedules drive FSDP2 themselves (every schedule, the zero-bubble V one included:
``plait.parallel.pipeline.runner``): no reduction during the micro-batches' backwards, one reduce-scatter (and, under
HSDP, the all-reduce across replicas) after a step's last backward. ``train.precision = "bf16"`` computes through
FSDP2's mixed-precision policy (fp32 sharded parameters, each unit gathered in bf16, gradients reduced in fp32) instead
of autocast.

Its check owns ``parallel.dp_shard`` for every layout that shards with FSDP2 (under DiLoCo, the data-parallel ranks of
one replica, inside which it shards over them: ``plait.parallel.data.diloco``).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from plait.config import Config, ConfigError, ParallelConfig
from plait.parallel.expert.dispatch import fsdp_shard_experts
from plait.parallel.fsdp.shard import apply_fsdp, clip_grad_norm_, no_gradient_sync
from plait.parallel.grad_sync import GradSync, register_grad_sync
from plait.parallel.units import is_expert


@register_grad_sync
class Fsdp(GradSync):
    """ZeRO stage 3 on FSDP2; HSDP with ``parallel.dp_shard`` (module docstring)."""

    name = "fsdp"
    compile_blocks_because = "FSDP2 gathers each block's parameters around that block's forward"
    torch_collectives = True
    shards_gradients = True
    shards_meta = True
    casts_bf16 = True
    wraps_modules = True

    @classmethod
    def chosen(cls, p: ParallelConfig) -> bool:
        return p.zero == 3

    @classmethod
    def check(cls, cfg: Config, degrees: dict[str, int]) -> None:
        p, c = cfg.parallel, cfg.comm
        if p.zero == 3 and (c.compress != "none" or c.allreduce != "backend"):
            raise ConfigError("parallel.zero=3 reduces gradients inside FSDP2, which comm.compress and comm.allreduce "
                              "do not reach; use parallel.zero=0, 1 or 2 with them")
        check_dp_shard(p)

    root: nn.Module | None = None

    @property
    def kind(self) -> str:  # type: ignore[override]
        return "HSDP" if self.mesh is not None and self.mesh.ndim == 2 else "FSDP"

    def wrap(self, module: nn.Module, blocks: list[nn.Module] | None) -> nn.Module:
        p = self.cfg.parallel
        param_dtype = torch.bfloat16 if self.cfg.train.compute_precision == "bf16" else None
        experts = {q for q in module.parameters() if is_expert(q)}
        if experts and self.topo.degree("dp_cp") > self.topo.ep:  # ranks holding the same experts shard them too
            fsdp_shard_experts(module, self.topo, param_dtype=param_dtype,
                               reshard_after_forward=p.reshard_after_forward)
            experts = set()
        return apply_fsdp(module, self.mesh, param_dtype=param_dtype, offload=p.offload,
                          reshard_after_forward=p.reshard_after_forward, ignored_params=experts or None, blocks=blocks)

    def attach(self, holder: nn.Module, params: list[nn.Parameter]) -> None:
        super().attach(holder, params)
        # the whole model is one FSDP2 root, whose gradient sync the accumulation switches; a pipeline's stages are
        # switched by torch's schedule
        self.root = holder if hasattr(holder, "set_requires_gradient_sync") else None

    def set_sync(self, enabled: bool) -> None:
        if self.root is not None:
            self.root.set_requires_gradient_sync(enabled)

    def no_sync(self) -> contextlib.AbstractContextManager:
        if self.root is None:
            return contextlib.nullcontext()
        return no_gradient_sync(self.root)

    def schedule_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # torch's schedule switches FSDP2's gradient sync itself

    def grads(self) -> list[torch.Tensor]:
        return [q.grad.to_local() for q in self.params if q.grad is not None]

    def clip_alone(self, max_norm: float) -> torch.Tensor | None:
        if self.root is None:
            return None
        return clip_grad_norm_(self.root, max_norm, self.params)

    def local_shape(self, shape: torch.Size) -> torch.Size:
        """The local shape FSDP2 gives this rank's shard of a tensor of ``shape`` (what a pipeline rank holding no
        copy of a tied weight adds zeros of)."""
        mesh = self.mesh
        return shard_shape(shape, mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1))

    def full_state(self, holder: nn.Module, rank0_only: bool) -> dict[str, torch.Tensor] | None:
        """Each entry of the model's ``state_dict()`` (its hooks applied) gathered in turn; with ``rank0_only`` kept
        only on rank 0, in its CPU memory, so no rank ever holds more than one whole tensor besides."""
        if self.root is None:
            return None
        keep = not rank0_only or self.topo.rank == 0
        out = {}
        for name, t in self.root.state_dict().items():
            whole = t.full_tensor() if isinstance(t, DTensor) else t
            if keep:
                out[name] = whole.cpu() if rank0_only else whole
        return out

    def describe(self) -> str:
        return self.kind


def shard_shape(shape: torch.Size, n: int, index: int) -> torch.Size:
    """The local shape FSDP2 gives shard ``index`` of ``n`` of a tensor of ``shape`` (``torch.chunk`` on dim 0;
    a rank past the last chunk holds none of it)."""
    chunks = torch.empty(shape, device="meta").chunk(n, dim=0)
    return chunks[index].shape if index < len(chunks) else torch.Size([0, *shape[1:]])


def check_dp_shard(p: ParallelConfig) -> None:
    """``parallel.dp_shard`` (hybrid sharding) needs ZeRO-3 and more than one rank per shard group; its divisibility
    is the topology's (``plait.topology.resolve_degrees``). Under DiLoCo it is the data-parallel ranks of one replica
    (``plait.parallel.data.diloco``), whatever the ZeRO stage inside it, one included."""
    diloco = p.sync == "diloco"
    if not p.dp_shard:
        return
    if p.zero != 3 and not diloco:
        raise ConfigError(f"parallel.dp_shard={p.dp_shard} sets the shard groups of hybrid sharding, which shards "
                          f"parameters with FSDP2 (ZeRO-3); set parallel.zero=3, or parallel.dp_shard=0 with "
                          f"parallel.zero={p.zero}")
    if p.dp_shard == 1 and not diloco:
        raise ConfigError("parallel.dp_shard=1 makes shard groups of one rank, which shard nothing: use "
                          "parallel.zero=0 to replicate, or dp_shard >= 2 (0 shards over every data-parallel rank)")
