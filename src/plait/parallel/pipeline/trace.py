"""Pipeline accounting: per-micro-batch timings of every stage, bubble fractions, a Chrome trace.

Each stage's ``forward_one_chunk``, ``backward_one_chunk`` and ``backward_weight_one_chunk`` (the calls
every ``torch.distributed.pipelining`` schedule makes, single- or multi-stage) is wrapped to record
wall-clock start and end. Wall-clock (``time.time_ns``) rather than a process-local counter so events
of different ranks line up on one timeline; on one machine the clocks are the same clock.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from plait.plan.schedule import theoretical_bubble


@dataclass(frozen=True)
class PipeEvent:
    """One unit of work of one stage: F (forward), B (full backward), I (input grad), W (weight grad)."""

    kind: str
    stage: int
    rank: int
    microbatch: int
    start_ns: int
    end_ns: int


@dataclass(frozen=True)
class StepSpan:
    """The wall-clock span of one schedule step on one pipeline rank."""

    rank: int
    start_ns: int
    end_ns: int



def measured_bubble(events: list[PipeEvent], span: StepSpan) -> float:
    """1 - busy / span for the events of ``span.rank``: the fraction of the step this rank idled."""
    busy = sum(e.end_ns - e.start_ns for e in events if e.rank == span.rank)
    total = max(span.end_ns - span.start_ns, 1)
    return max(0.0, 1.0 - busy / total)


def instrument_stage(stage: Any, rank: int, sink: list[PipeEvent]) -> None:
    """Wrap the stage's compute calls so each one appends a ``PipeEvent`` to ``sink``.

    The wrappers live on the stage instance and call the original bound methods unchanged, so the
    schedules see the same behaviour; only the time around each call is recorded.
    """
    def wrap(name: str, kind_of) -> None:
        original = getattr(stage, name)

        def timed(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            start = time.time_ns()
            out = original(chunk_id, *args, **kwargs)
            sink.append(PipeEvent(kind_of(kwargs), stage.stage_index, rank, chunk_id, start, time.time_ns()))
            return out

        setattr(stage, name, timed)

    wrap("forward_one_chunk", lambda kw: "F")
    wrap("backward_one_chunk", lambda kw: "B" if kw.get("full_backward", True) else "I")
    wrap("backward_weight_one_chunk", lambda kw: "W")


def bubble_summary(events: list[PipeEvent], spans: list[StepSpan], microbatches: int,
                   virtual_stages: int, num_ranks: int | None = None) -> dict[str, Any]:
    """Per-rank measured idle fraction next to the theoretical one, ready for ``summary.json``.

    ``num_ranks`` defaults to the number of spans (pass it when summarising a subset of ranks).
    """
    num_ranks = num_ranks or len(spans)
    theory = theoretical_bubble(num_ranks, microbatches, virtual_stages)
    per_rank = []
    for span in sorted(spans, key=lambda s: s.rank):
        busy_ms = sum(e.end_ns - e.start_ns for e in events if e.rank == span.rank) / 1e6
        per_rank.append({
            "rank": span.rank,
            "stages": sorted({e.stage for e in events if e.rank == span.rank}),
            "busy_ms": round(busy_ms, 3),
            "span_ms": round((span.end_ns - span.start_ns) / 1e6, 3),
            "bubble_measured": round(measured_bubble(events, span), 4),
            "bubble_theory": round(theory, 4),
        })
    return {"num_ranks": num_ranks, "microbatches": microbatches, "virtual_stages": virtual_stages,
            "bubble_theory": round(theory, 4), "ranks": per_rank}


def chrome_trace(events: list[PipeEvent], spans: list[StepSpan] | None = None) -> dict[str, Any]:
    """Chrome/Perfetto trace: one process per pipeline rank, one thread per stage, "X" events in µs."""
    origin = min((e.start_ns for e in events), default=0)
    trace: list[dict[str, Any]] = []
    for rank in sorted({e.rank for e in events}):
        trace.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                      "args": {"name": f"pipeline rank {rank}"}})
    for e in events:
        trace.append({
            "name": f"{e.kind}{e.microbatch}", "cat": e.kind, "ph": "X", "pid": e.rank, "tid": e.stage,
            "ts": (e.start_ns - origin) / 1e3, "dur": (e.end_ns - e.start_ns) / 1e3,
            "args": {"stage": e.stage, "microbatch": e.microbatch},
        })
    for s in spans or []:
        trace.append({"name": "step", "cat": "step", "ph": "X", "pid": s.rank, "tid": -1,
                      "ts": (s.start_ns - origin) / 1e3, "dur": (s.end_ns - s.start_ns) / 1e3})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | Path, events: list[PipeEvent],
                       spans: list[StepSpan] | None = None) -> Path:
    """Write ``chrome_trace(events, spans)`` as JSON to ``path`` (open it in Perfetto or chrome://tracing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(events, spans)))
    return path


def events_to_dicts(events: list[PipeEvent]) -> list[dict[str, Any]]:
    """Plain dicts, for logging or JSON."""
    return [asdict(e) for e in events]
