"""Timing a small piece of work on a shared machine."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def timed(fn: Callable[[], Any], min_time: float, repeats: int = 5) -> float:
    """Seconds of one ``fn()``: the fastest of ``repeats`` samples, each enough calls to last ``min_time``
    (after a warm-up). The fastest, not the median: other processes on a shared machine only ever slow a
    sample down, so the minimum is the least disturbed estimate of what this machine does."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    calls = max(1, int(min_time / once))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return min(samples)
