"""Pipeline stages with sharded data parallelism: ZeRO-1/2 (``PipelineZero``) and ZeRO-3 or hybrid sharding on
FSDP2 (``PipelineFsdp``), each over the data-parallel ranks of a stage (the ranks holding the same stage).

The composition order is the documented one: tensor parallel, the pipeline split, the data-parallel wrapping
of each stage, then the optimizer (torchtitan composes its pipeline stages with FSDP the same way). Both are
the ``Pipeline`` strategy with its three data-parallel hooks overridden (``plait.parallel.pipeline.strategy``).

ZeRO-1/2: plait's ``ZeroOptimizer`` over this rank's stage parameters (each once, a tied copy under its
single-process name) and the stage's data-parallel group. Every pipeline micro-batch runs its own backward,
so a schedule step runs under the optimizer's ``no_sync`` (gradients accumulate in its flat buckets) and
``finish`` reduces them once per optimizer step: ZeRO-1 all-reduces each bucket, ZeRO-2 reduce-scatters it;
neither overlaps the pipeline's backward, and ZeRO-2's full local buckets live until then (it saves gradient
memory after the step, not during the backward). Gradients that torch's zero-bubble schedule writes straight
into ``.grad`` (its weight pass, which no accumulation hook sees) are added to the buckets first. Tied copies
(a GPT's embedding and head on the first and last stage) are summed in the local buckets before the
reduction: a sum of sums either way. Clipping sums the squares of this rank's gradient shards, tied copies
left out, over the data-parallel group and then over the pipeline.

ZeRO-3 / HSDP: each stage module is sharded by FSDP2 over ``Topology.fsdp_mesh`` (1-D, or the 2-D
``(dp_replicate, dp_shard)`` mesh under ``parallel.dp_shard``) before it becomes a ``PipelineStage``: the
model's blocks it holds are one unit each, the rest is the stage's root unit. torch's schedules drive FSDP2
themselves: no reduction during the micro-batches' backwards, one reduce-scatter (and, under HSDP, the
all-reduce across replicas) after a step's last backward, so gradients are reduced once per schedule step,
that is once per accumulation micro-step (FSDP2 adds each to the sharded gradient already there).
``train.precision = "bf16"`` computes through FSDP2's mixed-precision policy, as ZeRO-3 does without a pipeline:
the sharded parameters (and the optimizer) stay fp32, each unit is gathered in bf16 and the stages run in bf16
without autocast, so the residual stream, what the stages send and receive and what they save for backward are
bf16 and no Linear keeps a cast of its weight or input (Llama 3's layout: bf16 compute over fp32 master weights,
gradients reduced in fp32); fp16 stays autocast over fp32 parameters. Tied copies are summed shard by shard
after the reduction: the copies on the first and last stage are sharded alike, and the ranks summing them hold
the same data-parallel coordinates.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.components.optim import optimizer_recipe
from plait.config import Config, ConfigError, ParallelConfig
from plait.parallel.pipeline.strategy import Pipeline
from plait.parallel.strategy import OptimizerFactory, register_strategy
from plait.parallel.tensor.strategy import scale_down
from plait.parallel.units import find_blocks
from plait.parallel.zero.optimizer import ZeroOptimizer
from plait.parallel.zero.strategy import check_elementwise


@register_strategy
class PipelineZero(Pipeline):
    """Pipeline stages whose optimizer states (ZeRO-1) and gradients (ZeRO-2) are sharded over the stage's
    data-parallel ranks by plait's ``ZeroOptimizer`` (module docstring)."""

    name = "pipeline_zero"
    priority = 45
    shards_gradients = True
    optimizer: ZeroOptimizer

    @classmethod
    def applies(cls, p: ParallelConfig) -> bool:
        return p.pp > 1 and p.zero in (1, 2)

    @classmethod
    def check(cls, cfg: Config, degrees: dict[str, int]) -> None:
        """The pipeline's, ZeRO's and tensor parallelism's checks run through their own registrations."""

    def init_data_parallel(self) -> None:
        self.engine = None  # the ZeroOptimizer, built in build_optimizer, synchronises the gradients

    def build_optimizer(self, factory: OptimizerFactory) -> Any:
        p = self.cfg.parallel
        probe = factory(self.model)  # holds no state: only its class, groups and hyperparameters are used
        cls, defaults, groups = optimizer_recipe(probe)
        check_elementwise(cls, f"parallel.zero={p.zero}", "Use parallel.zero=3 or 0")
        self.optimizer = ZeroOptimizer(self.model, groups, cls, group=self.topo.dp_group, stage=p.zero,
                                       bucket_mb=p.bucket_mb, offload=p.offload == "optimizer", **defaults)
        self.optimizer.use_comm(self.comm)
        self._where = {id(q): (b, i) for b in self.optimizer.buckets for i, q in enumerate(b.params)}
        self._skip = _copy_ranges(self.optimizer, self._where, self.tied_copies)
        return self.optimizer

    def scheduler_target(self) -> torch.optim.Optimizer:
        return self.optimizer.optimizer

    def stage_no_sync(self) -> contextlib.AbstractContextManager:
        return self.optimizer.no_sync()

    def set_sync(self, enabled: bool) -> None:
        self.optimizer.set_sync(enabled)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.optimizer.no_sync()

    def _grad_view(self, p: nn.Parameter) -> torch.Tensor:
        """``p``'s local (unreduced) gradient: its slice of its bucket's flat buffer."""
        b, i = self._where[id(p)]
        off = b.offsets[i]
        return b.ensure_grad_full()[off:off + p.numel()].view_as(p)

    def finish(self) -> None:
        """Gradients left in ``.grad`` into the buckets, the tied copies summed there (over pp), then ZeRO's
        reduction over dp (module docstring)."""
        for b in self.optimizer.buckets:
            for q, off in zip(b.params, b.offsets, strict=True):
                if q.grad is not None:
                    b.ensure_grad_full()[off:off + q.numel()].add_(q.grad.reshape(-1))
                    q.grad = None
        self.runner.sync_tied_grads(self._grad_view)
        self.optimizer.finish_grad_sync()

    def grads(self) -> list[torch.Tensor]:
        return [b.grad_shard for b in self.optimizer.buckets]

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global norm over the dp shards and the pp stages, each tied parameter once (float64, on the device).
        Communication: one all-reduce of a scalar over dp, one over pp."""
        self.optimizer.finish_grad_sync()
        sq = torch.zeros((), dtype=torch.float64)
        for b, skip in zip(self.optimizer.buckets, self._skip, strict=True):
            g = b.grad_shard.detach().double()
            sq += g.pow(2).sum() - sum((g[a:e].pow(2).sum() for a, e in skip), torch.zeros((), dtype=torch.float64))
        dist.all_reduce(sq, group=self.topo.dp_group)
        dist.all_reduce(sq, group=self.topo.group("pp"))
        norm = sq.sqrt()
        if not math.isinf(max_norm):
            scale_down([b.grad_shard for b in self.optimizer.buckets], norm, max_norm)
        return norm

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def state_dicts(self) -> tuple[dict, dict]:
        optim_sd = self.optimizer.state_dict()  # collective over dp: the canonical (unsharded) layout
        self._param_groups = optim_sd["param_groups"]
        return self.runner.state_dict(), {"state": optim_sd["state"]}

    def load_state_dicts(self, model_sd: dict, optim_sd: dict) -> None:
        self.runner.load_state_dict(model_sd)
        self.optimizer.load_state_dict({"state": optim_sd["state"], "param_groups": self._param_groups})


def _copy_ranges(zopt: ZeroOptimizer, where: dict[int, tuple[Any, int]], copies: set[int]) -> list[list[tuple]]:
    """Per bucket, the ``(start, end)`` ranges of this rank's gradient shard that belong to a later stage's copy
    of a tied parameter (left out of the norm: the first stage counts it)."""
    out: list[list[tuple]] = [[] for _ in zopt.buckets]
    index = {id(b): k for k, b in enumerate(zopt.buckets)}
    for pid in copies:
        if pid not in where:
            continue
        b, i = where[pid]
        lo, hi = zopt.rank * b.chunk, (zopt.rank + 1) * b.chunk
        a, e = max(b.offsets[i], lo), min(b.offsets[i] + b.params[i].numel(), hi)
        if a < e:
            out[index[id(b)]].append((a - lo, e - lo))
    return out


@register_strategy
class PipelineFsdp(Pipeline):
    """Pipeline stages each sharded by FSDP2 over the stage's data-parallel ranks: ZeRO-3, or hybrid sharding
    with ``parallel.dp_shard`` (module docstring)."""

    name = "pipeline_fsdp"
    priority = 55  # above TensorFsdp's: a pipeline of tensor-parallel stages sharded by FSDP2 is this one
    shards_gradients = True

    @classmethod
    def applies(cls, p: ParallelConfig) -> bool:
        return p.pp > 1 and p.zero == 3

    @classmethod
    def check(cls, cfg: Config, degrees: dict[str, int]) -> None:
        """The zero-bubble schedule's weight pass computes gradients for the parameters a stage module
        registers, which under FSDP2 are the shards, not the gathered tensors the forward used: its weight
        gradients would be lost, so it is refused (the pipeline's, FSDP's and ZeRO's own checks run through
        their registrations)."""
        p = cfg.parallel
        if p.pp > 1 and p.zero == 3 and p.pp_schedule == "zbv":
            raise ConfigError("parallel.pp_schedule=zbv does not compose with parallel.zero=3 in this build (its "
                              "weight-gradient pass misses FSDP2's gathered parameters); use pp_schedule=1f1b, "
                              "gpipe or interleaved, or zero=1 or 2")

    def stage_preparation(self, model: nn.Module) -> Callable[[nn.Module], nn.Module]:
        from plait.parallel.fsdp.shard import apply_fsdp

        blocks = {id(m) for _, m in find_blocks(model)}  # found on the whole model: a stage holds some
        mesh, p = self.topo.fsdp_mesh, self.cfg.parallel

        param_dtype = torch.bfloat16 if self.cfg.train.compute_precision == "bf16" else None

        def prepare(stage: nn.Module) -> nn.Module:
            units = [m for m in stage.modules() if id(m) in blocks]
            return apply_fsdp(stage, mesh, param_dtype=param_dtype, offload=p.offload,
                              reshard_after_forward=p.reshard_after_forward, blocks=units)
        return prepare

    def uses_autocast(self) -> bool:
        return self.precision not in ("fp32", "bf16")  # FSDP2's mixed-precision policy casts to bf16

    def init_data_parallel(self) -> None:
        self.engine = None  # FSDP2, driven by torch's schedule, reduces the gradients
        mesh = self.topo.fsdp_mesh
        for tie in self.runner.ties:  # a rank adding zeros for a copy it lacks needs the shard's shape
            if not tie.params:
                tie.shape = shard_shape(tie.shape, mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1))

    def stage_no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # torch's schedule switches FSDP2's gradient sync itself

    def set_sync(self, enabled: bool) -> None:
        """Nothing: gradients are reduced after every schedule step (module docstring)."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def finish(self) -> None:
        """The tied copies' reduced shards summed over pp (FSDP2 reduced them in the schedule step)."""
        self.runner.sync_tied_grads()


def shard_shape(shape: torch.Size, n: int, index: int) -> torch.Size:
    """The local shape FSDP2 gives shard ``index`` of ``n`` of a tensor of ``shape`` (``torch.chunk`` on dim 0;
    a rank past the last chunk holds none of it)."""
    chunks = torch.empty(shape, device="meta").chunk(n, dim=0)
    return chunks[index].shape if index < len(chunks) else torch.Size([0, *shape[1:]])
