"""Pipeline parallelism for the plait GPT on ``torch.distributed.pipelining`` schedules.

plait's own part is the stage split. Blocks are balanced by per-layer cost measured in a short
profiling step (``measure_layer_costs``: forward + backward of the embedding, of each block and of
norm + head + loss on a sample micro-batch), not by count: ``partition_layers`` finds the contiguous
split that minimises the most expensive stage. The embedding goes on the first stage, the final norm,
head and loss on the last. A stage module keeps only the modules it owns, under the attribute names of
the full model (``blocks`` becomes a ModuleDict keyed by the original block index), so every stage's
state-dict keys are the full model's FQNs and a DCP checkpoint taken at one pp degree loads at another.

Tied embedding and head: the head on the last stage needs the embedding table that lives on the first.
As in Megatron, the pipeline unties them: the last stage gets its own copy of the table, and after
every backward the two gradients are summed (``sync_tied_grads``: an all-reduce over the pp group, the
middle ranks adding zeros, or a local sum when one rank holds both ends as in the V schedules). Both
copies start equal and receive the same summed gradient and the same optimizer update, so they stay
equal and training equals the single-process tied model. Both keys are in the checkpoint, as they are
in ``GPT.state_dict()``.

Schedules: ``gpipe`` (ScheduleGPipe), ``1f1b`` (Schedule1F1B), ``interleaved``
(ScheduleInterleaved1F1B, v >= 2 stages per rank placed round-robin) and ``zbv``
(ScheduleZBVZeroBubble, exactly 2 stages per rank in a V: rank r holds stages r and 2p-1-r).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from plait.config import ConfigError
from plait.models.gpt import GPT
from plait.parallel.pipeline_trace import PipeEvent, StepSpan, bubble_summary, instrument_stage
from plait.parallel.tensor import local_grads, local_value, loss_context, uses_loss_parallel

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
             "zbv": ScheduleZBVZeroBubble}
NATURAL_VIRTUAL = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zbv": 2}


class PipelineConfigError(ConfigError):
    """The pipeline layout asked for cannot be built; the message says what to change."""


def partition_layers(costs: list[float], num_stages: int, *, first_cost: float = 0.0,
                     last_cost: float = 0.0) -> list[range]:
    """Split layers ``0..len(costs)-1`` into ``num_stages`` contiguous non-empty ranges.

    Minimises the largest stage cost, where a stage costs the sum of its layers' costs, plus
    ``first_cost`` (embedding) on stage 0 and ``last_cost`` (norm, head, loss) on the last stage.
    Exact dynamic programme, O(num_stages * n^2). Ties go to the split with earlier boundaries.
    """
    n = len(costs)
    if num_stages < 1:
        raise PipelineConfigError(f"the pipeline needs at least one stage; got {num_stages}")
    if num_stages > n:
        raise PipelineConfigError(
            f"{num_stages} pipeline stages but the model has only {n} layers: every stage needs at least "
            f"one block; lower parallel.pp (or the virtual stages per rank) or raise model.n_layer"
        )
    if any(c < 0 for c in costs):
        raise PipelineConfigError(f"layer costs must be non-negative; got {costs}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, i: int, j: int) -> float:  # stage s owns layers i..j-1
        extra = (first_cost if s == 0 else 0.0) + (last_cost if s == num_stages - 1 else 0.0)
        return prefix[j] - prefix[i] + extra

    inf = float("inf")
    # best[s][j]: the smallest max-cost of stages 0..s covering layers 0..j-1; cut[s][j]: start of stage s.
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    cut = [[0] * (n + 1) for _ in range(num_stages)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, 0, j)
    for s in range(1, num_stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                value = max(best[s - 1][i], cost(s, i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    bounds, j = [], n
    for s in range(num_stages - 1, 0, -1):
        i = cut[s][j]
        bounds.append(range(i, j))
        j = i
    bounds.append(range(0, j))
    return bounds[::-1]


@dataclass
class LayerCosts:
    """Measured seconds of forward + backward: embedding, each block, and norm + head + loss."""

    embed: float
    blocks: list[float]
    head: float


def _time_fwd_bwd(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    """Median seconds of ``fn()`` forward plus its backward (after one warm-up call)."""
    times = []
    for r in range(repeats + 1):
        start = time.perf_counter()
        out = fn()
        if out.dim():
            out.backward(torch.ones_like(out))
        else:
            out.backward()
        if r:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure_layer_costs(model: GPT, idx: torch.Tensor, targets: torch.Tensor, *, repeats: int = 3,
                        group: dist.ProcessGroup | None = None) -> LayerCosts:
    """Profile one micro-batch ``(B, T)`` through each part of ``model``; leaves no gradients behind.

    With a process group initialised the costs are averaged over ``group`` (default: the world), so
    every rank gets the same numbers and therefore the same partition. Works on a tensor-parallel
    model too (every tp rank runs the same collectives in the same order).
    """
    B, T = idx.shape  # (B, T)
    pos = torch.arange(T, device=idx.device)
    with loss_context(model):
        embed = lambda: model.drop(model.tok_emb(idx) + model.pos_emb(pos))  # (B, T, C)
        x = embed().detach()
        costs = [_time_fwd_bwd(embed, repeats)]
        for block in model.blocks:
            x_in = x.detach().requires_grad_()
            costs.append(_time_fwd_bwd(lambda b=block, xi=x_in: b(xi), repeats))
            x = block(x_in).detach()
        x_in = x.detach().requires_grad_()
        costs.append(_time_fwd_bwd(lambda: gpt_loss(model.head(model.ln_f(x_in)), targets), repeats))
    model.zero_grad(set_to_none=True)
    if dist.is_available() and dist.is_initialized():
        t = torch.tensor(costs, dtype=torch.float64)
        dist.all_reduce(t, group=group)
        costs = (t / dist.get_world_size(group)).tolist()
    return LayerCosts(embed=costs[0], blocks=costs[1:-1], head=costs[-1])


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``(B, T, V)`` logits, as ``GPT.forward`` computes it (float32)."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


class GPTStage(nn.Module):
    """The part of a GPT one pipeline stage owns, under the full model's attribute names (FQNs)."""

    def __init__(self, model: GPT, layers: range, *, is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.is_first, self.is_last, self.seq_len = is_first, is_last, model.cfg.seq_len
        if is_first:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if is_last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:  # x: token ids (B, T)
            T = x.size(1)
            if T > self.seq_len:
                raise ValueError(f"sequence of {T} tokens exceeds model.seq_len={self.seq_len}")
            pos = torch.arange(T, device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))  # (B, T, C)
        for block in self.blocks.values():
            x = block(x)  # (B, T, C)
        if self.is_last:
            x = self.head(self.ln_f(x))  # (B, T, V)
        return x


def stage_ranks(num_ranks: int, num_stages: int, style: str) -> list[int]:
    """Pipeline rank of each stage: round-robin ("loop") or V-shaped ("v", 2 stages per rank)."""
    if style == "v":
        return [s if s < num_ranks else 2 * num_ranks - 1 - s for s in range(num_stages)]
    return [s % num_ranks for s in range(num_stages)]


def check_pipeline_layout(schedule: str, num_ranks: int, microbatches: int, virtual: int) -> None:
    """Readable errors for layouts the schedules cannot run."""
    if schedule not in SCHEDULES:
        raise PipelineConfigError(
            f"unknown pipeline schedule {schedule!r}; "
            f"parallel.pp_schedule must be one of {sorted(SCHEDULES)}")
    if microbatches < 1:
        raise PipelineConfigError(f"parallel.microbatches must be at least 1; got {microbatches}")
    if schedule in ("gpipe", "1f1b") and virtual != 1:
        raise PipelineConfigError(f"schedule {schedule!r} runs one stage per rank; got {virtual}")
    if schedule == "interleaved" and virtual < 2:
        raise PipelineConfigError("schedule 'interleaved' needs at least 2 virtual stages per rank")
    if schedule == "zbv" and virtual != 2:
        raise PipelineConfigError(f"schedule 'zbv' runs exactly 2 stages per rank in a V; got {virtual}")
    if schedule in ("interleaved", "zbv") and microbatches < num_ranks:
        raise PipelineConfigError(
            f"schedule {schedule!r} needs at least as many micro-batches as pipeline stages "
            f"(pp={num_ranks}); got parallel.microbatches={microbatches}; "
            f"raise microbatches to {num_ranks} or more")
    if schedule == "interleaved":
        rounds = max(1, microbatches // num_ranks)
        if microbatches % rounds:
            raise PipelineConfigError(
                f"interleaved 1F1B needs micro-batches to be a multiple of pp={num_ranks} (or divisible by "
                f"microbatches // pp = {rounds}); got {microbatches}")


@dataclass
class PipelineRunner:
    """One rank's pipeline: its stage modules, the schedule, tied-weight sync and the step timeline.

    ``modules`` are this rank's stage modules in stage order; build the optimizer over their
    parameters. ``step(idx, targets)`` runs one forward + backward over all micro-batches.
    """

    modules: list[GPTStage]
    stages: list[PipelineStage]
    schedule: object
    group: dist.ProcessGroup
    microbatches: int
    virtual_stages: int
    loss_parallel: bool
    tied_shape: torch.Size | None
    tie_is_local: bool
    tie_group: dist.ProcessGroup | None
    events: list[PipeEvent] = field(default_factory=list)
    span: StepSpan | None = None

    @property
    def has_first(self) -> bool:
        return any(m.is_first for m in self.modules)

    @property
    def has_last(self) -> bool:
        return any(m.is_last for m in self.modules)

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (each once), for the optimizer and the data-parallel reducer."""
        seen, out = set(), []
        for m in self.modules:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def step(self, idx: torch.Tensor, targets: torch.Tensor, sync_tied: bool = True) -> torch.Tensor | None:
        """Forward + backward of the batch ``(B, T)`` split in ``microbatches``; syncs tied grads.

        Every pipeline rank passes the same batch (only the first stage reads ``idx``, only the last
        reads ``targets``). Returns the mean loss (like the single-process model's) as a plain
        detached tensor on the rank holding the last stage, None elsewhere. Gradients accumulate into
        ``.grad`` of the stage parameters, already averaged over micro-batches.
        """
        if idx.size(0) % self.microbatches:
            raise PipelineConfigError(
                f"batch of {idx.size(0)} sequences does not split into {self.microbatches} equal "
                f"micro-batches; make the per-rank batch a multiple of parallel.microbatches")
        self.events.clear()
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        rank = dist.get_rank(self.group)
        start = time.time_ns()
        with loss_context(self.loss_parallel):
            if self.has_first:
                self.schedule.step(idx, target=targets if self.has_last else None, losses=losses)
            else:
                self.schedule.step(target=targets if self.has_last else None, losses=losses)
        self.span = StepSpan(rank, start, time.time_ns())
        if sync_tied:  # with gradient accumulation, sync once after the last micro-step instead
            self.sync_tied_grads()
        if losses is None:
            return None
        return torch.stack([local_value(loss.detach()) for loss in losses]).mean()

    def sync_tied_grads(self) -> None:
        """Sum the gradients of the embedding (first stage) and its head copy (last stage).

        Communication: one all-reduce of the ``(V/tp, C)`` table gradient over the pp ranks (middle
        ranks contribute zeros; the backward has already run, so there is no backward counterpart).
        It runs on its own process group over the same ranks: the schedule may leave point-to-point
        sends in flight on the pp group, and gloo would match their messages against the all-reduce's.
        A local sum when this rank holds both ends; nothing when the pipeline is one stage (still tied).
        """
        if self.tied_shape is None or (self.tie_is_local and not self.has_first):
            return
        emb = next((m.tok_emb.weight for m in self.modules if m.is_first), None)
        head = next((m.head.weight for m in self.modules if m.is_last), None)
        grads = [_local_grad(p) for p in (emb, head) if p is not None]
        total = grads[0].clone() if grads else torch.zeros(self.tied_shape)
        for g in grads[1:]:
            total += g
        if not self.tie_is_local:
            dist.all_reduce(total, group=self.tie_group)
        for g in grads:
            g.copy_(total)

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


def _local_grad(p: nn.Parameter) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return local_grads([p])[0]


def _as_group(pp: DeviceMesh | dist.ProcessGroup) -> dist.ProcessGroup:
    return pp.get_group() if isinstance(pp, DeviceMesh) else pp


def build_pipeline(model: GPT, pp: DeviceMesh | dist.ProcessGroup, *, schedule: str, microbatches: int,
                   virtual_stages_per_rank: int | None = None,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = gpt_loss,
                   costs: LayerCosts | None = None, scale_grads: bool = True) -> PipelineRunner:
    """Split ``model`` (tensor-parallel already, or not) into this rank's pipeline stages.

    Consumes ``model``: its modules move into the stage modules (the unowned ones are dropped), so do
    not use ``model`` afterwards. ``costs`` (from ``measure_layer_costs``) balance the split; without
    them every block counts the same. With ``scale_grads=False`` the gradients are those of the sum of
    the micro-batch losses (for callers that accumulate over several steps and scale the loss
    themselves). ``virtual_stages_per_rank`` defaults to the schedule's natural
    value (1 for gpipe/1f1b, 2 for interleaved/zbv). Every rank must pass the same arguments.
    Raises ``PipelineConfigError`` for an unknown schedule, more stages than layers, or too few
    micro-batches for the interleaved and zbv schedules.
    """
    group = _as_group(pp)
    num_ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    virtual = virtual_stages_per_rank or NATURAL_VIRTUAL.get(schedule, 1)
    check_pipeline_layout(schedule, num_ranks, microbatches, virtual)
    num_stages = num_ranks * virtual
    n = len(model.blocks)
    if costs is None:
        costs = LayerCosts(embed=0.0, blocks=[1.0] * n, head=0.0)
    ranges = partition_layers(costs.blocks, num_stages, first_cost=costs.embed, last_cost=costs.head)
    owner = stage_ranks(num_ranks, num_stages, "v" if schedule == "zbv" else "loop")
    tied_shape, tie_group = None, None
    tie_is_local = owner[0] == owner[-1]
    if num_stages > 1 and not tie_is_local:
        tie_group = dist.new_group(dist.get_process_group_ranks(group), use_local_synchronization=True)
    if num_stages > 1:
        w = model.tok_emb.weight
        tied_shape = (w.to_local() if isinstance(w, DTensor) else w).shape
        model.head.weight = nn.Parameter(w.detach().clone())  # untied copy for the last stage
    device = model.tok_emb.weight.device
    modules, stages, events = [], [], []
    for s in [s for s in range(num_stages) if owner[s] == rank]:
        module = GPTStage(model, ranges[s], is_first=s == 0, is_last=s == num_stages - 1)
        stage = PipelineStage(module, s, num_stages, device, group=group)
        instrument_stage(stage, rank, events)
        modules.append(module)
        stages.append(stage)
    loss_parallel = uses_loss_parallel(model)
    model.blocks = nn.ModuleList()  # drop the full model's hold on blocks this rank does not own
    cls = SCHEDULES[schedule]
    # scale_grads=False: the loss function divides by the micro-batch count itself. The schedule's own
    # scaling divides every accumulated gradient of the stage, including earlier accumulation steps'.
    sched = cls(stages[0], microbatches, loss_fn=loss_fn, scale_grads=scale_grads) \
        if virtual == 1 and schedule in ("gpipe", "1f1b") \
        else cls(stages, microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    return PipelineRunner(modules=modules, stages=stages, schedule=sched, group=group,
                          microbatches=microbatches, virtual_stages=virtual, loss_parallel=loss_parallel,
                          tied_shape=tied_shape, tie_is_local=tie_is_local, tie_group=tie_group,
                          events=events)
