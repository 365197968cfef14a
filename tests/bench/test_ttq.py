"""bench/_ttq.py on constructed curves: smoothing, the stays-below rule, and a verdict that can be false."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("bench_ttq", Path(__file__).resolve().parents[2] / "bench" / "_ttq.py")
ttq = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(ttq)


def _curve(losses: list[float], step_s: float = 1.0, every: int = 10) -> list[tuple[int, float, float]]:
    return [((i + 1) * every, (i + 1) * every * step_s, v) for i, v in enumerate(losses)]


def test_smooth_is_a_trailing_mean():
    assert ttq.smooth([3.0, 1.0, 2.0, 6.0], 3) == pytest.approx([3.0, 2.0, 2.0, 3.0])
    assert ttq.smooth([1.0, 5.0], 1) == [1.0, 5.0]
    with pytest.raises(ValueError):
        ttq.smooth([1.0], 0)


def test_a_dip_followed_by_a_rise_is_not_a_crossing():
    # One lucky evaluation at 2.0 (raw below 2.6), then back above: neither raw nor smoothed stays below.
    curve = _curve([4.0, 3.5, 2.0, 3.4, 3.3, 3.2])
    out = ttq.time_to_target(curve, target=2.6, window=1)
    assert not out["reached"] and out["time_to_target_s"] is None and out["final_val_loss"] == 3.2
    assert not ttq.time_to_target(curve, target=2.6)["reached"]


def test_crossing_counts_from_the_first_point_after_which_it_stays_below():
    # Raw dips below 2.6 at step 30, rises to 2.9, then goes below for good from step 60.
    curve = _curve([4.0, 3.0, 2.5, 2.9, 2.7, 2.5, 2.4, 2.3])
    raw = ttq.time_to_target(curve, target=2.6, window=1)
    assert raw["reached"] and raw["step_at_target"] == 60 and raw["time_to_target_s"] == 60.0
    # Smoothed over 3: (2.7+2.5+2.4)/3=2.533 at step 70 is the first of the final run below 2.6.
    sm = ttq.time_to_target(curve, target=2.6, window=3)
    assert sm["step_at_target"] == 70 and sm["final_smoothed"] == pytest.approx(2.4)


def test_curve_from_metrics_sums_step_times_and_keeps_the_final_evaluation(tmp_path):
    rows = [{"step": 1, "step_s": 0.5}, {"step": 2, "step_s": 0.25, "val_loss": 3.0},
            {"step": 3, "step_s": 0.5}, {"step": 4, "step_s": 1.0, "val_loss": 2.4}, {"step": 4, "val_loss": 2.3}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert ttq.curve_from_metrics(path) == [(2, 0.75, 3.0), (4, 2.25, 2.3)]


def _seeds(times: list[float | None], finals: list[float], step_s: float = 0.1) -> dict:
    runs = [{"reached": t is not None, "time_to_target_s": t, "final_val_loss": f, "step_s_median": step_s}
            for t, f in zip(times, finals, strict=True)]
    return ttq.aggregate(runs)


def test_aggregate_median_and_spread():
    agg = _seeds([10.0, 30.0, 20.0], [2.5, 2.3, 2.4])
    assert agg["all_reached"] and agg["time_to_target_s"]["median"] == 20.0
    assert agg["time_to_target_s"]["spread"] == 20.0
    assert agg["final_val_loss"]["median"] == 2.4 and agg["final_val_loss"]["spread"] == pytest.approx(0.2)
    partial = _seeds([10.0, None, 20.0], [2.5, 2.9, 2.4])
    assert not partial["all_reached"] and partial["reached"] == 2 and partial["time_to_target_s"]["median"] == 15.0


def test_a_run_that_ends_worse_is_never_a_win():
    ddp = _seeds([30.0, 32.0, 31.0], [2.40, 2.42, 2.41])
    # Twice as fast to target, but ends 0.29 nats worse, far beyond the seeds' spread (0.02 / 0.04).
    fast_but_worse = _seeds([15.0, 16.0, 14.0], [2.70, 2.72, 2.68])
    v = ttq.compare(fast_but_worse, ddp)
    assert v["speedup_median"] == pytest.approx(31.0 / 15.0)
    assert v["final_loss_gap"] == pytest.approx(0.29) and v["final_loss_tolerance"] == pytest.approx(0.04)
    assert not v["verdict"] and "worse" in v["reason"]
    # Within the spread and faster: a win.
    fine = _seeds([15.0, 16.0, 14.0], [2.41, 2.44, 2.40])
    assert ttq.compare(fine, ddp)["verdict"]
    # Faster but one seed never stayed below: not a win.
    flaky = _seeds([15.0, None, 14.0], [2.41, 2.44, 2.40])
    assert not ttq.compare(flaky, ddp)["verdict"]
    # Ends equal but slower: not a win.
    slow = _seeds([40.0, 41.0, 42.0], [2.41, 2.41, 2.41])
    assert not ttq.compare(slow, ddp)["verdict"]


def test_single_seed_has_no_spread_to_hide_in():
    ddp = _seeds([30.0], [2.40])
    worse = _seeds([10.0], [2.41])
    v = ttq.compare(worse, ddp)
    assert v["final_loss_tolerance"] == 0.0 and not v["verdict"]


def test_empty_curve_is_not_reached():
    out = ttq.time_to_target([], 2.6)
    assert not out["reached"] and math.isnan(out["final_val_loss"])
