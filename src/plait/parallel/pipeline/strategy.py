"""Pipeline parallelism as a strategy (``plait.parallel.strategy``), composed with data parallelism.

``Pipeline``: the (possibly tensor-parallel) model split into stages over the ``pp`` axis and driven by a
``torch.distributed.pipelining`` schedule; each accumulation micro-batch is one schedule step over
``parallel.microbatches`` pipeline micro-batches. The loss exists only on the last stage's rank; it is summed
over the pp group so every rank can log it. The user cannot call the stages as one model:
``Plait.forward_backward`` runs a step.

Over the data-parallel ranks of each stage (the ranks holding the same stage), the stage's gradients are
synchronised by plait's reducer here (``parallel.zero = 0``), by ZeRO-1/2 or by FSDP2/HSDP
(``plait.parallel.pipeline.sharded``): the composition order is tensor parallel, then the pipeline split, then
the data-parallel wrapping of each stage, then the optimizer. The three hooks a data-parallel composition
overrides are ``prepare_stage`` (a stage module before it becomes a ``PipelineStage``), ``init_data_parallel``
(the engine over this rank's stages) and ``stage_no_sync`` (the context a schedule step runs in).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.comm.collectives import Comm
from plait.components.precision import autocast
from plait.config import Config, ConfigError, ParallelConfig
from plait.observe.log import get_logger
from plait.parallel.apply import ModelSpec
from plait.parallel.meta_init import is_meta, materialise
from plait.parallel.pipeline.runner import build_pipeline, measure_layer_costs
from plait.parallel.pipeline.trace import bubble_summary, write_chrome_trace
from plait.parallel.strategy import PlaitError, register_strategy
from plait.parallel.tensor.plan import local_value, loss_context
from plait.parallel.tensor.strategy import ModelParallel
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
    compile_blocks_because = "the model is split into pipeline stages"
    reduce_loss_every_step = True  # StepInfo.loss: the last stage's, on every stage, at every step (as ever)
    priority = 40
    model_whole = False
    shards_meta = True

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
        if p.zero and p.ep > 1:
            raise ConfigError(f"parallel.pp={p.pp} with parallel.ep={p.ep} composes with plait's data-parallel reducer "
                              f"only in this build (parallel.zero={p.zero}); set parallel.zero=0")

    def __init__(self, model: nn.Module, cfg: Config, topo: Topology, comm: Comm,
                 spec: ModelSpec | None = None) -> None:
        super().__init__(model, cfg, topo, comm, spec)
        p = cfg.parallel
        loss, sample, split, stage_fn = spec.loss, spec.sample, spec.pp_split, spec.stage_fn
        costs = None
        timed = p.pp_balance == "cost" and sample is not None and stage_fn is None and not split
        if timed and is_meta(model):
            get_logger(topo.rank).warning("parallel.pp_balance=cost times each layer on a sample, which a model on "
                                          "the meta device cannot run: stages are split by layer count (pass "
                                          "pp_split to choose the split)")
        elif timed:
            args, _, target = loss.split(sample)
            mb = max(1, args[0].size(0) // p.microbatches)
            costs = measure_layer_costs(model, tuple(a[:mb] for a in args), target[:mb], loss=loss.loss, repeats=2)
        self.loss_fn = ScaledLoss(loss.loss)
        self.loss = loss
        self.schedule = p.pp_schedule
        self.runner = build_pipeline(model, topo.mesh["pp"], schedule=p.pp_schedule, microbatches=p.microbatches,
                                     virtual_stages_per_rank=p.pp_virtual_stages or None, loss_fn=self.loss_fn,
                                     costs=costs, scale_grads=False, split=split or None, stage_fn=stage_fn,
                                     prepare_stage=self.stage_preparation(model), device=topo.device,
                                     embedding_unit=p.pp_split_embedding, head_unit=p.pp_split_head)
        self.model = PipelineModel(self.runner)
        self.named = self.runner.named_parameters()
        self.tied_copies = set(self.runner.copy_names)
        materialise(self.model, topo.device)  # a meta model: this rank's stages only (the reducer needs storage)
        self.init_data_parallel()

    # -- the data-parallel composition (plait.parallel.pipeline.sharded overrides these) ---------------------
    def stage_preparation(self, model: nn.Module) -> Callable[[nn.Module], nn.Module] | None:
        """What each of this rank's stage modules goes through before it becomes a ``PipelineStage``, given
        the whole (tensor-parallel) model before the split; None: nothing."""
        return None

    def init_data_parallel(self) -> None:
        """The data-parallel engine over this rank's stages: plait's reducer (all-reduce after the step)."""
        self._init_reducer(self.model.stages)

    def stage_no_sync(self) -> contextlib.AbstractContextManager:
        """The context one schedule step runs in. Every pipeline micro-batch runs its own backward, so the
        reducer's end-of-backward callback would fire after the first one: gradients are reduced in
        ``finish()`` instead, after the whole step (no overlap of the data-parallel reduction with the
        pipeline's backward)."""
        return self.engine.no_sync()

    @property
    def loss_parts(self) -> int:
        """The pipeline micro-batches a micro-step's loss is averaged over (each gradient is scaled by 1 / that):
        a wrapper whose loss is already one over the micro-step's items (context parallelism) scales it back."""
        return self.runner.microbatches

    def wrap_forward(self, device: torch.device, plan: Any = None) -> None:
        """Nothing: the stages run inside the schedule (under autocast there where ``uses_autocast``), never through
        ``model(...)``."""

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
        with autocast(self.precision, self.topo.device, self.uses_autocast()):
            value = self._schedule_step(batch, scale, loss)
        if times is not None:
            times["backward_s"] += time.perf_counter() - t0
        return value

    def evaluate(self, model: nn.Module, batch: Any, loss: Any) -> torch.Tensor:
        with autocast(self.precision, self.topo.device, self.uses_autocast()):
            return self._evaluate(batch, loss)

    def _split(self, batch: Any, loss: Any = None) -> tuple[tuple, Any]:
        """The stages' positional inputs and the target, split by the loss given to setup, or by ``loss`` where it
        takes a batch a wrapper has split already (``presplit``: context parallelism's shard)."""
        args, kwargs, target = (loss if getattr(loss, "presplit", False) else self.loss).split(batch)
        if kwargs:
            raise ValueError(f"pipeline stages take positional inputs only; the batch gives keyword inputs "
                             f"{sorted(kwargs)}: pass (inputs, target) batches, or a loss whose split gives them")
        return args, target

    def _schedule_step(self, batch: Any, factor: float, loss: Any = None) -> torch.Tensor:
        """One schedule step over the micro-batch; returns the unscaled mean loss (0 on ranks without the
        last stage)."""
        args, target = self._split(batch, loss)
        # The schedule does not average over pipeline micro-batches (scale_grads=False): the loss does.
        self.loss_fn.factor = factor / self.runner.microbatches
        with self.stage_no_sync():
            loss = self.runner.step(args, target, sync_tied=False)  # tied copies: once per optimizer step
        return loss / self.loss_fn.factor if loss is not None else torch.zeros(())

    @torch.no_grad()
    def _evaluate(self, batch: Any, loss: Any = None) -> torch.Tensor:
        """Mean loss of the micro-batch on the last stage's rank (0 elsewhere)."""
        args, target = self._split(batch, loss)
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
            with torch.enable_grad(), self.stage_no_sync():
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

    def retie(self) -> None:
        """The tied copies take the first stage's weight (``PipelineRunner.sync_tied_weights``)."""
        self.runner.sync_tied_weights()

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
        """Sum over the pp group (any shape): brings the last stage's losses to every pipeline rank."""
        t = t.detach().double().clone()
        dist.all_reduce(t, group=self.topo.group("pp"))
        return t

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
