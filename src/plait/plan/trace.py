"""A simulated step as a Chrome / Perfetto trace: one process per pipeline rank, one thread per lane."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LANES = ("compute", "dp", "fsdp", "pp", "optimizer")


def chrome_trace(sim: Any) -> dict[str, Any]:
    """``traceEvents`` of every span of every pipeline rank's timeline, times in microseconds. Each pipeline
    rank stands for all its data- and tensor-parallel replicas; tensor-parallel collectives run inside the
    compute spans (their seconds are in each span's ``args.tp_comm_s``)."""
    events: list[dict[str, Any]] = []
    lay = sim.work.layout
    for rank, tl in sorted(sim.timelines.items()):
        label = f"pipeline rank {rank}" + (f" (x{lay.dp * lay.tp} replicas)" if lay.dp * lay.tp > 1 else "")
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": label}})
        for tid, lane in enumerate(LANES):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": lane}})
        for span in tl.spans:
            tid = LANES.index(span.lane) if span.lane in LANES else len(LANES)
            events.append({"name": span.name, "cat": span.lane, "ph": "X", "pid": rank, "tid": tid,
                           "ts": span.start * 1e6, "dur": max(span.end - span.start, 0.0) * 1e6,
                           "args": {k: v for k, v in span.args.items()}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"layout": lay.describe(), "step_s": sim.step_s, "hardware": sim.cluster.profile.name}}


def write_trace(sim: Any, path: str | Path) -> Path:
    """Write ``chrome_trace(sim)`` to ``path`` (open it in Perfetto or chrome://tracing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(sim)))
    return path
