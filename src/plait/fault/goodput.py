"""Goodput: the share of wall time spent on steps that ended in the final model, and where the rest went.

A run appends events to ``RUN_DIR/goodput.jsonl`` (rank 0 of each attempt, and the launcher): ``launch``
and ``attempt`` (launcher, wall time), ``failed`` (launcher: when it saw the failure), ``ready`` (workers
set up), ``resume`` (checkpoint step and load seconds), ``step`` (step number, its seconds, wall time),
``save`` (blocking seconds), ``rollback`` (from, to), ``end``. ``goodput`` replays them: every step
executed after a resume or rollback to step c invalidates the executions of steps above c, whose time
becomes lost (recomputed after a crash, or rolled back); what remains is useful. Lost time by cause:
``detection`` (last event of a failed attempt to the launcher noticing), ``restart`` (the failure to
the next attempt's workers being ready, backoff included), ``checkpoint_load``, ``recomputed_steps``,
``rolled_back_steps``, ``blocking_save``, ``preempted`` (a preemption's save to the next attempt's workers being
ready: the time off the cluster, waiting to be requeued), and ``other`` (evaluation, logging, start-up).

``preempted`` events (the trainer, once every rank saved after SIGTERM/SIGUSR1) are counted as ``preemptions``,
not failures; ``failures`` counts the launcher's ``failed`` events and the attempts that ended without any word
(a job step killed under SLURM, restarted by the batch script: its next ``ready`` follows no ``end``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

LEDGER = "goodput.jsonl"


def _append(run_dir: Path | str, events: list[dict[str, Any]]) -> None:
    try:
        with open(Path(run_dir) / LEDGER, "a") as f:
            f.write("".join(json.dumps(e) + "\n" for e in events))
    except OSError:  # goodput is accounting, not state
        pass


def record(run_dir: Path | str, event: str, **fields: Any) -> None:
    """Append one event (wall time added); errors writing are ignored: goodput is accounting, not state."""
    _append(run_dir, [{"event": event, "t": time.time(), **fields}])


class Ledger:
    """Rank 0's events of one training process: ``step`` events are kept in memory (a step writes no file) and
    appended in one write by ``flush`` (at log steps) or before any other event, so the file keeps their order.
    A process killed between log steps loses the step events since the last one; the replay then counts their
    time as detection (or restart) instead of recomputed steps: the lost total is the same. Inactive off rank 0."""

    def __init__(self, run_dir: Path | str, active: bool) -> None:
        self.run_dir, self.active = run_dir, active
        self._steps: list[dict[str, Any]] = []

    def step(self, step: int, seconds: float) -> None:
        if self.active:
            self._steps.append({"event": "step", "t": time.time(), "step": step, "s": seconds})

    def record(self, event: str, **fields: Any) -> None:
        """The step events kept so far, then this one."""
        if self.active:
            events, self._steps = self._steps, []
            _append(self.run_dir, [*events, {"event": event, "t": time.time(), **fields}])

    def flush(self) -> None:
        if self.active and self._steps:
            events, self._steps = self._steps, []
            _append(self.run_dir, events)


def _events(run_dir: Path) -> list[dict[str, Any]]:
    out = []
    path = Path(run_dir) / LEDGER
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def goodput(run_dir: Path | str, end_time: float | None = None) -> dict[str, Any]:
    """Replay the ledger (see the module docstring) into ``{"goodput", "wall_s", "useful_s", "lost_s": {...}}``."""
    events = _events(Path(run_dir))
    if not events:
        return {"goodput": None, "reason": "no goodput ledger"}
    start = events[0]["t"]
    end = end_time if end_time is not None else events[-1]["t"]
    lineage: dict[int, float] = {}  # step -> seconds of its execution still in the final model's lineage
    lost = dict.fromkeys(("detection", "restart", "checkpoint_load", "recomputed_steps", "rolled_back_steps",
                          "blocking_save", "preempted"), 0.0)
    last_t = start
    failed_at: float | None = None
    preempted_at: float | None = None
    running, preemptions, failures = False, 0, 0  # running: an attempt is ready and has not ended in a word
    for e in events:
        kind = e["event"]
        if kind == "failed":
            lost["detection"] += max(0.0, e["t"] - last_t)
            failed_at, running, failures = e["t"], False, failures + 1
        elif kind == "preempted":
            preempted_at, running, preemptions = e["t"], False, preemptions + 1
        elif kind == "end":
            running = False
        elif kind == "ready":
            if failed_at is not None:
                lost["restart"] += max(0.0, e["t"] - failed_at)
            elif preempted_at is not None:
                lost["preempted"] += max(0.0, e["t"] - preempted_at)
            elif running:  # the last attempt ended without a word: killed, and restarted from outside
                lost["restart"] += max(0.0, e["t"] - last_t)
                failures += 1
            failed_at = preempted_at = None
            running = True
        elif kind in ("resume", "rollback"):
            to = int(e["step"] if kind == "resume" else e["to"])
            cause = "rolled_back_steps" if kind == "rollback" else "recomputed_steps"
            for s in [s for s in lineage if s > to]:
                lost[cause] += lineage.pop(s)
            lost["checkpoint_load"] += float(e.get("load_s", 0.0))
        elif kind == "step":
            step = int(e["step"])
            if step in lineage:  # executed again without a recorded resume (an attempt died before it)
                lost["recomputed_steps"] += lineage[step]
            lineage[step] = float(e["s"])
        elif kind in ("save", "save_done"):  # save_done: an asynchronous save's completion at a later step
            lost["blocking_save"] += float(e["blocking_s"])
        if kind != "failed":
            last_t = e["t"]
    wall = max(end - start, 1e-9)
    useful = sum(lineage.values())
    lost["other"] = max(0.0, wall - useful - sum(lost.values()))
    return {"goodput": useful / wall, "wall_s": wall, "useful_s": useful, "steps": len(lineage),
            "preemptions": preemptions, "failures": failures, "lost_s": {k: round(v, 3) for k, v in lost.items()}}
