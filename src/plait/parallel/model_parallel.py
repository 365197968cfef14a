"""Tensor and pipeline parallelism as strategies (``plait.parallel.strategy``).

``Tensor``: a model sharded over the ``tp`` axis (its plan applied by ``apply.py``), data parallel
over the dp axis with plait's reducer (which copies DTensor gradient shards into its buckets).

``Pipeline``: the (possibly tensor-parallel) model split into stages over the ``pp`` axis and
driven by a ``torch.distributed.pipelining`` schedule; each accumulation micro-batch is one schedule
step over ``parallel.microbatches`` pipeline micro-batches. The loss exists only on the last stage's
rank; it is summed over the pp group so every rank can log it. The user cannot call the stages as one
model: ``Plait.forward_backward`` runs a step.

``TensorFsdp``: 2-D, the tensor-parallel model sharded again over dp with FSDP2 (ZeRO-3).

Gradient clipping with a mix of sharded and replicated parameters: each parameter's squared norm is
summed over the mesh axes it is sharded on (tp for Megatron shards, dp for FSDP shards), replicated
ones count once, and the stages' sums are added over the pp group, with later stages' copies of a
tied parameter left out (they are the same parameter as the first stage's).

Checkpoints use one format for every layout: model entries and optimizer states keyed by the
single-process model's parameter names. Here the optimizer state tensors themselves are handed to
DCP, which loads into them in place; a pipeline copy of a tied parameter takes its state under the
name that parameter has in the single-process model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard  # FSDP2's dp shard of a tp shard

from plait.comm.collectives import Comm
from plait.components.optim import materialize_optimizer_state
from plait.components.precision import autocast
from plait.config import Config, ConfigError, ParallelConfig
from plait.parallel.apply import ModelSpec
from plait.parallel.data import GradReducer, LocalGrads, local_grad
from plait.parallel.pipeline import build_pipeline, measure_layer_costs
from plait.parallel.pipeline_trace import bubble_summary, write_chrome_trace
from plait.parallel.strategy import PlaitError, Strategy, register_strategy
from plait.parallel.strided import StridedLoadPlanner, StridedSavePlanner, is_strided, strided_entries
from plait.parallel.tensor import full_state_dict, local_value, loss_context
from plait.plan.schedule import NATURAL_VIRTUAL, check_pipeline_layout
from plait.topology import Topology


@dataclass
class ScaledLoss:
    """The pipeline's loss function: the user's ``loss(output, target)`` times ``factor`` (1 / (accumulation
    x pipeline micro-batches) x loss scale), set by the layout before each schedule step. With ``record``
    set, the unscaled losses are also appended to it."""

    loss: Callable[[Any, Any], torch.Tensor]
    factor: float = 1.0
    record: list[torch.Tensor] | None = None

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        loss = self.loss(output, target)
        if self.record is not None:
            self.record.append(local_value(loss.detach()))
        return loss * self.factor


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


class ModelParallel(Strategy):
    """Shared parts of the tensor and pipeline strategies (see the module docstring)."""

    torch_collectives = True

    named: list[tuple[str, nn.Parameter]]  # (single-process name, parameter), each parameter once
    tied_copies: set[int] = frozenset()  # id() of later stages' copies of tied parameters

    def _init_reducer(self, holder: nn.Module) -> None:
        self.engine = GradReducer(holder, self.topo.dp_group, self.comm, self.cfg.parallel.bucket_mb,
                                  broadcast=False) if self.topo.dp > 1 else LocalGrads(holder)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.named)

    def set_sync(self, enabled: bool) -> None:
        self.engine.set_sync(enabled)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.engine.no_sync()

    def finish(self) -> None:
        self.engine.finish()

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

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global gradient norm over tp shards, FSDP dp shards and pp stages; scales the local gradients
        in place. Communication: one all-reduce per (sharding pattern, mesh axis) pair, then one over pp."""
        total = self.sharded_squares()
        if self.topo.degree("pp") > 1:
            dist.all_reduce(total, group=self.topo.group("pp"))
        norm = float(total.sqrt())
        if norm == norm and norm != float("inf"):
            coef = min(1.0, max_norm / (norm + 1e-6))
            if coef < 1.0:
                for g in self.grads():
                    g.mul_(coef)
        return norm

    def state_dicts(self) -> tuple[dict, dict]:
        materialize_optimizer_state(self.optimizer)
        state = {}
        for name, p in self.named:
            if name in state:  # a tied parameter's copy on the same rank as the original: saved once
                continue
            state[name] = self.optimizer.state[p]
        # packed expert weights split over tp (``_StridedShard``) go to DCP as boxes: plait.parallel.strided
        return strided_entries(self.model_state()), {"state": {k: strided_entries(st) for k, st in state.items()}}

    def _strided(self) -> bool:
        return any(is_strided(p) for _, p in self.named)

    def save_planner(self) -> Any:
        return StridedSavePlanner() if self._strided() else None

    def load_planner(self) -> Any:
        return StridedLoadPlanner() if self._strided() else None

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
    its own data; backward reduce-scatters the gradients over dp (``plait.parallel.fsdp``). The optimizer
    holds only this rank's 1/(dp*tp) of the states; clipping sums the squares over both axes.
    """

    name = "tensor_fsdp"
    priority = 50
    shards_gradients = True

    @classmethod
    def applies(cls, p: ParallelConfig) -> bool:
        return p.tp > 1 and p.zero == 3

    @classmethod
    def check(cls, cfg: Config, degrees: dict[str, int]) -> None:
        """Tensor's own checks run through its registration."""

    def __init__(self, model: nn.Module, cfg: Config, topo: Topology, comm: Comm,
                 spec: ModelSpec | None = None) -> None:
        from plait.parallel.fsdp import apply_fsdp

        Strategy.__init__(self, model, cfg, topo, comm, spec)
        p = cfg.parallel
        param_dtype = torch.bfloat16 if cfg.train.precision == "bf16" else None
        self.model = apply_fsdp(model, topo.mesh["dp_replicate"], param_dtype=param_dtype, offload=p.offload,
                                reshard_after_forward=p.reshard_after_forward)
        self.named = [(n.replace("_checkpoint_wrapped_module.", ""), q) for n, q in self.model.named_parameters()]
        self.engine = None

    def uses_autocast(self) -> bool:
        return self.precision not in ("fp32", "bf16")  # FSDP2's mixed-precision policy casts to bf16

    def set_sync(self, enabled: bool) -> None:
        self.model.set_requires_gradient_sync(enabled)

    def no_sync(self) -> contextlib.AbstractContextManager:
        from plait.parallel.fsdp import no_gradient_sync

        return no_gradient_sync(self.model)

    def finish(self) -> None:
        """FSDP2 waits for its reduce-scatters at the end of backward."""


class PipelineModel(nn.Module):
    """This rank's pipeline stages as one module: what ``Plait.setup`` returns under pipeline parallelism.

    Its ``named_parameters()`` give each parameter once under its single-process name (a tied copy under
    the name of the parameter it copies), so an optimizer factory groups them as it would the whole
    model's. It cannot be called: under pipeline parallelism forward and backward interleave over
    micro-batches, so ``Plait.forward_backward(model, batch)`` runs them."""

    def __init__(self, runner: Any) -> None:
        super().__init__()
        self.stages = nn.ModuleList(runner.modules)
        self._runner = [runner]  # in a list: not a submodule

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for name, p in self._runner[0].named_parameters():
            yield (f"{prefix}.{name}" if prefix else name), p

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self._runner[0].state_dict()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("under pipeline parallelism (parallel.pp > 1) the model is split over ranks and "
                           "forward and backward interleave over micro-batches: call "
                           "loss = p.forward_backward(model, batch) instead of model(...) and p.backward(loss)")


@register_strategy
class Pipeline(ModelParallel):
    """The model (tensor-parallel already, or not) split into pipeline stages over the pp axis."""

    name = "pipeline"
    priority = 40
    model_whole = False

    @classmethod
    def wants_sample(cls, cfg: Config) -> bool:
        return cfg.parallel.pp_balance == "cost"

    @classmethod
    def applies(cls, p: ParallelConfig) -> bool:
        return p.pp > 1

    @classmethod
    def check(cls, cfg: Config, degrees: dict[str, int]) -> None:
        p, t = cfg.parallel, cfg.train
        if p.pp == 1:
            return
        virtual = p.pp_virtual_stages or NATURAL_VIRTUAL.get(p.pp_schedule, 1)
        try:
            check_pipeline_layout(p.pp_schedule, p.pp, p.microbatches, virtual)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if t.micro_batch_size % p.microbatches:
            raise ConfigError(f"train.micro_batch_size={t.micro_batch_size} must divide into parallel.microbatches="
                              f"{p.microbatches} pipeline micro-batches; make it a multiple of {p.microbatches}")
        if p.zero:
            raise ConfigError(f"parallel.pp={p.pp} composes with plait's data-parallel reducer only in this build "
                              f"(parallel.zero={p.zero}); set parallel.zero=0")

    def __init__(self, model: nn.Module, cfg: Config, topo: Topology, comm: Comm,
                 spec: ModelSpec | None = None) -> None:
        super().__init__(model, cfg, topo, comm, spec)
        p = cfg.parallel
        loss, sample, split, stage_fn = spec.loss, spec.sample, spec.pp_split, spec.stage_fn
        costs = None
        if p.pp_balance == "cost" and sample is not None and stage_fn is None and not split:
            args, _, target = loss.split(sample)
            mb = max(1, args[0].size(0) // p.microbatches)
            costs = measure_layer_costs(model, tuple(a[:mb] for a in args), target[:mb], loss=loss.loss, repeats=2)
        self.loss_fn = ScaledLoss(loss.loss)
        self.loss = loss
        self.schedule = p.pp_schedule
        self.runner = build_pipeline(model, topo.mesh["pp"], schedule=p.pp_schedule, microbatches=p.microbatches,
                                     virtual_stages_per_rank=p.pp_virtual_stages or None, loss_fn=self.loss_fn,
                                     costs=costs, scale_grads=False, split=split or None, stage_fn=stage_fn)
        self.model = PipelineModel(self.runner)
        self.named = self.runner.named_parameters()
        self.tied_copies = set(self.runner.copy_names)
        self._init_reducer(self.model.stages)

    def wrap_forward(self, device: torch.device, compiled: bool) -> None:
        """Nothing: the stages run inside the schedule (under autocast there), never through ``model(...)``."""

    def backward(self, loss: torch.Tensor, scale: float) -> None:
        raise PlaitError("with parallel.pp > 1 forward and backward interleave over pipeline micro-batches: "
                          "use loss = p.forward_backward(model, batch) instead of model(...) and p.backward")

    def forward_backward(self, model: nn.Module, batch: Any, loss: Any, scale: float,
                         before_backward: Callable[[float], None] | None = None,
                         times: dict[str, float] | None = None) -> torch.Tensor:
        """One schedule step over the micro-batch (the stages' loss is the one given to setup); returns the
        unscaled mean loss (0 on ranks without the last stage). Forward and backward interleave, so the
        whole step counts as backward time."""
        import time

        t0 = time.perf_counter()
        if before_backward is not None:  # each pipeline micro-batch's auxiliary losses, scaled like its loss
            before_backward(scale / self.runner.microbatches)
        with autocast(self.precision, self.topo.device):
            value = self._schedule_step(batch, scale)
        if times is not None:
            times["backward_s"] += time.perf_counter() - t0
        return value

    def evaluate(self, model: nn.Module, batch: Any, loss: Any) -> torch.Tensor:
        with autocast(self.precision, self.topo.device):
            return self._evaluate(batch)

    def _split(self, batch: Any) -> tuple[tuple, Any]:
        args, kwargs, target = self.loss.split(batch)
        if kwargs:
            raise ValueError(f"pipeline stages take positional inputs only; the batch gives keyword inputs "
                             f"{sorted(kwargs)}: pass (inputs, target) batches, or a loss whose split gives them")
        return args, target

    def _schedule_step(self, batch: Any, factor: float) -> torch.Tensor:
        """One schedule step over the micro-batch; returns the unscaled mean loss (0 on ranks without the
        last stage)."""
        args, target = self._split(batch)
        # The schedule does not average over pipeline micro-batches (scale_grads=False): the loss does.
        self.loss_fn.factor = factor / self.runner.microbatches
        # Every pipeline micro-batch runs its own backward, so the reducer's end-of-backward callback
        # would fire after the first one: gradients are reduced in finish() instead, after the whole
        # step (no overlap of the data-parallel reduction with the pipeline's backward).
        with self.engine.no_sync():
            loss = self.runner.step(args, target, sync_tied=False)  # tied copies: once per optimizer step
        return loss / self.loss_fn.factor if loss is not None else torch.zeros(())

    @torch.no_grad()
    def _evaluate(self, batch: Any) -> torch.Tensor:
        """Mean loss of the micro-batch on the last stage's rank (0 elsewhere)."""
        args, target = self._split(batch)
        if self.schedule == "zbv":
            return self._evaluate_by_zero_step(args, target)
        self.loss_fn.factor = 1.0
        losses: list | None = [] if self.runner.has_last else None
        sched = self.runner.schedule
        tgt = target if self.runner.has_last else None
        with loss_context(self.runner.loss_parallel):
            if self.runner.has_first:
                sched.eval(*args, target=tgt, losses=losses)
            else:
                sched.eval(target=tgt, losses=losses)
        if not losses:
            return torch.zeros(())
        return torch.stack([local_value(v.detach()) for v in losses]).mean()

    def _evaluate_by_zero_step(self, args: tuple, target: Any) -> torch.Tensor:
        """The zero-bubble V schedule's forward-only mode fails in torch 2.13 ("can't steal_bwd_input if
        this stage doesn't have backward"), so evaluation runs a full step with the loss multiplied by 0,
        records the unscaled losses, and drops the (zero) gradients: twice the cost of a forward pass,
        same numbers. Gradients already accumulated are kept aside and put back."""
        kept = {id(p): p.grad for _, p in self.named}
        for _, p in self.named:
            p.grad = None
        self.loss_fn.factor, self.loss_fn.record = 0.0, []
        try:
            with torch.enable_grad(), self.no_sync():
                self.runner.step(args, target, sync_tied=False)
            values = self.loss_fn.record
        finally:
            self.loss_fn.factor, self.loss_fn.record = 1.0, None
            for _, p in self.named:
                p.grad = kept[id(p)]
        return torch.stack(values).mean() if values else torch.zeros(())

    def finish(self) -> None:
        """Data-parallel reduction, then the tied copies' gradients summed across stages: once per
        optimizer step, after all accumulation micro-steps (both are sums, so their order does not
        matter)."""
        self.engine.finish()
        self.runner.sync_tied_grads()

    def report(self, run_dir: Path | None, measured: dict[str, int] | None, device: torch.device) -> dict[str, Any]:
        """The memory block, bubble accounting of the last pipeline step and ``pipeline_trace.json``
        (collective over pp). Each stage's measured idle fraction (1 - busy / step span) next to the
        theoretical (p-1)/(v*m+p-1); the trace holds every forward/backward of every micro-batch on every stage."""
        out = self._bubble(run_dir)
        out.update(super().report(run_dir, measured, device))
        return out

    def _bubble(self, run_dir: Path | None) -> dict[str, Any]:
        if self.runner.span is None:
            return {}
        gathered = self.runner.gather_timeline()
        if gathered is None or self.topo.rank != 0:
            return {}
        events, spans = gathered
        r = self.runner
        summary = bubble_summary(events, spans, r.microbatches, r.virtual_stages, self.topo.degree("pp"))
        out = {"schedule": self.schedule, **summary}
        if run_dir is not None:
            write_chrome_trace(run_dir / "pipeline_trace.json", events, spans)
            out["trace"] = "pipeline_trace.json"
        return {"pipeline": out}

    def reduce_loss(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the pp group: brings the last stage's loss to every pipeline rank."""
        t = t.detach().double().reshape(1)
        dist.all_reduce(t, group=self.topo.group("pp"))
        return t[0]

    def model_state(self) -> dict:
        return self.runner.state_dict()

    def full_model_state(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Full weights gathered to every rank: stage entries all-gathered over pp, tp shards gathered."""
        mine = {k: local_value(v).detach().cpu() for k, v in self.runner.state_dict().items()}
        parts: list = [None] * self.topo.degree("pp")
        dist.all_gather_object(parts, mine, group=self.topo.group("pp"))
        full: dict[str, torch.Tensor] = {}
        for part in parts:
            full.update(part)
        return full
