"""Stragglers: which rank is slow, from every rank's own compute time at the logged steps.

In synchronous training every rank's step time is the slowest rank's (the others wait in the gradient
all-reduce), so the slow rank shows in its own work time: data loading + forward + backward
(``rank_data_s``, ``rank_compute_s``, gathered by the trainer at log steps). Each rank's ratio to the
median rank is smoothed (exponential moving average, weight ``alpha`` on the newest) into a score; a
rank whose score exceeds ``factor`` is named a straggler.
"""

from __future__ import annotations

import statistics


class StragglerScore:
    def __init__(self, factor: float, alpha: float = 0.5) -> None:
        self.factor, self.alpha = factor, alpha
        self.scores: list[float] = []

    def observe(self, work_s: list[float]) -> list[int]:
        """Update with every rank's work time of one step; returns the ranks now named stragglers."""
        median = statistics.median(work_s) if work_s else 0.0
        ratios = [w / median if median > 0 else 1.0 for w in work_s]
        if len(self.scores) != len(ratios):
            self.scores = ratios
        else:
            self.scores = [self.alpha * r + (1 - self.alpha) * s for r, s in zip(ratios, self.scores, strict=True)]
        return [r for r, s in enumerate(self.scores) if s > self.factor]
