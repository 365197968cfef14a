"""``plait simulate --compare RUN_DIR``: a prediction next to what a run measured, with each figure's error.

Measured figures come from the run's ``metrics.jsonl`` (step time and throughput: the median over the
logged steps after the first ``WARMUP_FRACTION`` of them, which hold start-up, first-step compilation
of kernels and allocator growth) and ``summary.json`` (model-state bytes per rank, measured by the
trainer after backward; the pipeline's measured bubble per stage). Error = (predicted - measured) /
measured.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from plait.config import ConfigError

WARMUP_FRACTION = 0.2


def measured(run_dir: Path) -> dict[str, Any]:
    """Step time, throughput, model-state bytes and bubble a run recorded (see the module docstring)."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise ConfigError(f"{run_dir} holds no metrics.jsonl; --compare takes a run directory plait train wrote")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "step_s" in r]
    if not steps:
        raise ConfigError(f"{metrics} has no logged steps; run more steps or log every step (train.log_every=1)")
    steady = steps[int(len(steps) * WARMUP_FRACTION):] or steps
    out: dict[str, Any] = {"step_s": statistics.median(r["step_s"] for r in steady), "steps_used": len(steady)}
    if all("tokens_per_s" in r for r in steady):
        out["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in steady)
    summary = run_dir / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        mem = s.get("memory", {})
        out["model_state_bytes"] = mem.get("measured_model_state_bytes")
        pipe = s.get("pipeline")
        if pipe:
            out["bubble"] = [r["bubble_measured"] for r in pipe.get("ranks", [])]
        out["world_size"] = s.get("world_size")
    return out


def _error(pred: float, meas: float | None) -> dict[str, Any]:
    if meas in (None, 0):
        return {"predicted": pred, "measured": meas, "error": None}
    return {"predicted": pred, "measured": meas, "error": round((pred - meas) / meas, 4)}


def compare_run(sim: Any, run_dir: Path) -> dict[str, Any]:
    """Each figure predicted and measured, with its relative error."""
    m = measured(run_dir)
    lay = sim.work.layout
    out: dict[str, Any] = {"run_dir": str(run_dir), "steps_used": m["steps_used"],
                           "step_s": _error(sim.step_s, m["step_s"])}
    if "tokens_per_s" in m:
        out["tokens_per_s"] = _error(sim.tokens_per_s, m["tokens_per_s"])
    states = m.get("model_state_bytes")
    if states:
        per_pp = lay.dp * lay.tp
        out["model_state_bytes"] = [_error(sim.memory[r // per_pp].model_states, v) for r, v in enumerate(states)]
    if m.get("bubble"):
        predicted = sim.bubble()["per_rank"]
        out["bubble"] = [{"predicted": p, "measured": b} for p, b in zip(predicted, m["bubble"], strict=False)]
    return out
