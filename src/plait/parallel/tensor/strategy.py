"""Tensor parallelism as strategies (``plait.parallel.strategy``), and what the model-parallel strategies share.

``Tensor``: a model sharded over the ``tp`` axis (its plan applied by ``apply.py``), data parallel
over the dp axis with plait's reducer (which copies DTensor gradient shards into its buckets).

``TensorFsdp``: 2-D, the tensor-parallel model sharded again over dp with FSDP2 (ZeRO-3); 3-D under hybrid
sharding (``parallel.dp_shard``: the dp axis is then ``dp_replicate x dp_shard``, HSDP over the tensor shards).

``ModelParallel`` is their base and the pipeline's (``plait.parallel.pipeline.strategy``). Gradient clipping
with a mix of sharded and replicated parameters: each parameter's squared norm is summed over the mesh axes
it is sharded on (tp for Megatron shards, dp for FSDP shards), replicated ones count once, and the stages'
sums are added over the pp group, with later stages' copies of a tied parameter left out (they are the same
parameter as the first stage's).

Checkpoints use one format for every layout: model entries and optimizer states keyed by the
single-process model's parameter names. Here the optimizer state tensors themselves are handed to
DCP, which loads into them in place; a pipeline copy of a tied parameter takes its state under the
name that parameter has in the single-process model.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard  # FSDP2's dp shard of a tp shard

from plait.comm.collectives import Comm
from plait.components.dcp_pieces import PiecesLoadPlanner, PiecesSavePlanner
from plait.components.optim import materialize_optimizer_state
from plait.config import Config, ConfigError, ParallelConfig
from plait.parallel.apply import ModelSpec
from plait.parallel.data.reducer import GradReducer, LocalGrads, local_grad
from plait.parallel.data.strategy import ReducerSync
from plait.parallel.strategy import Strategy, register_strategy
from plait.parallel.tensor.plan import full_state_dict, loss_context
from plait.parallel.tensor.strided import is_strided, strided_entries
from plait.topology import Topology


def sum_sharded_squares(pairs: Iterable[tuple[nn.Parameter, torch.Tensor]]) -> torch.Tensor:
    """Sum of squared gradient entries over every rank's shards, as a float64 scalar on every rank.

    ``pairs`` are (parameter, local gradient shard). A DTensor's local sum counts once per mesh axis it is
    replicated on and must be summed over each axis it is sharded on (tp for a Megatron shard, dp for an
    FSDP shard, both for a 2-D one): parameters are grouped by that set of axes, and each group's sum is
    all-reduced over those axes' groups. Plain tensors are replicated: their local sum is the sum.
    """
    groups: dict[tuple, torch.Tensor] = {}
    axes: dict[tuple, list[dist.ProcessGroup]] = {}
    for p, g in pairs:
        key: tuple = ()
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            dims = [i for i, pl in enumerate(p.placements) if pl.is_shard() or isinstance(pl, _StridedShard)]
            key = (id(mesh), *dims)
            axes.setdefault(key, [mesh.get_group(i) for i in dims])
        groups[key] = groups.get(key, torch.zeros((), dtype=torch.float64)) + g.detach().double().pow(2).sum()
    total = torch.zeros((), dtype=torch.float64)
    for key, sq in groups.items():
        for group in axes.get(key, []):
            dist.all_reduce(sq, group=group)
        total += sq
    return total


def scale_down(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Multiply ``grads`` by torch's clipping coefficient ``max_norm / (norm + 1e-6)``, at most 1, and by 1 where
    ``norm`` is not finite (the step is skipped): on the device, computed in ``norm``'s float64 as the host did."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    coef = torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))
    for g in grads:
        g.mul_(coef)


class ModelParallel(ReducerSync, Strategy):
    """Shared parts of the tensor and pipeline strategies (see the module docstring)."""

    torch_collectives = True

    named: list[tuple[str, nn.Parameter]]  # (single-process name, parameter), each parameter once
    tied_copies: set[int] = frozenset()  # id() of later stages' copies of tied parameters

    def _init_reducer(self, holder: nn.Module) -> None:
        self.engine = GradReducer(holder, self.topo.dp_group, self.comm, self.cfg.parallel.bucket_mb,
                                  broadcast=False) if self.topo.dp > 1 else LocalGrads(holder)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.named)

    def grads(self) -> list[torch.Tensor]:
        return [g for _, p in self.named if (g := local_grad(p)) is not None]

    def zero_grad(self) -> None:
        for _, p in self.named:
            p.grad = None

    def sharded_squares(self, skip: set[int] = frozenset()) -> torch.Tensor:
        """The squared gradient norm of this rank's parameters summed over their tp and FSDP shards (each
        tied parameter once); not yet summed over pipeline stages."""
        return sum_sharded_squares((p, g) for _, p in self.named if (g := local_grad(p)) is not None
                                   and id(p) not in self.tied_copies and id(p) not in skip)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm over tp shards, FSDP dp shards and pp stages (float64, on the device, not read);
        scales the local gradients in place. Communication: one all-reduce per (sharding pattern, mesh axis)
        pair, then one over pp."""
        total = self.sharded_squares()
        if self.topo.degree("pp") > 1:
            dist.all_reduce(total, group=self.topo.group("pp"))
        norm = total.sqrt()
        if not math.isinf(max_norm):
            scale_down(self.grads(), norm, max_norm)
        return norm

    def state_dicts(self) -> tuple[dict, dict]:
        materialize_optimizer_state(self.optimizer)
        state = {}
        for name, p in self.named:
            if name in state:  # a tied parameter's copy on the same rank as the original: saved once
                continue
            state[name] = self.optimizer.state[p]
        # packed expert weights split over tp (``_StridedShard``) go to DCP as boxes: plait.parallel.tensor.strided
        return strided_entries(self.model_state()), {"state": {k: strided_entries(st) for k, st in state.items()}}

    def _strided(self) -> bool:
        return any(is_strided(p) for _, p in self.named)

    def save_planner(self) -> Any:
        return PiecesSavePlanner(lowest_rank=False) if self._strided() else None

    def load_planner(self) -> Any:
        return PiecesLoadPlanner() if self._strided() else None

    def load_state_dicts(self, model_sd: dict, optim_sd: dict) -> None:
        """DCP loaded in place into the tensors ``state_dicts`` handed out. Where one rank holds several
        copies of a tied parameter, only the first copy's state was in the template: the others take it."""
        first: dict[str, nn.Parameter] = {}
        for name, p in self.named:
            if name not in first:
                first[name] = p
            elif p is not first[name]:
                for k, v in self.optimizer.state[first[name]].items():
                    self.optimizer.state[p][k].copy_(v)


@register_strategy
class Tensor(ModelParallel):
    """A tensor-parallel model (already sharded by the composition's plan), data parallel over dp."""

    name = "tensor"
    compile_blocks_because = "tensor parallelism compiles its DTensor blocks one by one"
    priority = 30

    @classmethod
    def applies(cls, p: ParallelConfig) -> bool:
        return p.tp > 1

    @classmethod
    def check(cls, cfg: Config, degrees: dict[str, int]) -> None:
        p = cfg.parallel
        if p.sequence_parallel and p.tp == 1:
            raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1")
        if p.tp > 1 and p.zero in (1, 2):
            raise ConfigError(
                f"parallel.zero={p.zero} (plait's flat-buffer sharded optimizer) does not take tensor-parallel "
                f"parameters; with parallel.tp={p.tp} use parallel.zero=3 (FSDP2 over dp on top of tp: 2-D; add "
                "parallel.reshard_after_forward=false for ZeRO-2's memory, parameters kept whole through backward) "
                "or 0")

    def __init__(self, model: nn.Module, cfg: Config, topo: Topology, comm: Comm,
                 spec: ModelSpec | None = None) -> None:
        super().__init__(model, cfg, topo, comm, spec)
        self.named = [(n.replace("_checkpoint_wrapped_module.", ""), p) for n, p in self.model.named_parameters()]
        self._init_reducer(self.model)

    def context(self) -> contextlib.AbstractContextManager:
        return loss_context(self.model)  # forward and backward both inside it (loss parallel)

    def model_state(self) -> dict:
        return self.model.state_dict()

    def full_model_state(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        return full_state_dict(self.model)


@register_strategy
class TensorFsdp(Tensor):
    """2-D: the tensor-parallel model sharded again over dp with FSDP2 (ZeRO-3), on one (dp, tp) mesh.

    ``fully_shard`` on the dp axis turns each tensor-parallel DTensor into a 2-D DTensor: dim 0 sharded
    over dp, its Megatron placement kept over tp (parameters that tensor parallelism left plain become
    1-D dp shards). Forward all-gathers a block's dp shards, so each rank runs the tensor-parallel block on
    its own data; backward reduce-scatters the gradients over dp (``plait.parallel.fsdp.shard``). The optimizer
    holds only this rank's 1/(dp*tp) of the states; clipping sums the squares over both axes.
    """

    name = "tensor_fsdp"
    priority = 50
    shards_gradients = True
    shards_meta = True

    @classmethod
    def applies(cls, p: ParallelConfig) -> bool:
        return p.tp > 1 and p.zero == 3

    @classmethod
    def check(cls, cfg: Config, degrees: dict[str, int]) -> None:
        """Tensor's own checks run through its registration."""

    def __init__(self, model: nn.Module, cfg: Config, topo: Topology, comm: Comm,
                 spec: ModelSpec | None = None) -> None:
        from plait.parallel.fsdp.shard import apply_fsdp

        Strategy.__init__(self, model, cfg, topo, comm, spec)
        p = cfg.parallel
        param_dtype = torch.bfloat16 if cfg.train.compute_precision == "bf16" else None
        self.model = apply_fsdp(model, topo.fsdp_mesh, param_dtype=param_dtype, offload=p.offload,
                                reshard_after_forward=p.reshard_after_forward)
        self.named = [(n.replace("_checkpoint_wrapped_module.", ""), q) for n, q in self.model.named_parameters()]
        self.engine = None

    def uses_autocast(self) -> bool:
        return self.precision not in ("fp32", "bf16")  # FSDP2's mixed-precision policy casts to bf16

    def set_sync(self, enabled: bool) -> None:
        self.model.set_requires_gradient_sync(enabled)

    def no_sync(self) -> contextlib.AbstractContextManager:
        from plait.parallel.fsdp.shard import no_gradient_sync

        return no_gradient_sync(self.model)

    def finish(self) -> None:
        """FSDP2 waits for its reduce-scatters at the end of backward."""
