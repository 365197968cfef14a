"""Loss-spike and non-finite detection on the values every rank agrees on.

The detector sees, for every optimizer step, the loss averaged over the data-parallel replicas
(``StepInfo.global_loss``) and the global gradient norm: the same two numbers on every rank, so every
rank reaches the same verdict without communicating. It sees them when they are read anyway, at the next
log step (``train.log_every``) or before a save: judging costs no device-to-host read of its own.

A loss is a spike when all three hold (the default rule and the figures that chose it: docs/troubleshooting.md):

* the step is past the warm-up: ``step > after_steps`` (the loss of early training falls fast and bumps
  often; a plain loop rides through those bumps, and so must the detector);
* a relative jump: the loss exceeds the running median of the last ``window`` accepted losses by more than
  ``jump`` of it (``loss > (1 + jump) x median``), so small noise on a flat, quiet curve is never a spike;
* a robust deviation: the loss exceeds the median by more than ``threshold`` running deviations, the
  deviation being 1.4826 x the median absolute deviation (a robust standard deviation: a spike in the
  window does not inflate it), floored at 1% of the median.

The detector judges only once it holds ``window // 2`` values. The gradient norm is not judged against
its history: it drifts upward through healthy training, so a running-median rule flags it falsely; a
non-finite loss or norm is reported as such (the engine has already skipped that update). A spike is
not added to the history, so the median a later loss is judged against is the one before the spike: the
trainer asks ``limit()`` whether the loss came back below it.
"""

from __future__ import annotations

import bisect
import math
from collections import deque


class SpikeDetector:
    """See the module docstring; ``observe`` returns ``None``, ``"spike"`` or ``"nonfinite"``.

    The window is also kept sorted (``bisect``), so the median is an index and the median absolute deviation a
    merge of the two sorted halves' distances from it: no sort per judgement."""

    def __init__(self, threshold: float, window: int, jump: float = 0.0, after_steps: int = 0) -> None:
        self.threshold, self.window = threshold, max(4, window)
        self.jump, self.after_steps = jump, after_steps
        self.losses: deque[float] = deque(maxlen=self.window)
        self._sorted: list[float] = []

    @staticmethod
    def _median_of(xs: list[float]) -> float:
        n = len(xs)
        return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2

    def median(self) -> float:
        """The running median of the accepted losses (NaN while there are none)."""
        return self._median_of(self._sorted) if self._sorted else float("nan")

    def _deviation(self, median: float) -> float:
        """Median of ``|x - median|`` over the sorted window: the distances below the median (read downwards)
        and above it (read upwards) are two ascending runs, merged up to the middle."""
        xs = self._sorted
        n = len(xs)
        lo, hi = bisect.bisect_left(xs, median) - 1, bisect.bisect_left(xs, median)
        merged: list[float] = []
        while len(merged) <= n // 2:
            below = median - xs[lo] if lo >= 0 else math.inf
            above = xs[hi] - median if hi < n else math.inf
            if below <= above:
                merged.append(below)
                lo -= 1
            else:
                merged.append(above)
                hi += 1
        return merged[n // 2] if n % 2 else (merged[n // 2 - 1] + merged[n // 2]) / 2

    def judging(self, step: int) -> bool:
        """Whether a loss of ``step`` is judged at all (on, past the warm-up, enough history)."""
        return self.threshold > 0 and step > self.after_steps and len(self.losses) >= self.window // 2

    def limit(self) -> float:
        """The loss above which a step is a spike now: the larger of the relative and the deviation bound."""
        median = self.median()
        deviation = max(1.4826 * self._deviation(median), 0.01 * abs(median), 1e-12)
        return max(median + self.threshold * deviation, median + self.jump * abs(median))

    def _append(self, loss: float) -> None:
        if len(self.losses) == self.window:
            del self._sorted[bisect.bisect_left(self._sorted, self.losses[0])]
        self.losses.append(loss)
        bisect.insort(self._sorted, loss)

    def observe(self, loss: float, grad_norm: float, step: int) -> str | None:
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return "nonfinite"
        if self.judging(step) and loss > self.limit():
            return "spike"
        self._append(loss)
        return None

    def state_dict(self) -> dict[str, list[float]]:
        return {"losses": list(self.losses)}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        self.losses = deque(maxlen=self.window)
        self._sorted = []
        for x in state.get("losses", []):
            self._append(float(x))
