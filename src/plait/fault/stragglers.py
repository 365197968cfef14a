"""Stragglers: which rank is slow, from every rank's own compute time at the logged steps.

In synchronous training every rank's step time is the slowest rank's (the others wait in the gradient
all-reduce), so the slow rank shows in its own work time: data loading + forward + backward
(``rank_data_s``, ``rank_compute_s``, gathered by the trainer at log steps). Each rank's ratio to the
median rank is smoothed (exponential moving average, weight ``alpha`` on the newest) into a score; a
rank whose score exceeds ``factor`` at ``persist`` logged steps in a row is named a straggler (a rank the
operating system delayed once is not).
"""

from __future__ import annotations

import statistics


class StragglerScore:
    def __init__(self, factor: float, alpha: float = 0.5, persist: int = 3) -> None:
        self.factor, self.alpha, self.persist = factor, alpha, persist
        self.scores: list[float] = []
        self.above: list[int] = []

    def observe(self, work_s: list[float]) -> list[int]:
        """Update with every rank's work time of one step; returns the ranks now named stragglers."""
        median = statistics.median(work_s) if work_s else 0.0
        ratios = [w / median if median > 0 else 1.0 for w in work_s]
        if len(self.scores) != len(ratios):
            self.scores, self.above = ratios, [0] * len(ratios)
        else:
            self.scores = [self.alpha * r + (1 - self.alpha) * s for r, s in zip(ratios, self.scores, strict=True)]
        self.above = [a + 1 if s > self.factor else 0 for a, s in zip(self.above, self.scores, strict=True)]
        return [r for r, a in enumerate(self.above) if a >= self.persist]
