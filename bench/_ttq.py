"""Time to quality, judged soundly: the helper every benchmark that reports "time to a target loss" uses.

A validation curve is a list of ``(step, seconds, val_loss)`` points, ``seconds`` the training time
spent up to that evaluation (sum of ``step_s``: evaluation and startup excluded). Three rules:

1. Smoothing. ``smooth(values, window)`` is the trailing (causal) mean of the last ``window``
   evaluations: point i averages ``values[max(0, i - window + 1) .. i]``. Trailing, so the smoothed
   value at an evaluation uses no later evaluation; one lucky evaluation moves it by 1/window only.
2. Stays below. The time to target is the time of the first evaluation whose smoothed loss is at or
   below the target *and every later smoothed loss is too* (``time_to_target``). A dip that rises back
   above the target is not a crossing; a run whose curve ends above the target never reached it.
3. Never a win when it ends worse. Per method, over seeds, the median and the spread (max - min) of
   the time to target and of the final (raw, last) validation loss are reported (``aggregate``). A
   method's ``verdict`` against the reference (DDP) is true only when every seed reached the target,
   its median time to target is below the reference's, and its median final loss is not worse than the
   reference's by more than the seeds' spread, ``max(spread of the method's finals, spread of the
   reference's finals)`` (``compare``). With a single seed the spread is 0: any final loss above the
   reference's makes the verdict false.

Functions take plain lists and dicts so they can be unit-tested on constructed curves
(tests/bench/test_ttq.py) and read metrics.jsonl written by plait's trainer or by bench/_ddp_peer.py.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

DEFAULT_WINDOW = 3


def smooth(values: list[float], window: int = DEFAULT_WINDOW) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start); ``window`` >= 1."""
    if window < 1:
        raise ValueError(f"window must be >= 1; got {window}")
    return [statistics.fmean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def curve_from_metrics(path: Path) -> list[tuple[int, float, float]]:
    """``(step, train seconds so far, val_loss)`` for every evaluation in a metrics.jsonl, in order.

    A step's record may carry ``val_loss`` itself, or a later line without ``step_s`` may (the trainer's
    final evaluation); seconds is the sum of every ``step_s`` up to and including that step. Where two
    evaluations share a step (an in-loop evaluation and the final one), the later one is kept."""
    elapsed, points = 0.0, []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        elapsed += r.get("step_s", 0.0)
        if "val_loss" in r:
            point = (int(r["step"]), elapsed, float(r["val_loss"]))
            if points and points[-1][0] == point[0]:
                points[-1] = point
            else:
                points.append(point)
    return points


def time_to_target(curve: list[tuple[int, float, float]], target: float,
                   window: int = DEFAULT_WINDOW) -> dict[str, Any]:
    """Rule 2 on one run's curve: ``{"reached", "time_to_target_s", "step_at_target", "final_val_loss",
    "final_smoothed"}``; times None when the smoothed curve does not stay at or below ``target`` from
    some evaluation to the end."""
    if not curve:
        return {"reached": False, "time_to_target_s": None, "step_at_target": None,
                "final_val_loss": float("nan"), "final_smoothed": float("nan")}
    sm = smooth([v for _, _, v in curve], window)
    first = None
    for i in range(len(sm) - 1, -1, -1):  # walk back from the end while the smoothed curve stays below
        if sm[i] > target:
            break
        first = i
    hit = curve[first] if first is not None else None
    return {"reached": hit is not None, "time_to_target_s": hit[1] if hit else None,
            "step_at_target": hit[0] if hit else None, "final_val_loss": curve[-1][2], "final_smoothed": sm[-1]}


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "min": None, "max": None, "spread": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "spread": max(values) - min(values)}


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Over one method's seeds (each a ``time_to_target`` result, maybe with ``step_s_median``): how many
    reached, and median / min / max / spread of time to target (reached seeds only), final val loss and
    median step time."""
    ok = [r for r in runs if "error" not in r]
    times = [r["time_to_target_s"] for r in ok if r["reached"]]
    out = {"seeds": len(runs), "failed": len(runs) - len(ok), "reached": len(times),
           "all_reached": bool(ok) and len(times) == len(runs),
           "time_to_target_s": _stats(times), "final_val_loss": _stats([r["final_val_loss"] for r in ok])}
    steps = [r["step_s_median"] for r in ok if r.get("step_s_median") is not None]
    out["step_s_median"] = _stats(steps)
    return out


def compare(method: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """Rule 3: ``method`` against ``reference`` (both ``aggregate`` results). Returns the median ratios
    (reference / method: above 1 means the method is faster), the final-loss gap (method - reference,
    medians), the tolerance (the larger of the two final-loss spreads), and ``verdict``."""
    mt, rt = method["time_to_target_s"]["median"], reference["time_to_target_s"]["median"]
    mf, rf = method["final_val_loss"]["median"], reference["final_val_loss"]["median"]
    spreads = [s for s in (method["final_val_loss"]["spread"], reference["final_val_loss"]["spread"]) if s is not None]
    tolerance = max(spreads, default=0.0)
    gap = mf - rf if mf is not None and rf is not None else None
    final_ok = gap is not None and gap <= tolerance
    speedup = rt / mt if mt and rt else None
    ms, rs = method["step_s_median"]["median"], reference["step_s_median"]["median"]
    out = {"speedup_median": speedup, "step_speedup_median": rs / ms if ms and rs else None,
           "final_loss_gap": gap, "final_loss_tolerance": tolerance, "final_loss_ok": final_ok}
    if not method["all_reached"]:
        why = f"only {method['reached']}/{method['seeds']} seeds stayed below the target"
    elif not final_ok:
        why = (f"final val loss {mf:.3f} is worse than the reference's {rf:.3f} by more than the seeds' spread "
               f"{tolerance:.3f}" if gap is not None else "no final val loss")
    elif reference["all_reached"] and (speedup is None or speedup <= 1.0):
        why = f"not faster to target than the reference (ratio {speedup or 0:.2f})"
    else:
        why = ""
    out["verdict"] = not why
    out["reason"] = why or ("faster to target with a final loss within the seeds' spread" if reference["all_reached"]
                            else "reached the target where the reference did not, with a final loss within spread")
    return out
