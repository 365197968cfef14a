"""Stragglers: which rank is slow, from every rank's own compute time at the logged steps.

In synchronous training every rank's step time is the slowest rank's (the others wait in the gradient
all-reduce), so the slow rank shows in its own work time: data loading + forward + backward
(``rank_data_s``, ``rank_compute_s``, gathered by the trainer at log steps). Each rank's ratio to the
median rank is smoothed (exponential moving average, weight ``alpha`` on the newest) into a score; a
rank whose ratio exceeds ``factor`` at ``persist`` logged steps in a row, and whose score does too, is named a
straggler (a rank the operating system delayed once is not, however long the delay).
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
        # persistence counts the raw ratios: one long delay lifts the smoothed score for several steps, but it
        # is one step above the factor, not ``persist``
        self.above = [a + 1 if r > self.factor else 0 for a, r in zip(self.above, ratios, strict=True)]
        return [r for r, (a, s) in enumerate(zip(self.above, self.scores, strict=True))
                if a >= self.persist and s > self.factor]
