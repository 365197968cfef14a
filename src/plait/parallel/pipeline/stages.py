"""Pipeline parallelism's stages (``PipelineStages``): the (possibly tensor-parallel, expert-sharded, context-routed)
model split over the ``pp`` axis and driven by a ``torch.distributed.pipelining`` schedule; each accumulation
micro-batch is one schedule step over ``parallel.microbatches`` pipeline micro-batches. The loss exists only on the last
stage's rank; it is summed over the pp group so every rank can log it. The user cannot call the stages as one model:
``Plait.forward_backward`` runs a step.

The gradient-sync policy (``plait.parallel.grad_sync``) is applied to each stage module before it becomes a
``PipelineStage`` (``GradSync.wrap``: FSDP2's units), then to this rank's stages together (``attach``); a schedule step
runs in the policy's ``schedule_context`` and in those of the syncs ``beside`` it (the experts' under a sharding policy;
every pipeline micro-batch runs its own backward, so a sync that reduces at the end of backward reduces in ``finish``
instead). The tied copies of a parameter on several stages (a GPT's embedding
and head) have their gradients summed over pp once per optimizer step, before the reduction where the policy keeps
every micro-batch's gradient in its own buffers (``ties_first``: ZeRO-1/2), after it otherwise.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from plait.components.precision import autocast
from plait.config import ConfigError
from plait.observe.log import get_logger
from plait.parallel.errors import PlaitError
from plait.parallel.meta_init import is_meta, materialise
from plait.parallel.pipeline.runner import build_pipeline, measure_layer_costs
from plait.parallel.pipeline.trace import bubble_summary, write_chrome_trace
from plait.parallel.stages import own_entries
from plait.parallel.tensor.plan import local_value, loss_context
from plait.parallel.units import find_blocks
from plait.plan.schedule import NATURAL_VIRTUAL, check_pipeline_layout


@dataclass
class ScaledLoss:
    """The pipeline's loss function: the user's ``loss(output, target)`` times ``factor`` (1 / (accumulation
    x pipeline micro-batches) x loss scale), set before each schedule step. With ``record`` set, the unscaled
    losses are also appended to it."""

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

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Each stage takes the entries it holds (keys of the whole model), through its own load hooks; a key is
        unexpected when no stage takes it."""
        found = [m.load_state_dict(state_dict, strict=False, assign=assign) for m in self._runner[0].modules]
        missing = [k for r in found for k in r.missing_keys]
        unexpected = [k for k in state_dict if all(k in r.unexpected_keys for r in found)]
        if strict and (missing or unexpected):
            raise RuntimeError(f"this pipeline stage's load_state_dict: missing {missing[:5]}, unexpected "
                               f"{unexpected[:5]}")
        return _IncompatibleKeys(missing, unexpected)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("under pipeline parallelism (parallel.pp > 1) the model is split over ranks and "
                           "forward and backward interleave over micro-batches: call "
                           "loss = p.forward_backward(model, batch) instead of model(...) and p.backward(loss)")


def check_pipeline(cfg: Any, degrees: dict[str, int]) -> None:
    """The pipeline's own settings: the schedule's layout and the micro-batch split."""
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


class PipelineStages:
    """This rank's pipeline stages (see the module docstring)."""

    model_whole = False
    is_pipeline = True
    reduce_loss_every_step = True  # StepInfo.loss: the last stage's, on every stage, at every step

    def __init__(self, model: nn.Module, topo: Any, cfg: Any, spec: Any, sync: Any) -> None:
        p = cfg.parallel
        self.topo, self.cfg, self.sync = topo, cfg, sync
        self.precision, self.device = cfg.train.compute_precision, topo.device
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
        self.beside: list[Any] = []  # syncs beside the policy (the experts'), whose schedule contexts a step enters too
        self.loss_fn = ScaledLoss(loss.loss)
        self.loss = loss
        self.schedule = p.pp_schedule
        blocks = {id(m) for _, m in find_blocks(model)}  # found on the whole model: a stage holds some

        def prepare(stage: nn.Module) -> nn.Module:
            return sync.wrap(stage, [m for m in stage.modules() if id(m) in blocks])

        self.runner = build_pipeline(model, topo.mesh["pp"], schedule=p.pp_schedule, microbatches=p.microbatches,
                                     virtual_stages_per_rank=p.pp_virtual_stages or None, loss_fn=self.loss_fn,
                                     costs=costs, scale_grads=False, split=split or None, stage_fn=stage_fn,
                                     prepare_stage=prepare if sync.wraps_modules else None, device=topo.device,
                                     embedding_unit=p.pp_split_embedding, head_unit=p.pp_split_head)
        self.model = PipelineModel(self.runner)
        self.tied_copies = frozenset(self.runner.copy_names)
        materialise(self.model, topo.device)  # a meta model: this rank's stages only (the reducer needs storage)
        local_shape = getattr(sync, "local_shape", None)
        if local_shape is not None:  # a rank adding zeros for a copy it lacks needs the shard's shape
            for tie in self.runner.ties:
                if not tie.params:
                    tie.shape = local_shape(tie.shape)

    @property
    def holder(self) -> nn.Module:
        return self.model.stages

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return self.runner.named_parameters()

    def entries(self) -> dict[str, torch.Tensor]:
        return own_entries(self.runner.state_dict(), self.runner.modules)

    def model_state(self) -> dict[str, Any]:
        return self.runner.state_dict()

    def load_model_state(self, sd: dict[str, Any]) -> None:
        self.runner.load_state_dict(sd)

    @property
    def loss_parts(self) -> int:
        """The pipeline micro-batches a micro-step's loss is averaged over (each gradient is scaled by 1 / that):
        a loss already over the micro-step's items (context parallelism) is scaled back."""
        return self.runner.microbatches

    # -- one micro-step ------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, scale: float) -> None:
        raise PlaitError("with parallel.pp > 1 forward and backward interleave over pipeline micro-batches: "
                         "use loss = p.forward_backward(model, batch) instead of model(...) and p.backward")

    def forward_backward(self, model: nn.Module, batch: Any, loss: Any, scale: float,
                         before_backward: Callable[[float], None] | None = None,
                         times: dict[str, float] | None = None) -> torch.Tensor:
        """One schedule step over the micro-batch (the stages' loss is the one given to setup); returns the
        unscaled mean loss (0 on ranks without the last stage). Forward and backward interleave, so the
        whole step counts as backward time."""
        t0 = time.perf_counter()
        if before_backward is not None:  # each pipeline micro-batch's auxiliary losses, scaled like its loss
            before_backward(scale / self.runner.microbatches)
        with autocast(self.precision, self.device, self.uses_autocast()):
            value = self._schedule_step(batch, scale, loss)
        if times is not None:
            times["backward_s"] += time.perf_counter() - t0
        return value

    def uses_autocast(self) -> bool:
        return self.precision != "fp32" and not (self.precision == "bf16" and self.sync.casts_bf16)

    def evaluate(self, model: nn.Module, batch: Any, loss: Any) -> torch.Tensor:
        with autocast(self.precision, self.device, self.uses_autocast()):
            return self._evaluate(batch, loss)

    def _split(self, batch: Any, loss: Any = None) -> tuple[tuple, Any]:
        """The stages' positional inputs and the target, split by this micro-step's loss (the one the engine resolved
        for it, context parallelism's shard loss, or the one given to setup), which the last stage then computes:
        a ``loss_fn`` given to ``forward_backward`` or ``evaluate`` is the one the schedule runs."""
        loss = loss if loss is not None else self.loss
        self.loss_fn.loss = loss.loss
        args, kwargs, target = loss.split(batch)
        if kwargs:
            raise ValueError(f"pipeline stages take positional inputs only; the batch gives keyword inputs "
                             f"{sorted(kwargs)}: pass (inputs, target) batches, or a loss whose split gives them")
        return args, target

    def _schedule_step(self, batch: Any, factor: float, loss: Any = None) -> torch.Tensor:
        args, target = self._split(batch, loss)
        # The schedule does not average over pipeline micro-batches (scale_grads=False): the loss does.
        self.loss_fn.factor = factor / self.runner.microbatches
        with self._schedule_context():
            value = self.runner.step(args, target, sync_tied=False)  # tied copies: once per optimizer step
        return value / self.loss_fn.factor if value is not None else torch.zeros(())

    def _schedule_context(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        for sync in (self.sync, *self.beside):
            stack.enter_context(sync.schedule_context())
        return stack

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
        named = self.named_parameters()
        kept = {id(p): p.grad for _, p in named}
        for _, p in named:
            p.grad = None
        self.loss_fn.factor, self.loss_fn.record = 0.0, []
        try:
            with torch.enable_grad(), self._schedule_context():
                self.runner.step(args, target, sync_tied=False)
            values = self.loss_fn.record
        finally:
            self.loss_fn.factor, self.loss_fn.record = 1.0, None
            for _, p in named:
                p.grad = kept[id(p)]
        return torch.stack(values).mean() if values else torch.zeros(())

    def reduce_loss(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the pp group (any shape): brings the last stage's losses to every pipeline rank."""
        t = t.detach().double().clone()
        dist.all_reduce(t, group=self.topo.group("pp"))
        return t

    # -- the tied copies around the reduction --------------------------------------------------------
    def before_reduction(self, sync: Any) -> None:
        """A policy keeping every micro-batch's gradient in its own buffers sums the tied copies there first."""
        if sync.ties_first:
            sync.gather_local()
            self.runner.sync_tied_grads(sync.local_grad)

    def after_reduction(self, sync: Any) -> None:
        """Otherwise the reduced gradients (or FSDP2's reduced shards) of the tied copies are summed over pp."""
        if not sync.ties_first:
            self.runner.sync_tied_grads()

    def retie(self) -> None:
        """The tied copies take the first stage's weight (``PipelineRunner.sync_tied_weights``)."""
        self.runner.sync_tied_weights()

    def full_state(self) -> dict[str, torch.Tensor]:
        """Full weights gathered to every rank: stage entries all-gathered over pp, tp shards gathered."""
        mine = {k: local_value(v).detach().cpu() for k, v in self.runner.state_dict().items()}
        parts: list = [None] * self.topo.degree("pp")
        dist.all_gather_object(parts, mine, group=self.topo.group("pp"))
        full: dict[str, torch.Tensor] = {}
        for part in parts:
            full.update(part)
        return full

    def report(self, run_dir: Path | None) -> dict[str, Any]:
        """Bubble accounting of the last pipeline step and ``pipeline_trace.json`` (collective over pp). Each
        stage's measured idle fraction (1 - busy / step span) next to the theoretical (p-1)/(v*m+p-1); the trace
        holds every forward/backward of every micro-batch on every stage."""
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
