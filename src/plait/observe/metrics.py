"""Per-step metrics: ``metrics.jsonl``, the experiment trackers (``plait.observe.trackers``), and the rank-0
progress bar."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from plait.observe.trackers import Trackers, rewind_trackers

STEP_KEYS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_s", "data_s", "forward_s",
             "backward_s", "comm_exposed_s", "optimizer_s")


class MetricsWriter:
    """Writes one JSON object per logged step and sends it to the trackers; a no-op on ranks other than 0.

    ``trackers``: names from ``observe.trackers``; ``config``: the resolved config (a dict) they record;
    ``experiment`` and ``mlflow_uri``: ``observe.experiment`` and ``observe.mlflow_uri``."""

    def __init__(self, run_dir: Path, enabled: bool, trackers: list[str] | tuple[str, ...] = (),
                 config: dict[str, Any] | None = None, experiment: str = "", mlflow_uri: str = "") -> None:
        self.enabled = enabled
        self._trackers = Trackers(run_dir, list(trackers), config or {}, experiment, mlflow_uri) \
            if enabled and trackers else None
        self._file = open(run_dir / "metrics.jsonl", "a") if enabled else None  # noqa: SIM115

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._trackers is not None:
            self._trackers.log(record)

    def flush(self) -> None:
        """What the trackers buffer, written now (an error is ending the run)."""
        if self._trackers is not None:
            self._trackers.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._trackers is not None:
            self._trackers.close()


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop ``metrics.jsonl`` records of steps after ``step`` (a timeline a restart or a rollback undid), so the
    file reads as one run, and rewind the trackers with it (close the ``MetricsWriter`` first)."""
    path = run_dir / "metrics.jsonl"
    if path.is_file():
        kept = []
        for line in path.read_text().splitlines():
            try:
                if int(json.loads(line).get("step", 0)) <= step:
                    kept.append(line)
            except (ValueError, AttributeError):
                continue
        path.write_text("".join(x + "\n" for x in kept))
    rewind_trackers(run_dir, step)


class ProgressBar:
    """Step, loss, tokens/s, MFU (``plait.train.mfu``) and time left on rank 0; nothing elsewhere."""

    def __init__(self, total: int, start: int, enabled: bool) -> None:
        self._progress = None
        self._t0 = time.perf_counter()
        if not enabled:
            return
        self._progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
            TextColumn("MFU {task.fields[mfu]}"), TimeRemainingColumn(), console=Console(stderr=True), transient=False,
        )
        self._task = self._progress.add_task("train", total=total, completed=start, loss=float("nan"),
                                             tps=0.0, mfu="-")
        self._progress.start()

    def update(self, step: int, loss: float, tokens_per_s: float, mfu: float | None = None) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step, loss=loss, tps=tokens_per_s,
                                  mfu=f"{100 * mfu:.1f}%" if mfu is not None else "-")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
