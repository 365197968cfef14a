"""Rank 0's metrics: ``metrics.jsonl``, the same to each of ``observe.trackers`` (TensorBoard, W&B, MLflow),
and the progress bar, opened on first use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from plait.config import Config, to_dict
from plait.observe.metrics import MetricsWriter, ProgressBar, truncate_metrics


class MetricsSink:
    """What ``Plait.log`` writes to (rank 0 only; other ranks hold an inactive sink)."""

    def __init__(self, run_dir: Path, config: Config, active: bool) -> None:
        self.run_dir, self.config, self.active = run_dir, config, active
        self._writer: MetricsWriter | None = None
        self._bar: ProgressBar | None = None

    def log(self, rec: dict[str, Any]) -> None:
        if not self.active:
            return
        if self._writer is None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            o = self.config.observe
            self._writer = MetricsWriter(self.run_dir, True, o.trackers, to_dict(self.config), o.experiment,
                                         o.mlflow_uri)
        self._writer.log(rec)
        if self._bar is None and self.config.observe.progress:
            self._bar = ProgressBar(self.config.train.steps, 0, True)
        if self._bar is not None and "loss" in rec:
            self._bar.update(int(rec["step"]), float(rec["loss"]), float(rec.get("tokens_per_s", 0.0)), rec.get("mfu"))

    def truncate(self, step: int) -> None:
        """Drop ``metrics.jsonl`` records of steps after ``step`` (a restart or a rollback undid them); the
        trackers rewind with it."""
        if not self.active:
            return
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        truncate_metrics(self.run_dir, step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._writer is not None:
            self._writer.close()
