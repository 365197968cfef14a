"""Time of one operator on a hardware profile.

GPU profiles (datasheet peaks and efficiency constants): a roofline per operator,
``max(flops / (peak x matmul_efficiency), bytes / (bandwidth x memory_efficiency)) + kernel_overhead_s``
for matmuls, ``flops / (peak x attention_efficiency)`` for fused attention, and
``bytes / (bandwidth x memory_efficiency)`` for memory-bound kernels. A matmul with its own ``dtype`` (a float8
Linear's ``fp8``) takes that dtype's peak.

Calibrated (cpu) profiles use the measured tables instead: a matmul's rate is interpolated in
``(log m, log n, log k)`` from the grid ``plait calibrate`` timed (inverse-distance weights over the
nearest points, coordinates clamped to the grid), a memory-bound kernel's from its kind's rates at the
measured sizes (linear in ``log bytes``), attention from the nearest measured ``(sequence, head dim)``
scaled by FLOPs. Measured times include the dispatcher's per-operator cost; backward operators add
the measured autograd cost per node. ``threads`` is a rank's thread count; ``oversubscription`` (ranks
x threads / cores when above 1) stretches every compute time, since the ranks share the cores.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from plait.plan.hardware import Calibration, HardwareProfile
from plait.plan.ops import MEMORY_KINDS, Op


def _nearest(values: Iterable[int], want: int) -> int:
    vals = sorted(set(values))
    below = [v for v in vals if v <= want]
    return below[-1] if below else vals[0]


def _matmul_points(cal: Calibration, dtype: str, threads: int) -> tuple[tuple[float, float, float, float], ...]:
    rows = [r for r in cal.matmul if r[0] == dtype] or [r for r in cal.matmul if r[0] == "fp32"]
    t = _nearest((r[1] for r in rows), threads)
    return tuple((math.log2(m), math.log2(n), math.log2(k), math.log(2.0 * m * n * k / s))
                 for _, th, m, n, k, s in rows if th == t)


def _kernel_points(cal: Calibration, kind: str, threads: int) -> tuple[tuple[float, float], ...]:
    rows = [r for r in cal.kernels if r[0] == kind] or [r for r in cal.kernels if r[0] == "copy"]
    t = _nearest((r[1] for r in rows), threads)
    return tuple(sorted((math.log(b), math.log(b / s)) for _, th, b, s in rows if th == t))


def _interp_1d(points: tuple[tuple[float, float], ...], x: float) -> float:
    if x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0 or 1.0)
    return points[-1][1]


class ComputeModel:
    """Prices ``Op``s on one profile for one rank: ``dtype`` of the matmuls (fp32, bf16, fp16), the rank's
    ``threads`` (cpu profiles) and the ``oversubscription`` of the cores (see the module docstring)."""

    def __init__(self, profile: HardwareProfile, dtype: str, threads: int = 1, oversubscription: float = 1.0) -> None:
        self.p, self.dtype = profile, dtype
        self.threads = max(1, threads)
        self.stretch = max(1.0, oversubscription)
        self.cal = profile.calibration
        self._cache: dict[tuple, object] = {}

    def _points(self, what: str, key: str) -> tuple:
        if (what, key) not in self._cache:
            fn = _matmul_points if what == "matmul" else _kernel_points
            self._cache[(what, key)] = fn(self.cal, key, self.threads)
        return self._cache[(what, key)]

    # -- gpu ----------------------------------------------------------------------------------------
    def _gpu(self, op: Op) -> float:
        p = self.p
        mem = op.bytes / (p.memory_bandwidth * p.memory_efficiency)
        if op.kind == "matmul":  # a float8 Linear's at the fp8 peak (plait.plan.ops_float8)
            return max(op.flops / (p.peak(op.dtype or self.dtype) * p.matmul_efficiency), mem) + p.kernel_overhead_s
        if op.kind == "attention":
            return op.flops / (p.peak(self.dtype) * p.attention_efficiency) + p.kernel_overhead_s
        return mem + p.kernel_overhead_s

    # -- calibrated cpu ------------------------------------------------------------------------------
    def _matmul_rate(self, m: int, n: int, k: int) -> float:
        pts = self._points("matmul", self.dtype)
        lo = [min(pt[i] for pt in pts) for i in range(3)]
        hi = [max(pt[i] for pt in pts) for i in range(3)]
        q = [min(max(math.log2(max(v, 1)), lo[i]), hi[i]) for i, v in enumerate((m, n, k))]
        near = sorted(pts, key=lambda pt: sum((pt[i] - q[i]) ** 2 for i in range(3)))[:8]
        weights = [1.0 / (sum((pt[i] - q[i]) ** 2 for i in range(3)) + 1e-6) for pt in near]
        return math.exp(sum(w * pt[3] for w, pt in zip(weights, near, strict=True)) / sum(weights))

    def _attention(self, op: Op) -> float:
        bh, t, d = op.attn
        rows = self.cal.attention
        th = _nearest((r[0] for r in rows), self.threads)
        rows = [r for r in rows if r[0] == th]

        def distance(r: tuple) -> float:
            return math.log(r[2] / t) ** 2 + math.log(r[3] / d) ** 2 + 0.1 * math.log(r[1] / bh) ** 2

        best = min(rows, key=distance)
        measured = best[5] if op.backward else best[4]
        return measured * (bh / best[1]) * (t / best[2]) ** 2 * (d / best[3])

    def _cpu(self, op: Op) -> float:
        cal = self.cal
        if op.kind == "matmul":
            t = op.flops / self._matmul_rate(op.m, op.n, op.k)
        elif op.kind == "attention":
            t = self._attention(op)
        else:
            kind = op.kind if op.kind in MEMORY_KINDS else "copy"
            t = op.bytes / math.exp(_interp_1d(self._points("kernel", kind), math.log(max(op.bytes, 1.0))))
        if op.backward:
            t += cal.overhead["autograd"][_nearest(cal.overhead["autograd"], self.threads)]
        return t

    def time(self, op: Op) -> float:
        """Seconds of one compute operator on this rank (collectives are priced by ``plait.plan.network``)."""
        if op.kind == "comm":
            return 0.0
        return (self._cpu(op) if self.cal is not None else self._gpu(op)) * self.stretch

    def overhead(self, kind: str) -> float:
        """Seconds per event of a calibrated CPU: ``op`` (the dispatcher), ``dtensor`` (what DTensor adds to an
        operator), ``fsdp_unit`` (FSDP2's host work per unit collective) or ``pipeline_action`` (per schedule
        action); 0 on a GPU, whose host work runs ahead of the device (no public per-event figure is used)."""
        if self.cal is None:
            return 0.0
        table = self.cal.overhead.get(kind) or {1: 0.0}
        return table[_nearest(table, self.threads)] * self.stretch

    def total(self, ops: Iterable[Op]) -> float:
        """Seconds of the compute operators in ``ops``, run one after another."""
        return sum(self.time(op) for op in ops)

    @property
    def peak_flops(self) -> float:
        """This rank's peak matmul FLOP/s: the datasheet's for a GPU; the best measured matmul rate at the
        rank's threads for a calibrated CPU (its MFU is relative to what this machine's matmul reaches)."""
        if self.cal is None:
            return self.p.peak(self.dtype)
        return max(math.exp(pt[3]) for pt in self._points("matmul", self.dtype))
