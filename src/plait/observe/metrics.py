"""Per-step metrics: ``metrics.jsonl``, TensorBoard event files, and the rank-0 progress bar."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

STEP_KEYS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_s", "data_s", "forward_s",
             "backward_s", "comm_exposed_s", "optimizer_s")


class MetricsWriter:
    """Writes one JSON object per logged step; a no-op on ranks other than 0."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool) -> None:
        self.enabled = enabled
        self._file = open(run_dir / "metrics.jsonl", "a") if enabled else None  # noqa: SIM115
        self._tb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            step = record["step"]
            for k, v in record.items():
                if k != "step" and isinstance(v, int | float):
                    self._tb.add_scalar(f"train/{k}" if k != "val_loss" else "val/loss", v, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


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
