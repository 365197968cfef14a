"""Reading a run directory back: config, metrics, summary and pipeline trace, tolerant of a run in progress.

A report is made from whatever a run has left so far: a run still training has no ``summary.json``, a
run that has not logged has no metrics, a line cut short by a crash is not JSON. None of these is fatal:
what cannot be read is skipped and counted, and the report says so. Only a directory that holds none of
a run's files is an error.
"""

from __future__ import annotations

import json
import statistics
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait.config import ConfigError

RUN_FILES = ("config.toml", "metrics.jsonl", "summary.json")


@dataclass
class Run:
    """One run directory as the report sees it.

    ``steps``: training records (those with ``step_s``), one per step, sorted; a step logged twice (a run
    resumed from a checkpoint older than its last log) keeps its latest record. ``evals``: records with
    ``val_loss``. ``resumed_at``: steps where the log went back to an earlier step (a resume or rollback).
    ``bad_lines``: 1-based numbers of ``metrics.jsonl`` lines that were not a JSON object. ``rollbacks``
    ((from, to) steps) and ``failures`` (failed attempts the launcher restarted) come from the fault
    ledger ``goodput.jsonl`` where the run has one.
    """

    path: Path
    name: str
    config: dict[str, Any] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    trace: dict[str, Any] | None = None
    resumed_at: list[int] = field(default_factory=list)
    rollbacks: list[tuple[int, int]] = field(default_factory=list)
    failures: int = 0
    bad_lines: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def setting(self, section: str, key: str, default: Any = None) -> Any:
        """A value of the run's saved config, ``default`` when the config lacks it."""
        value = self.config.get(section, {})
        return value.get(key, default) if isinstance(value, dict) else default

    @property
    def world_size(self) -> int:
        if isinstance(self.summary.get("world_size"), int):
            return self.summary["world_size"]
        for rec in reversed(self.steps):
            if isinstance(rec.get("rank_step_s"), list):
                return len(rec["rank_step_s"])
        nproc = self.setting("parallel", "nproc", 1)
        return nproc if isinstance(nproc, int) and nproc > 0 else 1

    @property
    def has_tokens(self) -> bool:
        return bool(self.summary.get("tokens_per_s")) or any(r.get("tokens_per_s") for r in self.steps)

    def steady(self) -> list[dict[str, Any]]:
        """Training records without the first step (lazy initialisation, allocator warm-up, the first
        collective's connection set-up), unless it is all there is."""
        later = [r for r in self.steps if r.get("step", 0) > 1]
        return later or list(self.steps)

    def throughput(self, unit: str | None = None) -> tuple[float, str]:
        """(value, unit) with unit ``tokens/s`` or ``samples/s``: the summary's figure over the whole run
        when it exists, else the mean of the logged steps (first step left out)."""
        unit = unit or ("tokens/s" if self.has_tokens else "samples/s")
        key = "tokens_per_s" if unit == "tokens/s" else "samples_per_s"
        if isinstance(self.summary.get(key), int | float) and self.summary[key] > 0:
            return float(self.summary[key]), unit
        values = [float(r[key]) for r in self.steady() if isinstance(r.get(key), int | float)]
        return (statistics.fmean(values) if values else 0.0), unit


def _read_json(path: Path, run: Run, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        run.notes.append(f"{path.name} could not be read ({what} left out): {e}")
        return None


def _read_metrics(path: Path, run: Run) -> None:
    by_step: dict[int, dict[str, Any]] = {}
    last_step = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                rec = None
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int | float):
                run.bad_lines.append(number)
                continue
            step = int(rec["step"])
            if step < last_step and "step_s" in rec:
                run.resumed_at.append(step)
            if "step_s" in rec:
                last_step = step
                by_step[step] = rec
            if isinstance(rec.get("val_loss"), int | float):
                run.evals = [e for e in run.evals if e["step"] != step] + [rec]
    run.steps = [by_step[s] for s in sorted(by_step)]
    run.evals.sort(key=lambda e: e["step"])


def _read_ledger(path: Path, run: Run) -> None:
    """Resumes, rollbacks and failed attempts from the fault ledger; events it cannot use are ignored (the
    ledger is accounting, and its other events are the goodput figure's business)."""
    for line in path.read_text(errors="replace").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if not isinstance(e, dict):
            continue
        if e.get("event") == "resume" and isinstance(e.get("step"), int) and e["step"] not in run.resumed_at:
            run.resumed_at.append(e["step"])
        elif e.get("event") == "rollback" and isinstance(e.get("from"), int) and isinstance(e.get("to"), int):
            run.rollbacks.append((e["from"], e["to"]))
        elif e.get("event") == "failed":
            run.failures += 1


def load_run(path: str | Path) -> Run:
    """Read a run directory; raises ``ConfigError`` when ``path`` is not one (see the module docstring)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path} does not exist; pass a run directory (plait train prints it when it ends)")
    if not path.is_dir() or not any((path / f).is_file() for f in RUN_FILES):
        raise ConfigError(f"{path} is not a plait run directory: it holds none of {', '.join(RUN_FILES)}; pass "
                          "the directory plait train wrote (runs/plait-... by default)")
    run = Run(path=path, name=path.resolve().name)
    if (path / "config.toml").is_file():
        try:
            run.config = tomllib.loads((path / "config.toml").read_text())
        except (OSError, ValueError) as e:
            run.notes.append(f"config.toml could not be read (suggestions use default settings): {e}")
    if (path / "summary.json").is_file():
        summary = _read_json(path / "summary.json", run, "final figures, memory and pipeline")
        run.summary = summary if isinstance(summary, dict) else {}
    else:
        run.notes.append("no summary.json yet: the run has not finished (memory and pipeline figures come "
                         "with it)")
    if (path / "metrics.jsonl").is_file():
        _read_metrics(path / "metrics.jsonl", run)
    if not run.steps:
        run.notes.append("no metrics yet: metrics.jsonl holds no logged step, so this report is partial "
                         "(run it again once the run has logged a step)")
    if run.bad_lines:
        shown = ", ".join(map(str, run.bad_lines[:5])) + (" ..." if len(run.bad_lines) > 5 else "")
        run.notes.append(f"metrics.jsonl: {len(run.bad_lines)} line(s) could not be read and were skipped "
                         f"(line {shown})")
    if (path / "goodput.jsonl").is_file():
        _read_ledger(path / "goodput.jsonl", run)
    trace_name = (run.summary.get("pipeline") or {}).get("trace", "pipeline_trace.json")
    if (path / trace_name).is_file():
        trace = _read_json(path / trace_name, run, "pipeline timeline")
        run.trace = trace if isinstance(trace, dict) and isinstance(trace.get("traceEvents"), list) else None
    return run
