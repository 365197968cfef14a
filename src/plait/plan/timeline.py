"""One training step on simulated time, per rank: compute, the layout's communication, and their overlap.

Without pipelining (``flat_step``): each accumulation micro-step runs the embedding, the blocks and the
head forward, then backward in reverse, tensor-parallel collectives inline. On the last micro-step the
data-parallel gradient buckets (plait's reducer: all-reduce in bucket order as each bucket's last
gradient is produced, one communication stream) overlap the rest of backward; ZeRO-2 reduce-scatters
them instead and backward waits whenever more than one launched bucket is still in flight
(``MAX_FULL_IN_FLIGHT``); ZeRO-1 all-reduces every bucket when the step asks for gradients (after
backward, exposed) and all-gathers the updated shards after the optimizer; ZeRO-3 (FSDP2) all-gathers
each unit before its forward and, with ``reshard_after_forward``, again before its backward, and
reduce-scatters each unit's gradients after its backward on the last micro-step.

On a calibrated CPU, FSDP2's own work around each unit collective (copy-in, copy-out, hooks, DTensor
wrapping: the ``fsdp_unit`` overhead) and the pipeline schedule's handling of each action (receive and
send set-up, stage bookkeeping: ``pipeline_action``) run on the rank's thread and add to its time; both
are 0 on a GPU profile, where that host work runs ahead of the device.

Overlap: on a GPU the next all-gather is prefetched while the current unit computes (FSDP2's
behaviour under CUDA streams): in forward as the previous unit starts, in backward as this unit's backward
starts, ahead of this unit's reduce-scatter; gathers and reduce-scatters share the network (one stream),
so a unit whose collectives outlast one unit's compute exposes the difference. On a CPU the process
issues the all-gather when the unit's forward starts and waits for it at once, so nothing is prefetched;
and an asynchronous collective overlaps compute only on a core no rank computes on, otherwise it takes
its time from the compute stream.

With pipelining (``pipeline_step``): each accumulation micro-step is one schedule step
(``plait.plan.schedule``); after the last, plait's pipeline layout reduces the data-parallel gradients
(not overlapped: every pipeline micro-batch runs its own backward) and sums tied-embedding gradients
over the pipeline ranks. Then, in both cases, the gradient-norm all-reduce, the optimizer and, for
ZeRO-1/2, the parameter all-gathers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.plan.buckets import MAX_FULL_IN_FLIGHT
from plait.plan.schedule import Action, pipeline_orders, run_pipeline, send_retention, stage_owner
from plait.plan.stages import LayerCost, StageModel


@dataclass
class Span:
    """One event of a rank's timeline: ``lane`` is compute, tp (inline collectives), dp, fsdp, p2p or optimizer."""

    name: str
    lane: str
    start: float
    end: float
    args: dict = field(default_factory=dict)


@dataclass
class RankTimeline:
    """A pipeline rank's step: its spans, end time, exposed communication by kind, busy compute time."""

    rank: int
    spans: list[Span] = field(default_factory=list)
    end: float = 0.0
    exposed: dict[str, float] = field(default_factory=dict)
    busy: float = 0.0
    activation_peak: float = 0.0

    def expose(self, kind: str, seconds: float) -> None:
        self.exposed[kind] = self.exposed.get(kind, 0.0) + max(0.0, seconds)


class CommStream:
    """One in-order communication stream: each collective starts when issued and the stream is free."""

    def __init__(self, timeline: RankTimeline, lane: str, overlaps: bool) -> None:
        self.tl, self.lane, self.overlaps = timeline, lane, overlaps
        self.free = 0.0

    def issue(self, name: str, at: float, seconds: float) -> float:
        start = max(at, self.free)
        self.free = start + seconds
        self.tl.spans.append(Span(name, self.lane, start, self.free))
        return self.free


def _layers(model: StageModel, layers: range, first: bool, last: bool) -> list[tuple[int, LayerCost]]:
    out = [(-1, model.embed())] if first else []
    out += [(i, model.block(i)) for i in layers]
    return out + ([(model.work.shape.n_layer, model.head())] if last else [])


def _ready_times(bucket_layers: list[list[int]], bwd_end: dict[int, float]) -> list[float]:
    """When each bucket's last gradient is produced: its latest layer in backward order."""
    return [max(bwd_end[layer] for layer in layers) for layers in bucket_layers]


def flat_step(model: StageModel, tl: RankTimeline, comm: dict, t0: float = 0.0) -> float:
    """All micro-steps of a step without pipelining on ``tl``; returns when backward's communication is done.

    ``comm`` holds the layout's plan: ``buckets`` (per bucket: its layers and collective seconds),
    ``unit_ag`` / ``unit_rs`` (FSDP2 per-unit all-gather / reduce-scatter seconds, keyed by block index
    with the root unit under -1) and the flags ``overlap`` (a free core or a GPU: asynchronous collectives
    overlap compute) and ``prefetch`` (the next unit's all-gather is issued while this one computes)."""
    work = model.work
    lay = work.layout
    n = work.shape.n_layer
    layers = _layers(model, range(n), True, True)
    fsdp = lay.zero == 3
    stream = CommStream(tl, "fsdp" if fsdp else "dp", comm["overlap"])
    unit_s = model.compute.overhead("fsdp_unit")  # FSDP2's work on the rank's thread around each unit collective
    t = t0

    def gather(name: str, unit: int, issue_at: float, now: float) -> float:
        """Compute may start at the returned time: the unit's all-gather is done."""
        if unit_s:
            tl.spans.append(Span(f"{name} (FSDP2 work)", "fsdp", now, now + unit_s))
            tl.expose("fsdp", unit_s)
            now += unit_s
        done = stream.issue(name, issue_at if comm["prefetch"] else now, comm["unit_ag"][unit])
        begin = max(now, done)
        tl.expose("fsdp", begin - now)
        return begin

    for micro in range(work.accumulation):
        last = micro == work.accumulation - 1
        bwd_end: dict[int, float] = {}
        prev_start = t
        if fsdp:
            t = gather("all-gather root", -1, t, t)
        for idx, cost in layers:
            if fsdp and 0 <= idx < n:
                t = gather(f"all-gather block {idx}", idx, prev_start, t)
            tl.spans.append(Span(f"F {_name(idx, work)}", "compute", t, t + cost.fwd,
                                 {"micro_step": micro, "tp_comm_s": cost.tp_fwd, "ep_comm_s": cost.ep_fwd}))
            prev_start, t = t, t + cost.fwd
        t = _backward(model, tl, stream, comm, layers, micro, last, bwd_end, t)
        if last:
            t = _reduce_gradients(model, tl, stream, comm, bwd_end, t)
    return t


def _backward(model: StageModel, tl: RankTimeline, stream: CommStream, comm: dict, layers: list, micro: int,
              last: bool, bwd_end: dict[int, float], t: float) -> float:
    """One micro-step's backward on ``tl`` from ``t`` (``flat_step``): FSDP's re-gathers, prefetched one unit
    ahead, and on the last micro-step each unit's reduce-scatter; returns when the backward's compute ends."""
    work = model.work
    lay, n = work.layout, work.shape.n_layer
    fsdp = lay.zero == 3
    unit_s = model.compute.overhead("fsdp_unit")
    regather = fsdp and lay.reshard_after_forward
    blocks_back = [idx for idx, _ in reversed(layers) if 0 <= idx < n]
    after = dict(zip([n] + blocks_back, blocks_back, strict=False))  # the unit backward reaches next
    prefetched: dict[int, float] = {}  # unit -> when its backward all-gather, issued ahead, is done
    for idx, cost in reversed(layers):
        if regather and idx in prefetched:
            begin = max(t, prefetched.pop(idx))
            tl.expose("fsdp", begin - t)
            t = begin
        elif regather and 0 <= idx < n:
            if unit_s:
                tl.spans.append(Span(f"all-gather block {idx} (backward) (FSDP2 work)", "fsdp", t, t + unit_s))
                tl.expose("fsdp", unit_s)
                t += unit_s
            done = stream.issue(f"all-gather block {idx} (backward)", t, comm["unit_ag"][idx])
            tl.expose("fsdp", max(t, done) - t)
            t = max(t, done)
        if regather and comm["prefetch"] and idx in after:
            # FSDP2's backward prefetch: the next unit's all-gather is issued as this unit's backward
            # starts, ahead of this unit's reduce-scatter (issued when its gradients exist)
            unit = after[idx]
            prefetched[unit] = stream.issue(f"all-gather block {unit} (backward)", t, comm["unit_ag"][unit])
        tl.spans.append(Span(f"B {_name(idx, work)}", "compute", t, t + cost.bwd,
                             {"micro_step": micro, "tp_comm_s": cost.tp_bwd, "ep_comm_s": cost.ep_bwd}))
        t += cost.bwd
        bwd_end[idx] = t
        if fsdp and last and 0 <= idx < n:
            t += unit_s
            tl.expose("fsdp", unit_s)
            done = stream.issue(f"reduce-scatter block {idx}", t, comm["unit_rs"][idx])
            if not comm["overlap"]:
                tl.expose("fsdp", done - t)
                t = done
    return t


def _reduce_gradients(model: StageModel, tl: RankTimeline, stream: CommStream, comm: dict,
                      bwd_end: dict[int, float], t: float) -> float:
    lay = model.work.layout
    if lay.zero == 3:
        unit_s = model.compute.overhead("fsdp_unit")
        t += unit_s
        tl.expose("fsdp", unit_s)
        done = stream.issue("reduce-scatter root", t, comm["unit_rs"][-1])
        tl.expose("fsdp", done - t)
        return max(t, done)
    buckets = comm["buckets"]
    if not buckets:
        return t
    if lay.zero == 1:  # all-reduced in place when the step asks for gradients
        done = t
        for i, (_, seconds) in enumerate(buckets):
            done = stream.issue(f"all-reduce bucket {i}", done, seconds)
        tl.expose("dp", done - t)
        return done
    ready = _ready_times([layers for layers, _ in buckets], bwd_end)
    ends: list[float] = []
    stall = 0.0
    for i, ((_, seconds), at) in enumerate(zip(buckets, ready, strict=True)):
        at += stall
        if lay.zero == 2 and i >= MAX_FULL_IN_FLIGHT and ends[i - MAX_FULL_IN_FLIGHT] > at:
            wait = ends[i - MAX_FULL_IN_FLIGHT] - at  # backward waits for the oldest bucket in flight
            stall += wait
            tl.expose("dp", wait)
        name = ("reduce-scatter" if lay.zero == 2 else "all-reduce") + f" bucket {i}"
        ends.append(stream.issue(name, at, seconds))
    t += stall
    if not comm["overlap"]:  # no free core: the collectives ran on the compute cores
        busy = sum(seconds for _, seconds in buckets)
        tl.expose("dp", busy)
        return t + busy
    tl.expose("dp", max(0.0, ends[-1] - t))
    return max(t, ends[-1])


def _name(idx: int, work: object) -> str:
    n = work.shape.n_layer
    return "embedding" if idx < 0 else "head" if idx >= n else f"block {idx}"


def pipeline_step(model: StageModel, timelines: dict[int, RankTimeline], ranges: list[range],
                  transfer_s: float, t0: float = 0.0, per_action: dict[int, float] | None = None) -> dict[int, float]:
    """All accumulation micro-steps of a pipelined step; fills each pipeline rank's timeline, returns each
    rank's end. ``ranges[s]`` are stage ``s``'s blocks; ``transfer_s`` is one activation's point-to-point
    time between ranks; ``per_action`` what each pipeline rank adds to every forward and backward (ZeRO-3's
    re-gather of its units, ``plait.plan.layouts.pipeline_zero``)."""
    work = model.work
    lay = work.layout
    n = len(ranges)
    owner = stage_owner(lay.pp, lay.virtual, lay.schedule)
    costs = [model.stage(ranges[s], s == 0, s == n - 1) for s in range(n)]
    orders = pipeline_orders(lay.schedule, lay.pp, lay.microbatches, lay.virtual)

    action_s = model.compute.overhead("pipeline_action")  # the schedule's handling of one action (cpu)

    def duration(a: Action) -> float:
        c = costs[a.stage]
        extra = (per_action or {}).get(owner[a.stage], 0.0) if a.kind in ("F", "B", "I") else 0.0
        return {"F": c.fwd, "B": c.bwd, "I": c.bwd_in, "W": c.bwd_w}[a.kind] + action_s + extra

    def transfer(src: int, dst: int, _: str) -> float:
        return 0.0 if owner[src] == owner[dst] else transfer_s

    ends = {r: t0 for r in range(lay.pp)}
    kept = (lambda s: costs[s].zbv_kept) if lay.schedule == "zbv" else None
    sent = send_retention(lay.schedule, owner, model.hop_bytes) if work.stack == "plait" else None
    left = {r: 0.0 for r in range(lay.pp)}  # what earlier schedule steps of this accumulation left alive
    for micro in range(work.accumulation):
        start = max(ends.values())
        events, ends, peaks = run_pipeline(orders, owner, duration, transfer, lambda s: costs[s].saved, start, kept,
                                           sent)
        for e in events:
            tl = timelines[e.rank]
            a = e.action
            c = costs[a.stage]
            tp = c.tp_fwd if a.kind == "F" else c.tp_bwd if a.kind in ("B", "I") else 0.0
            ep = c.ep_fwd if a.kind == "F" else c.ep_bwd if a.kind in ("B", "I") else 0.0
            tl.spans.append(Span(f"{a.kind}{a.mb} stage {a.stage}", "compute", e.start, e.end,
                                 {"micro_step": micro, "stage": a.stage, "microbatch": a.mb, "tp_comm_s": tp,
                                  "ep_comm_s": ep}))
            tl.busy += e.end - e.start
        for r, peak in peaks.items():
            timelines[r].activation_peak = max(timelines[r].activation_peak, left[r] + peak)
        if kept is not None:
            for e in events:
                if e.action.kind == "F":
                    left[e.rank] += kept(e.action.stage)
    return ends
