"""Loss-spike and non-finite detection on the values every rank agrees on.

The detector sees, after every optimizer step, the loss averaged over the data-parallel replicas
(``StepInfo.global_loss``) and the global gradient norm: the same two numbers on every rank, so every
rank reaches the same verdict without communicating. The loss is a spike when it exceeds the running
median of the last ``window`` accepted losses by more than ``threshold`` running deviations, the
deviation being 1.4826 x the median absolute deviation (a robust standard deviation: a spike in the
window does not inflate it), floored at 1% of the median so a flat curve does not make noise a spike.
The detector judges only once it holds ``window // 2`` values. The gradient norm is not judged against
its history: it drifts upward through healthy training, so a running-median rule flags it falsely; a
non-finite loss or norm is reported as such (the engine has already skipped that update). A spike is
not added to the history.
"""

from __future__ import annotations

import math
import statistics
from collections import deque


class SpikeDetector:
    """See the module docstring; ``observe`` returns ``None``, ``"spike"`` or ``"nonfinite"``."""

    def __init__(self, threshold: float, window: int) -> None:
        self.threshold, self.window = threshold, max(4, window)
        self.losses: deque[float] = deque(maxlen=self.window)

    def _outlier(self, history: deque[float], value: float) -> bool:
        if self.threshold <= 0 or len(history) < self.window // 2:
            return False
        median = statistics.median(history)
        deviation = 1.4826 * statistics.median(abs(x - median) for x in history)
        return value > median + self.threshold * max(deviation, 0.01 * abs(median), 1e-12)

    def observe(self, loss: float, grad_norm: float) -> str | None:
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return "nonfinite"
        if self._outlier(self.losses, loss):
            return "spike"
        self.losses.append(loss)
        return None

    def state_dict(self) -> dict[str, list[float]]:
        return {"losses": list(self.losses)}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        self.losses = deque((float(x) for x in state.get("losses", [])), maxlen=self.window)
