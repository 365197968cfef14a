"""Per-rank step timings for ``metrics.jsonl``: every rank's view of a logged step, gathered to rank 0.

``metrics.jsonl`` is written by rank 0 alone, so without this a slow rank is invisible: in synchronous
training every rank's *step* time is the same (each waits for the slowest in the gradient all-reduce),
and the slow one shows only in what the others wait. At log steps the trainer gathers, from every rank,
the parts of its step and logs them as lists indexed by global rank (``rank_step_s``, ``rank_compute_s``,
...). One all-gather of ``len(RANK_KEYS)`` floats per rank per logged step; nothing between log steps.
"""

from __future__ import annotations

from typing import Any

# What each rank reports, in the order it is gathered; compute_s is forward_s + backward_s.
RANK_KEYS = ("step_s", "data_s", "compute_s", "comm_exposed_s", "comm_wait_s", "optimizer_s")


def rank_values(rec: dict[str, Any]) -> list[float]:
    """This rank's timings of one step record (as ``Trainer.train_step`` returns it), in ``RANK_KEYS`` order."""
    return [float(rec["step_s"]), float(rec["data_s"]), float(rec["forward_s"]) + float(rec["backward_s"]),
            float(rec["comm_exposed_s"]), float(rec["comm_wait_s"]), float(rec["optimizer_s"])]


def rank_timings(plait: Any, rec: dict[str, Any]) -> dict[str, list[float]]:
    """``{"rank_<key>": [value of rank 0, rank 1, ...]}`` for one step; collective: every rank calls it."""
    rows = plait.gather(rank_values(rec))
    return {f"rank_{k}": [round(row[i], 6) for row in rows] for i, k in enumerate(RANK_KEYS)}
