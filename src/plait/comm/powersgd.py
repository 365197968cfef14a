"""PowerSGD (Vogels et al. 2019): a bucket as a matrix, approximated by a rank-r product whose two factors are
all-reduced; Q is warm-started from the previous step, per bucket (``plait.comm.compress`` has the contract
every compressor follows)."""

from __future__ import annotations

import math

import torch

from plait.comm.compress import Compressor


class PowerSGDCompressor(Compressor):
    """PowerSGD: a rank-r approximation ``P Q^T`` of each gradient matrix, warm-started.

    With ``shapes`` (the bucket's parameters), every tensor of two or more dims is a matrix M of
    ``shape[0]`` rows and ``prod(shape[1:])`` columns, approximated on its own: weight gradients
    are sums of a few outer products, so they are close to low rank. Tensors of one dim, and
    matrices whose factors would not be smaller than they are, travel uncompressed in fp32 inside
    the first all-reduce. Without ``shapes`` the whole bucket is one matrix, zero-padded to
    ``rows = ceil(sqrt N)`` by ``cols = ceil(N / rows)``: that loses the gradients' structure and
    approximates them much worse, so the reducers pass their buckets' shapes.
    Per step and matrix: ``P = M Q``; all-reduce P; orthonormalize P (reduced QR); ``Q = M^T P``;
    all-reduce Q; the mean is ``P Q^T``, and Q is kept for the next step's warm start. Q starts
    from a generator seeded identically on all ranks. This rank's decompressed contribution (for
    error feedback) is ``P (M^T P)^T``, its projection on the shared basis.
    Round-trip error bound, per matrix: ``||M - P P^T M||_F <= ||M||_F`` always; zero (to fp32
    rounding) when M has rank <= r; with the warm start, repeated steps on a fixed M approach the
    best rank-r error ``sqrt(sum_{i>r} sigma_i^2)``. Uncompressed tensors are exact.
    Communication (forward): two all-reduces per bucket (all P factors with the uncompressed
    tensors, then all Q factors), ``4 r (rows + cols)`` bytes per matrix.
    """

    name = "powersgd"
    returns_residual = True

    def __init__(self, rank: int, **kw):
        super().__init__(**kw)
        self.rank = rank
        # (bucket key, matrix index) -> Q^T, (r, cols) contiguous. Every product below is written as
        # (row-major small factor) @ M or @ M^T and transposed afterwards: on CPU, ``M^T @ P`` with a
        # skinny P runs 5-10x slower than ``(P^T @ M)^T`` (the BLAS copies the transposed M first).
        self._qt: dict[tuple[int, int], torch.Tensor] = {}

    @staticmethod
    def shape(numel: int) -> tuple[int, int]:
        rows = math.isqrt(numel - 1) + 1 if numel > 1 else 1
        return rows, -(-numel // rows)

    def _plan(self, numel: int, shapes) -> tuple[list[tuple[int, int, int, int]], list[tuple[int, int]]]:
        """([(offset, numel, rows, cols) per compressed matrix], [(offset, numel) per exact tensor])."""
        if shapes is None:
            return [(0, numel, *self.shape(numel))], []
        mats, exact, off = [], [], 0
        for s in shapes:
            size = math.prod(s)
            rows = s[0] if len(s) >= 2 else 1
            cols = size // rows if rows else 0
            r = min(self.rank, rows, cols)
            if len(s) >= 2 and r * (rows + cols) < size:
                mats.append((off, size, rows, cols))
            elif size:
                exact.append((off, size))
            off += size
        return mats, exact

    def _exchange(self, key, x, group, n, shapes=None):
        mats, exact = self._plan(x.numel(), shapes)
        ms, pts = [], []
        for j, (off, size, rows, cols) in enumerate(mats):
            m = x[off: off + size]
            m = (m if rows * cols == size else torch.nn.functional.pad(m, (0, rows * cols - size))).view(rows, cols)
            r = min(self.rank, rows, cols)
            qt = self._qt.get((key, j))
            if qt is None or qt.shape != (r, cols):
                qt = torch.randn(cols, r, generator=self._shared_rng).t().contiguous()
            ms.append(m)
            pts.append(torch.mm(qt, m.t()))  # P^T = (M Q)^T, (r, rows)
        # One all-reduce carries every P and the tensors sent exactly.
        first = torch.cat([p.view(-1) for p in pts] + [x[o: o + k] for o, k in exact])
        self._all_reduce(first, group, n)
        first /= n
        parts = first.split([p.numel() for p in pts] + [k for _, k in exact])
        ps = [torch.linalg.qr(p.view_as(p0).t(), mode="reduced").Q for p, p0 in zip(parts, pts, strict=False)]
        qt_local = [torch.mm(p.t(), m) for m, p in zip(ms, ps, strict=True)]  # Q^T = (M^T P)^T, (r, cols)
        qt_mean = torch.cat([q.view(-1) for q in qt_local]) if qt_local else x.new_zeros(0)
        if qt_local:  # every rank has the same shapes, so all skip it together
            self._all_reduce(qt_mean, group, n)
            qt_mean /= n
        # Written segment by segment, without temporaries of the bucket's size: for error feedback
        # this returns the residual x - P (M^T P)^T directly (``returns_residual``).
        mean, residual = torch.empty_like(x), torch.empty_like(x)
        for (o, k), part in zip(exact, parts[len(ps):], strict=True):
            mean[o: o + k] = part
            residual[o: o + k] = 0.0  # sent exactly
        for j, ((off, size, rows, cols), m, p, ql, qm) in enumerate(
                zip(mats, ms, ps, qt_local, qt_mean.split([q.numel() for q in qt_local]), strict=True)):
            qm = qm.view_as(ql)
            self._qt[(key, j)] = qm
            if rows * cols == size:
                torch.mm(p, qm, out=mean[off: off + size].view(rows, cols))
                torch.addmm(m, p, ql, alpha=-1, out=residual[off: off + size].view(rows, cols))
            else:  # the flat bucket's padded matrix
                mean[off: off + size] = (p @ qm).view(-1)[:size]
                residual[off: off + size] = (m - p @ ql).view(-1)[:size]
        return mean, residual

    def _extra_state(self):
        # Saved as Q, (cols, r), the layout of the docstring.
        return {f"q.{k}.{j}": qt.t().contiguous() for (k, j), qt in self._qt.items()}

    def _load_extra_state(self, sd):
        self._qt = {}
        for name, v in sd.items():
            if name.startswith("q."):
                key, _, j = name[2:].partition(".")
                self._qt[(int(key), int(j or 0))] = v.t().contiguous()
