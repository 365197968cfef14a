"""Pipeline parallelism on ``torch.distributed.pipelining`` schedules, for any model an adapter can split.

plait's own part is the stage split (``plait.parallel.pipeline.split``): by named split points, or
balanced by per-layer cost measured in a short profiling step (``partition_layers`` finds the
contiguous split that minimises the most expensive stage). A stage module keeps only the modules it
owns, under the attribute names of the full model, so every stage's state-dict keys are the full
model's FQNs and a DCP checkpoint taken at one pp degree loads at another.

Tied weights (a GPT's embedding and head, a Hugging Face model with ``tie_word_embeddings``): the head
on the last stage needs the table that lives on the first. As in Megatron, the pipeline unties them:
later stages get their own copy, and after every backward the copies' gradients are summed
(``sync_tied_grads``: an all-reduce over the pp group, ranks without a copy adding zeros, or a local
sum when one rank holds every copy as in the V schedules). All copies start equal and receive the same
summed gradient and the same optimizer update, so they stay equal and training equals the
single-process tied model. Every copy's key is in the checkpoint, as in the full model's
``state_dict()``.

Schedules: ``gpipe`` (ScheduleGPipe), ``1f1b`` (Schedule1F1B), ``interleaved``
(ScheduleInterleaved1F1B, v >= 2 stages per rank placed round-robin) and ``zbv``
(ScheduleZBVZeroBubble, exactly 2 stages per rank in a V: rank r holds stages r and 2p-1-r; its split backward takes
FSDP2's gathered parameters where a stage is sharded, ``_Stage``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from plait.parallel.pipeline.split import (
    FunctionPipeline,
    LayerCosts,
    PipelineAdapter,
    Tie,
    check_tied_copies,
    measure_layer_costs,
    pipeline_adapter,
    stage_layer_ranges,
    untie_across_stages,
)
from plait.parallel.pipeline.trace import PipeEvent, StepSpan, bubble_summary, instrument_stage
from plait.parallel.tensor.plan import local_grads, local_value, loss_context, uses_loss_parallel
from plait.plan.schedule import (
    NATURAL_VIRTUAL,
    SCHEDULE_NAMES,
    PipelineConfigError,
    check_pipeline_layout,
    partition_layers,
    stage_ranks,
)

__all__ = ["LayerCosts", "PipelineConfigError", "PipelineRunner", "build_pipeline", "check_pipeline_layout",
           "measure_layer_costs", "partition_layers"]

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
             "zbv": ScheduleZBVZeroBubble}
assert tuple(SCHEDULES) == SCHEDULE_NAMES


@dataclass
class PipelineRunner:
    """One rank's pipeline: its stage modules, the schedule, tied-weight sync and the step timeline.

    ``modules`` are this rank's stage modules in stage order; build the optimizer over
    ``named_parameters()``. ``step(inputs, targets)`` runs one forward + backward over all micro-batches.
    """

    modules: list[nn.Module]
    stages: list[PipelineStage]
    stage_ids: list[int]
    num_stages: int
    schedule: object
    group: dist.ProcessGroup
    microbatches: int
    virtual_stages: int
    loss_parallel: bool
    ties: list[Tie]
    tie_group: dist.ProcessGroup | None
    copy_names: dict[int, str]
    events: list[PipeEvent] = field(default_factory=list)
    span: StepSpan | None = None

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters, each once, under their single-process names (a tied copy under the name
        of the parameter it copies): for the optimizer's groups and the checkpoint's optimizer states."""
        seen, out = set(), []
        for m in self.modules:
            for name, p in m.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((self.copy_names.get(id(p), name.replace("_checkpoint_wrapped_module.", "")), p))
        return out

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (each once), for the optimizer and the data-parallel reducer."""
        return [p for _, p in self.named_parameters()]

    def step(self, inputs: torch.Tensor | tuple, targets: object, sync_tied: bool = True) -> torch.Tensor | None:
        """Forward + backward of the batch split in ``microbatches``; syncs tied grads.

        Every pipeline rank passes the same batch (only the first stage reads ``inputs``, a tensor or a
        tuple of positional arguments; only the last reads ``targets``). Returns the mean loss (like the
        single-process model's) as a plain detached tensor on the rank holding the last stage, None
        elsewhere. Gradients accumulate into ``.grad`` of the stage parameters.
        """
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        lead = args[0] if args else targets
        if isinstance(lead, torch.Tensor) and lead.size(0) % self.microbatches:
            raise PipelineConfigError(
                f"batch of {lead.size(0)} samples does not split into {self.microbatches} equal "
                f"micro-batches; make the per-rank batch a multiple of parallel.microbatches")
        self.events.clear()
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        rank = dist.get_rank(self.group)
        start = time.time_ns()
        with loss_context(self.loss_parallel):
            target = targets if self.has_last else None
            # return_outputs=False: torch's schedules otherwise keep the last stage's output of every micro-batch
            # (the logits, B x T x V) until the step ends, to merge them; only the losses are used here
            if self.has_first:
                self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
            else:
                self.schedule.step(target=target, losses=losses, return_outputs=False)
        self.span = StepSpan(rank, start, time.time_ns())
        if sync_tied:  # with gradient accumulation, sync once after the last micro-step instead
            self.sync_tied_grads()
        if losses is None:
            return None
        return torch.stack([local_value(loss.detach()) for loss in losses]).mean()

    def sync_tied_grads(self, grad_of: Callable[[nn.Parameter], torch.Tensor] | None = None) -> None:
        """Sum the gradients of every copy of each tied parameter (see the module docstring). ``grad_of(p)``
        is where ``p``'s local gradient lives (default: ``p.grad``'s local shard; ZeRO-1/2 keeps it in its
        bucket buffer).

        Communication: per tie held by more than one rank, one all-reduce of the ``(local shard)``
        gradient over the pp ranks (ranks without a copy contribute zeros; the backward has already run,
        so there is no backward counterpart). It runs on its own process group over the same ranks: the
        schedule may leave point-to-point sends in flight on the pp group, and gloo would match their
        messages against the all-reduce's. A local sum when this rank holds every copy.
        """
        for tie in self.ties:
            local = len({self._owner[s] for s in tie.stages}) == 1
            if local and not tie.params:
                continue
            grads = [(grad_of or _local_grad)(p) for p in tie.params]
            total = grads[0].clone() if grads else torch.zeros(tie.shape)
            for g in grads[1:]:
                total += g
            if not local:
                dist.all_reduce(total, group=self.tie_group)
            for g in grads:
                g.copy_(total)

    @torch.no_grad()
    def sync_tied_weights(self) -> None:
        """Every copy of each tied parameter takes the first stage's value (the original's): after weights were
        written into the stages from outside, each rank on its own (a heal from a live peer's same rank), so that
        the copies start equal again. Communication: per tie held by more than one rank, one broadcast of the
        (local shard of the) weight over the pp ranks from the first stage's rank (ranks without a copy receive
        into a scratch tensor). Nothing when one rank holds every copy: they were written from one source."""
        for tie in self.ties:
            first = self._owner[min(tie.stages)]
            if len({self._owner[s] for s in tie.stages}) == 1:
                continue
            copies = [p.to_local() if isinstance(p, DTensor) else p for p in tie.params]
            value = copies[0].detach().clone() if copies else torch.zeros(tie.shape)
            dist.broadcast(value, group=self.tie_group, group_src=first)
            for c in copies:
                c.copy_(value)

    @property
    def _owner(self) -> list[int]:
        return self.__dict__["owner"]

    def local_summary(self) -> dict:
        """This rank's measured idle fraction of the last step, next to the theoretical one."""
        if self.span is None:
            raise RuntimeError("no pipeline step has run yet")
        p = dist.get_world_size(self.group)
        return bubble_summary(self.events, [self.span], self.microbatches, self.virtual_stages, p)["ranks"][0]

    def gather_timeline(self) -> tuple[list[PipeEvent], list[StepSpan]] | None:
        """Collective over the pp group: every rank's events and spans of the last step, on pp rank 0."""
        payload = (list(self.events), self.span)
        out: list = [None] * dist.get_world_size(self.group) if dist.get_rank(self.group) == 0 else None
        dist.gather_object(payload, out, dst=dist.get_global_rank(self.group, 0), group=self.group)
        if out is None:
            return None
        return [e for ev, _ in out for e in ev], [s for _, s in out]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's entries keyed by the full model's FQNs (for DCP save/load at any pp degree)."""
        sd: dict[str, torch.Tensor] = {}
        for m in self.modules:
            sd.update(m.state_dict())
        return sd

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load the entries this rank owns (a superset, e.g. a full model's state dict, is fine)."""
        for m in self.modules:
            own = m.state_dict()
            missing = [k for k in own if k not in state_dict]
            if missing:
                raise KeyError(f"checkpoint lacks {missing[:5]} needed by this pipeline stage")
            m.load_state_dict({k: state_dict[k] for k in own})


class _Stage(PipelineStage):
    """torch's ``PipelineStage``, whose split backward (the zero-bubble V schedule's input pass, then its weight pass)
    computes the gradients of the parameters the forward used. torch 2.13 takes them from ``submod.parameters()``,
    which under FSDP2 are the shards a unit registers between its forward and backward, not the gathered parameters
    the autograd graph holds: no weight gradient would be computed, and FSDP2's reduce-scatter would find none. During
    those passes the stage module lists its gathered parameters instead (``_gathered``); the rest is torch's."""

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        if backward_type == "full" or not isinstance(self.submod, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        weights = _gathered(self.submod)
        self.submod.parameters = lambda recurse=True: iter(weights)  # read by torch's input and weight passes
        try:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        finally:
            del self.submod.parameters


def _gathered(module: nn.Module) -> list[nn.Parameter]:
    """``module``'s parameters, each FSDP2 shard replaced by the gathered parameter its unit computes with."""
    gathered: dict[int, nn.Parameter] = {}
    for m in module.modules():
        if isinstance(m, FSDPModule):
            for group in fully_shard.state(m)._fsdp_param_groups:
                gathered.update({id(fp.sharded_param): fp.unsharded_param for fp in group.fsdp_params})
    return [gathered.get(id(p), p) for p in module.parameters()]


def _local_grad(p: nn.Parameter) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return local_grads([p])[0]


def _as_group(pp: DeviceMesh | dist.ProcessGroup) -> dist.ProcessGroup:
    return pp.get_group() if isinstance(pp, DeviceMesh) else pp


def _make_schedule(schedule: str, stages: list[PipelineStage], virtual: int, microbatches: int,
                   loss_fn: Callable[[object, object], torch.Tensor] | None, scale_grads: bool) -> object:
    """torch's schedule object over this rank's stages (default loss: next-token cross-entropy)."""
    from plait.components.losses import CausalLMLoss

    cls = SCHEDULES[schedule]
    loss_fn = loss_fn or CausalLMLoss().loss
    # scale_grads=False: the loss function divides by the micro-batch count itself. The schedule's own
    # scaling divides every accumulated gradient of the stage, including earlier accumulation steps'.
    if virtual == 1 and schedule in ("gpipe", "1f1b"):
        return cls(stages[0], microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    return cls(stages, microbatches, loss_fn=loss_fn, scale_grads=scale_grads)


def build_pipeline(model: nn.Module, pp: DeviceMesh | dist.ProcessGroup, *, schedule: str, microbatches: int,
                   virtual_stages_per_rank: int | None = None, loss_fn: Callable[[object, object], torch.Tensor] | None
                   = None, costs: LayerCosts | None = None, scale_grads: bool = True,
                   adapter: PipelineAdapter | None = None, split: list[str] | None = None,
                   stage_fn: Callable[[nn.Module, int, int], nn.Module] | None = None,
                   prepare_stage: Callable[[nn.Module], nn.Module] | None = None,
                   device: torch.device | None = None, embedding_unit: bool = False,
                   head_unit: bool = False) -> PipelineRunner:
    """Split ``model`` (tensor-parallel already, or not) into this rank's pipeline stages.

    Consumes ``model``: its modules move into the stage modules (the unowned ones are dropped), so do
    not use ``model`` afterwards. The split: ``stage_fn`` (one call per stage this rank owns), else the
    layer names in ``split`` that start stages 2..n, else ``costs`` (from ``measure_layer_costs``) balance
    it, else every layer counts the same. ``loss_fn(output, target)`` runs on the last stage (default:
    next-token cross-entropy). With ``scale_grads=False`` the gradients are those of the sum of the
    micro-batch losses (for callers that accumulate over several steps and scale the loss themselves).
    ``virtual_stages_per_rank`` defaults to the schedule's natural value (1 for gpipe/1f1b, 2 for
    interleaved/zbv). ``prepare_stage(module)`` (FSDP2's sharding) may replace a stage module's parameters before
    it becomes a ``PipelineStage``. ``device``: the stages' device, for a model still on the meta device.
    ``embedding_unit`` / ``head_unit``: the embedding / the head count as a layer of the split, so the first / last
    stage may hold it alone (``plait.plan.schedule.partition_units``). Every rank must pass the same arguments.
    Raises ``PipelineConfigError`` for an unknown schedule, more stages than layers, a bad split, a model no
    adapter can split, or too few micro-batches for the interleaved and zbv schedules."""
    group = _as_group(pp)
    num_ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    virtual = virtual_stages_per_rank or NATURAL_VIRTUAL.get(schedule, 1)
    check_pipeline_layout(schedule, num_ranks, microbatches, virtual)
    num_stages = num_ranks * virtual
    adapter = FunctionPipeline(stage_fn, num_stages) if stage_fn is not None else adapter or pipeline_adapter(model)
    names, ranges = stage_layer_ranges(model, adapter, num_stages, split, costs, embedding_unit=embedding_unit,
                                       head_unit=head_unit)
    owner = stage_ranks(num_ranks, num_stages, "v" if schedule == "zbv" else "loop")
    mine = [s for s in range(num_stages) if owner[s] == rank]
    # the stages' device: the model's, or ``device`` for a model still on the meta device
    device = device or next((p.device for p in model.parameters()), torch.device("cpu"))
    loss_parallel = uses_loss_parallel(model)
    built, ties, copies = _build_stages(model, adapter, names, ranges, num_stages, mine, prepare_stage)
    tie_group = None
    if any(len({owner[s] for s in t.stages}) > 1 for t in ties):
        tie_group = dist.new_group(dist.get_process_group_ranks(group), use_local_synchronization=True)
    modules, stages, events = [], [], []
    for s in mine:
        stage = _Stage(built[s], s, num_stages, device, group=group)
        instrument_stage(stage, rank, events)
        modules.append(built[s])
        stages.append(stage)
    held = {id(p): p for m in modules for p in m.parameters()}
    for tie in ties:
        tie.params = [held[i] for i in sorted(tie.ids) if i in held]
    _drop_unowned(model, modules)
    sched = _make_schedule(schedule, stages, virtual, microbatches, loss_fn, scale_grads)
    runner = PipelineRunner(modules=modules, stages=stages, stage_ids=mine, num_stages=num_stages, schedule=sched,
                            group=group, microbatches=microbatches, virtual_stages=virtual,
                            loss_parallel=loss_parallel, ties=ties, tie_group=tie_group, copy_names=copies,
                            events=events)
    runner.__dict__["owner"] = owner
    return runner


def _build_stages(model: nn.Module, adapter: PipelineAdapter, names: list[str], ranges: list[range],
                  num_stages: int, mine: list[int], prepare: Callable[[nn.Module], nn.Module] | None = None
                  ) -> tuple[dict[int, nn.Module], list, dict]:
    """(this rank's stage modules by stage index, each through ``prepare``, the weights tied across stages, the
    names of later stages' copies of them). Every stage is built on every rank, a user's ``stage_fn`` included,
    so the parameters several stages share are found by identity whoever split the model (a rank's own stages
    alone cannot tell it that its tied head's table lives on another rank)."""
    every = [adapter.build_stage(model, [names[i] for i in ranges[s]], is_first=s == 0, is_last=s == num_stages - 1)
             for s in range(num_stages)]
    check_tied_copies(model, every)
    ties, copies = untie_across_stages(model, every)
    built = {s: every[s] for s in mine}
    if prepare is not None:
        built, copies = _prepare(built, ties, copies, prepare)
    return built, ties, copies


def _prepare(built: dict[int, nn.Module], ties: list[Tie], copies: dict[int, str],
             prepare: Callable[[nn.Module], nn.Module]) -> tuple[dict[int, nn.Module], dict[int, str]]:
    """This rank's stage modules through ``prepare``. FSDP2 replaces parameters with new objects, so the ties'
    ids and the copies' names follow each parameter to its new object (found by its module and attribute)."""
    where: dict[int, tuple[nn.Module, str]] = {}
    for stage in built.values():
        for module in stage.modules():
            for pname, p in module.named_parameters(recurse=False):
                where.setdefault(id(p), (module, pname))
    built = {s: prepare(m) for s, m in built.items()}
    new_id = {old: id(getattr(module, pname)) for old, (module, pname) in where.items()}
    for tie in ties:  # only this rank's parameters are looked up by id later (the runner's tie.params)
        tie.ids = {new_id[i] for i in tie.ids if i in new_id}
    return built, {new_id[i]: name for i, name in copies.items() if i in new_id}


def _drop_unowned(model: nn.Module, modules: list[nn.Module]) -> None:
    """Release the full model's hold on the layers other ranks own, so they are freed with it: containers
    of the full model keep only the children this rank's stage modules use."""
    owned = {id(m) for stage in modules for m in stage.modules()}
    for container in list(model.modules()):
        if id(container) not in owned and isinstance(container, nn.ModuleList | nn.Sequential | nn.ModuleDict):
            container._modules = {k: v for k, v in container._modules.items() if id(v) in owned}
