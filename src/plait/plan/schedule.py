"""Pipeline schedules as plait runs them, and their execution on simulated time.

Orders (each rank's sequence of actions): ``gpipe`` and ``1f1b`` follow the step loops of torch's
``ScheduleGPipe`` and ``Schedule1F1B`` (1F1B: ``min(m, p - s)`` warm-up forwards on stage ``s``, then
one backward and one forward until the forwards are done, then the remaining backwards); ``interleaved``
and ``zbv`` are read from torch's own ``ScheduleInterleaved1F1B`` / ``ScheduleZBVZeroBubble``
``pipeline_order`` (built with stand-in stage objects, no process group), so the simulator runs the
very order the trainer runs. Stage ``s`` lives on rank ``s mod p`` (``zbv``: the V, ranks ``0..p-1``
then back).

Execution (``run_pipeline``): every rank takes its actions in order; an action starts when the rank is
free and its inputs have arrived: ``F(s, i)`` after ``F(s-1, i)`` plus the point-to-point transfer when
the stages sit on different ranks; ``B``/``I(s, i)`` after ``F(s, i)`` and ``B``/``I(s+1, i)`` plus the
transfer; ``W(s, i)`` after ``I(s, i)``. The saved activations of ``(s, i)`` live from the start of its
forward until its backward (``zbv``: its weight gradient) ends; their peak per rank is the schedule's
activation memory. Torch's multi-stage schedules (``interleaved``, ``zbv``) keep every point-to-point send's
work, and with it the tensor sent, until the schedule step ends (``PipelineScheduleMulti``'s runtime waits on
its sends only then; a gloo work holds its tensor until waited, measured; NCCL's not measured here): a stage's
output sent to another rank outlives its backward, and the gradient of its input sent back outlives the action
that computed it, both until the step's last action (``sent``, measured on plait's runs,
``tests/plan/test_pipeline_memory.py``). ``gpipe`` and ``1f1b`` wait on each send before the next.

ZBV's split backward keeps more (measured on plait's runs with a saved-tensor hook per action): torch's
input-gradient pass runs with ``retain_graph`` and the weight-gradient pass frees only what the weight
gradients traverse, so the tensors saved by operators on the input-gradient path alone (the attention
core's q, k, v, output and log-sum-exp; the loss's log-probabilities: ``ZBV_KEPT``) stay alive after
``W``, for every micro-batch of every schedule step, until the optimizer step ends the accumulation. A
Hugging Face decoder's Python RMSNorm keeps its input and statistics on that path too (its weight's gradient
reads only the normalized tensor), and so does rotary's multiplication its cos and sin (``ZBV_KEPT_RMSNORM``;
measured on a Llama at tp=2 with sequence parallelism, ``tests/plan/test_pipeline_memory.py``); a fused
LayerNorm's one backward node serves its weight too, so W frees what it saved. The first stage keeps nothing:
it has no input gradient, so torch runs its whole backward in the weight pass. The last stage also keeps what
its MLP's activation saved (SwiGLU's gate, up and SiLU outputs, GELU's input: ``ZBV_KEPT_LAST``), which the
middle stages free: measured on the Llama and on plait's GPT, the mechanism inside torch's split backward not
traced further.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

from plait.config import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv")
# Saved tensors (``plait.plan.ops`` names) that ZBV's weight-gradient pass leaves alive (module docstring).
ZBV_KEPT = ("attn.q", "attn.k", "attn.v", "attn.ctx", "attn.lse", "head.logprobs")
ZBV_KEPT_RMSNORM = ZBV_KEPT + ("ln1.in", "ln1.stats", "ln2.in", "ln2.stats", "head.norm.in", "head.norm.stats",
                               "embed.rotary")

ZBV_KEPT_LAST = ("mlp.gate", "mlp.up", "mlp.silu", "mlp.fc")


def zbv_kept(norm: str) -> tuple[str, ...]:
    """The saved tensors ZBV's weight pass leaves alive (module docstring) for a model with ``norm``."""
    return ZBV_KEPT_RMSNORM if norm == "rmsnorm" else ZBV_KEPT


@dataclass(frozen=True)
class Action:
    """``kind`` F (forward), B (full backward), I (input gradient) or W (weight gradient) of ``stage`` on
    pipeline micro-batch ``mb``."""

    kind: str
    stage: int
    mb: int


@dataclass(frozen=True)
class Event:
    """An action placed on simulated time on pipeline ``rank``."""

    rank: int
    action: Action
    start: float
    end: float


def stage_owner(p: int, v: int, schedule: str) -> list[int]:
    """Pipeline rank of each of the ``p * v`` stages."""
    n = p * v
    if schedule == "zbv":
        return [s if s < p else 2 * p - 1 - s for s in range(n)]
    return [s % p for s in range(n)]


def _single_stage_order(schedule: str, p: int, m: int, s: int) -> list[Action]:
    if schedule == "gpipe":
        return [Action("F", s, i) for i in range(m)] + [Action("B", s, i) for i in range(m)]
    out, fwd, bwd = [], 0, 0
    for _ in range(min(m, p - s)):
        out.append(Action("F", s, fwd))
        fwd += 1
    while bwd < m:
        out.append(Action("B", s, bwd))
        bwd += 1
        if fwd < m:
            out.append(Action("F", s, fwd))
            fwd += 1
    return out


def _torch_order(schedule: str, p: int, m: int, v: int) -> dict[int, list[Action]]:
    import torch
    from torch.distributed.pipelining import ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

    n = p * v
    owner = stage_owner(p, v, schedule)
    mine = [s for s in range(n) if owner[s] == 0]
    stubs = [SimpleNamespace(num_stages=n, group_size=p, group_rank=0, stage_index=s, is_first=s == 0,
                             is_last=s == n - 1, submod=torch.nn.Identity()) for s in mine]
    cls = ScheduleZBVZeroBubble if schedule == "zbv" else ScheduleInterleaved1F1B
    sched = cls(stubs, m)
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    out: dict[int, list[Action]] = {}
    for rank, actions in sched.pipeline_order.items():
        out[rank] = [Action(kinds[a.computation_type.name], a.stage_index, a.microbatch_index)
                     for a in actions if a is not None and a.computation_type.name in kinds]
    return out


def in_flight(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Micro-batches whose activations the busiest pipeline rank holds at once, in units of one micro-batch's
    activations of all the rank's layers: GPipe ``m``; 1F1B ``min(m, p)``; interleaved 1F1B with ``v`` chunks
    ``min(m, p + (p - 1) / v)`` (Narayanan et al. 2021, section 2.2.2: the first stage's warm-up of
    ``2 (p - 1) + (v - 1) p + 1`` chunks of ``1/v`` of its layers, the ``1 + (p - 1) / (p v)`` factor of
    Korthikanti et al. 2022); the zero-bubble V ``min(m, p)`` (Qi et al. 2024: 1F1B's peak). ZBV's split
    backward keeps ``ZBV_KEPT`` longer in plait (module docstring): the simulation adds it."""
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved":
        return min(float(m), p + (p - 1) / v)
    if schedule in ("1f1b", "zbv"):
        return float(min(m, p))
    raise ValueError(f"unknown pipeline schedule {schedule!r}; one of {SCHEDULES}")


def pipeline_orders(schedule: str, p: int, m: int, v: int = 1) -> dict[int, list[Action]]:
    """Each pipeline rank's actions for one schedule step over ``m`` micro-batches (see the module docstring)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; one of {SCHEDULES}")
    if schedule in ("gpipe", "1f1b"):
        return {r: _single_stage_order(schedule, p, m, r) for r in range(p)}
    return _torch_order(schedule, p, m, v)


def run_pipeline(orders: dict[int, list[Action]], owner: list[int], duration: Callable[[Action], float],
                 transfer: Callable[[int, int, str], float], saved: Callable[[int], float],
                 start: float = 0.0, kept: Callable[[int], float] | None = None,
                 sent: Callable[[Action], float] | None = None,
                 ) -> tuple[list[Event], dict[int, float], dict[int, float]]:
    """Place every action on time (see the module docstring).

    ``duration(action)`` is its compute time on its rank, ``transfer(from_stage, to_stage, "F"|"B")`` the
    point-to-point time between two stages (0 on the same rank), ``saved(stage)`` the activation bytes one
    micro-batch keeps on that stage, ``kept(stage)`` the part of it the releasing action leaves alive (split
    backward, see ``zbv_kept``), ``sent(action)`` the bytes the action leaves alive until the schedule step
    ends (sends in flight: ``send_retention``). Returns the events, each rank's end time and each rank's peak
    of live saved activation bytes. Raises ``RuntimeError`` if the orders deadlock (a schedule bug, not a
    user's).
    """
    n = len(owner)
    done: dict[tuple[str, int, int], float] = {}
    cursor = {r: 0 for r in orders}
    clock = {r: start for r in orders}
    events: list[Event] = []
    remaining = sum(len(a) for a in orders.values())
    has_w = any(a.kind == "W" for acts in orders.values() for a in acts)

    def ready(a: Action) -> float | None:
        deps: list[tuple[tuple[str, int, int], float]] = []
        if a.kind == "F" and a.stage > 0:
            deps.append((("F", a.stage - 1, a.mb), transfer(a.stage - 1, a.stage, "F")))
        elif a.kind in ("B", "I"):
            deps.append((("F", a.stage, a.mb), 0.0))
            if a.stage < n - 1:
                up = ("B", a.stage + 1, a.mb) if ("B", a.stage + 1, a.mb) in done else ("I", a.stage + 1, a.mb)
                deps.append((up, transfer(a.stage + 1, a.stage, "B")))
        elif a.kind == "W":
            deps.append((("I", a.stage, a.mb), 0.0))
        t = start
        for key, delay in deps:
            if key not in done:
                return None
            t = max(t, done[key] + delay)
        return t

    while remaining:
        progressed = False
        for r, acts in orders.items():
            while cursor[r] < len(acts):
                a = acts[cursor[r]]
                t = ready(a)
                if t is None:
                    break
                begin = max(clock[r], t)
                end = begin + duration(a)
                done[(a.kind, a.stage, a.mb)] = end
                events.append(Event(r, a, begin, end))
                clock[r] = end
                cursor[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: acts[cursor[r]] for r, acts in orders.items() if cursor[r] < len(acts)}
            raise RuntimeError(f"pipeline schedule deadlocked at {stuck}")
    return events, clock, _activation_peaks(events, saved, "W" if has_w else "B", kept, sent)


def send_retention(schedule: str, owner: list[int], nbytes: float) -> Callable[[Action], float] | None:
    """``run_pipeline``'s ``sent`` for ``schedule`` (module docstring): under the multi-stage schedules the
    releasing action of a stage whose output went to another rank leaves that output (``nbytes``, the residual
    stream's shard of one micro-batch) alive, and the backward (ZBV: input-gradient) action of a stage whose
    input came from another rank adds the gradient it sends back; None for ``gpipe`` and ``1f1b``."""
    if schedule not in ("interleaved", "zbv"):
        return None
    n = len(owner)
    release = "W" if schedule == "zbv" else "B"
    grad = "I" if schedule == "zbv" else "B"

    def sent(a: Action) -> float:
        out = nbytes if a.kind == release and a.stage < n - 1 and owner[a.stage + 1] != owner[a.stage] else 0.0
        back = nbytes if a.kind == grad and a.stage > 0 and owner[a.stage - 1] != owner[a.stage] else 0.0
        return out + back

    return sent


def _activation_peaks(events: list[Event], saved: Callable[[int], float], release: str,
                      kept: Callable[[int], float] | None = None,
                      sent: Callable[[Action], float] | None = None) -> dict[int, float]:
    """Per rank, the most saved-activation bytes alive at once (live from F start to the releasing action's
    end, less what it leaves ``kept``; what an action leaves ``sent`` stays to the end)."""
    changes: dict[int, list[tuple[float, int, float]]] = {}
    for e in events:
        a = e.action
        if a.kind == "F":
            changes.setdefault(e.rank, []).append((e.start, 1, saved(a.stage)))
        elif a.kind == release:
            left = kept(a.stage) if kept else 0.0
            changes.setdefault(e.rank, []).append((e.end, 0, left - saved(a.stage)))
        if a.kind != "F" and sent is not None and sent(a):
            changes.setdefault(e.rank, []).append((e.end, 0, sent(a)))
    peaks = {}
    for rank, items in changes.items():
        live = peak = 0.0
        for _, _, delta in sorted(items):
            live += delta
            peak = max(peak, live)
        peaks[rank] = peak
    return peaks


# -- the layout of a pipeline (used by the schedules plait runs and by the simulator) ------------------------
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zbv")
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


def partition_units(costs: list[float], num_stages: int, *, first_cost: float = 0.0, last_cost: float = 0.0,
                    embedding_unit: bool = False, head_unit: bool = False) -> list[range]:
    """``partition_layers`` where the embedding (``embedding_unit``) and the head with the loss (``head_unit``) are
    units of the split of their own, costing ``first_cost`` and ``last_cost`` (Megatron-LM's
    ``--account-for-embedding-in-pipeline-split`` and ``--account-for-loss-in-pipeline-split``; Llama 3's first and
    last chunks): the first stage may then hold the embedding alone and the last the head alone, an empty range of
    layers. Every other stage holds at least one layer. Returns each stage's range of layers."""
    units = [first_cost] * embedding_unit + list(costs) + [last_cost] * head_unit
    try:
        ranges = partition_layers(units, num_stages, first_cost=0.0 if embedding_unit else first_cost,
                                  last_cost=0.0 if head_unit else last_cost)
    except PipelineConfigError:
        if num_stages <= len(units):
            raise
        parts = " (the embedding and the head count as one each)" if embedding_unit or head_unit else ""
        raise PipelineConfigError(
            f"{num_stages} pipeline stages but the model has only {len(costs)} layers{parts}: every stage needs at "
            "least one block, or the embedding or the head alone (parallel.pp_split_embedding, pp_split_head); "
            "lower parallel.pp (or the virtual stages per rank)") from None
    n, off = len(costs), int(embedding_unit)
    return [range(min(max(r.start - off, 0), n), min(max(r.stop - off, 0), n)) for r in ranges]


def stage_ranks(num_ranks: int, num_stages: int, style: str) -> list[int]:
    """Pipeline rank of each stage: round-robin ("loop") or V-shaped ("v", 2 stages per rank)."""
    if style == "v":
        return [s if s < num_ranks else 2 * num_ranks - 1 - s for s in range(num_stages)]
    return [s % num_ranks for s in range(num_stages)]


def check_pipeline_layout(schedule: str, num_ranks: int, microbatches: int, virtual: int) -> None:
    """Readable errors for layouts the schedules cannot run."""
    if schedule not in SCHEDULE_NAMES:
        raise PipelineConfigError(
            f"unknown pipeline schedule {schedule!r}; "
            f"parallel.pp_schedule must be one of {sorted(SCHEDULE_NAMES)}")
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


def theoretical_bubble(num_ranks: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a synchronous schedule: (p-1)/(v*m+p-1) (GPipe/1F1B: v=1)."""
    return (num_ranks - 1) / (virtual_stages * microbatches + num_ranks - 1)
