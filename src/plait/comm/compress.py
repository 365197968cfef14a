"""Gradient compressors for data-parallel buckets, with per-bucket error feedback.

One interface, ``Compressor.allreduce_mean(key, flat, group)``: every rank of ``group`` passes its
1-D fp32 bucket ``flat`` (same length on all ranks, buckets in the same order) and gets back the
(approximate) average over the group as a new tensor, identical on every rank. ``key`` names the
bucket (its index) so state that must persist between steps (error-feedback residuals, PowerSGD's
warm-started Q) is kept per bucket.

Error feedback (``error_feedback=True``): each rank adds its residual to the bucket before
compressing, and keeps ``residual = (flat + old residual) - local_hat``, where ``local_hat`` is what
its own contribution looks like after compression. The sum over steps of what was sent therefore
equals the sum of the true gradients minus the current residual, which stays bounded: nothing is
lost, only delayed.

Bytes on the wire (``wire_bytes``, cumulative per rank) follow the ring model of each collective:
an all-reduce of ``b`` bytes puts ``2 (n-1)/n * b`` on the wire, an all-gather of ``b`` bytes per
rank puts ``(n-1) * b``.

Without an initialized process group (or with a group of one) every compressor behaves as a world
of one: no communication, and the result is the round trip of the rank's own bucket.

``state_dict()`` holds only tensors and ints, per rank (residuals and the stochastic-rounding RNG
differ between ranks), so a resumed run continues exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

COMPRESSORS = ("none", "fp16", "bf16", "int8", "int4", "topk", "randomk", "powersgd")


class CompressConfigError(ValueError):
    """A compressor was asked for with a name or setting it cannot use, or given a bad bucket."""


def _world(group: dist.ProcessGroup | None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _check_shapes(shapes: Sequence[Sequence[int]] | None, numel: int) -> None:
    if shapes is not None and sum(math.prod(s) for s in shapes) != numel:
        raise CompressConfigError(
            f"the bucket's tensor shapes hold {sum(math.prod(s) for s in shapes)} elements but the bucket "
            f"has {numel}: pass the shapes of exactly the tensors packed in it, in order"
        )


def _topk_indices(a: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries of ``a`` (1-D, non-negative): exact, like ``a.topk(k)``.

    ``torch.topk`` over a whole bucket is slow on CPU (~0.3 s for 12.7M entries at k = 1%). A strided
    sample gives a threshold ``t`` a little below the k-th largest value; the entries ``>= t`` are the
    candidates, and when there are at least ``k`` of them they hold every entry of the top k (each is
    ``>=`` the k-th largest value ``>= t``), so ``topk`` runs on the candidates only. If the sample
    misjudged and fewer than ``k`` are candidates, the full ``topk`` runs instead.
    """
    n = a.numel()
    if n < 1 << 16 or 4 * k > n:
        return a.topk(k, sorted=False).indices
    stride = n // (1 << 14)
    sample = a[::stride]
    # Expected count of sampled entries above the k-th largest value, doubled, plus slack.
    j = min(sample.numel(), 2 * math.ceil(k * sample.numel() / n) + 32)
    t = sample.topk(j, sorted=False).values.min()
    cand = (a >= t).nonzero().squeeze(1)
    if cand.numel() < k:
        return a.topk(k, sorted=False).indices
    return cand[a[cand].topk(k, sorted=False).indices]


def _random_subset(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """``k`` distinct indices of ``range(n)``, uniformly random, sorted; the same on every rank whose
    ``gen`` is in the same state.

    ``randperm(n)`` costs O(n) (~0.4 s for n = 12.7M); for ``k << n`` this draws a little more than ``k``
    indices with replacement, drops duplicates, and keeps a random ``k`` of the distinct ones, which is a
    uniform k-subset again (the distinct set's distribution does not favour any index).
    """
    if 8 * k > n:
        return torch.randperm(n, generator=gen)[:k].sort().values
    m = k + 2 * (k * k // n) + 64  # expected duplicates ~ m^2 / 2n
    while True:
        distinct = torch.randint(n, (m,), generator=gen).unique()
        if distinct.numel() >= k:
            break
        m *= 2
    return distinct[torch.randperm(distinct.numel(), generator=gen)[:k]].sort().values


class Compressor:
    """No compression: an fp32 all-reduce of the bucket, divided by the group size (exact mean).

    Round-trip error bound: zero. Mean error: fp32 summation rounding only.
    Communication (forward): one all-reduce of the bucket. Backward: none.
    """

    name = "none"
    # True where ``_exchange`` returns this rank's compression error ``x - local_hat`` instead of
    # ``local_hat`` (cheaper for compressors that can compute it without a bucket-sized temporary).
    returns_residual = False

    def __init__(self, *, error_feedback: bool = False, seed: int = 0,
                 allreduce: Callable[[torch.Tensor, dist.ProcessGroup | None], None] | None = None):
        self.error_feedback = error_feedback
        # The all-reduce (SUM, in place) for fp32 payloads: the backend's unless one of
        # plait.comm.algorithms is chosen; half-precision casts always use the backend, because
        # those algorithms carry half types in fp32 and would undo the compression.
        self._allreduce = allreduce
        self.wire_bytes = 0
        self.seed = seed
        self._residuals: dict[int, torch.Tensor] = {}
        self._shared_rng = torch.Generator().manual_seed(seed)  # same stream on every rank
        self._local_rng: torch.Generator | None = None  # differs per rank; seeded on first use

    # -- the interface ---------------------------------------------------------------------------
    def allreduce_mean(self, key: int, flat: torch.Tensor, group: dist.ProcessGroup | None = None,
                       shapes: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """Average of every rank's ``flat`` (1-D fp32) over ``group``, through this compressor.

        Blocking; every rank of ``group`` must call it with the same ``key`` sequence and bucket
        lengths. ``shapes`` are the shapes of the tensors packed one after another in ``flat`` (the
        parameters of a gradient bucket); PowerSGD approximates each matrix among them on its own,
        the other compressors ignore it. Returns a new tensor, identical on every rank; ``flat`` is
        not modified.
        """
        if flat.dim() != 1 or flat.dtype != torch.float32:
            raise CompressConfigError(
                f"compressors take a flat 1-D fp32 bucket; got shape {tuple(flat.shape)} dtype "
                f"{flat.dtype}: flatten the bucket and cast it with .float() first"
            )
        if flat.numel() == 0:
            return flat.clone()
        _check_shapes(shapes, flat.numel())
        x = flat + self._residuals[key] if self.error_feedback and key in self._residuals else flat
        mean, hat = self._exchange(key, x, group, _world(group), shapes)
        if self.error_feedback:
            self._residuals[key] = hat if self.returns_residual else x - hat
        return mean

    def roundtrip(self, key: int, flat: torch.Tensor,
                  shapes: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """This rank's bucket after compression and decompression, with no communication.

        Uses and advances the same per-key state as ``allreduce_mean`` (PowerSGD's Q, RNGs) but
        not the error-feedback residual; this is what the docstring bounds refer to.
        """
        if flat.numel() == 0:
            return flat.clone()
        _check_shapes(shapes, flat.numel())
        hat = self._exchange(key, flat, None, 1, shapes)[1]
        return flat - hat if self.returns_residual else hat

    def residual(self, key: int) -> torch.Tensor | None:
        """The error-feedback residual of bucket ``key`` (None before its first step)."""
        return self._residuals.get(key)

    def state_dict(self) -> dict[str, torch.Tensor | int]:
        """Per-rank state: residuals, PowerSGD Q matrices, RNG states and the byte counter."""
        sd: dict[str, torch.Tensor | int] = {"wire_bytes": self.wire_bytes, "seed": self.seed}
        for k, r in self._residuals.items():
            sd[f"residual.{k}"] = r.clone()
        sd["rng.shared"] = self._shared_rng.get_state()
        if self._local_rng is not None:
            sd["rng.local"] = self._local_rng.get_state()
        sd.update(self._extra_state())
        return sd

    def load_state_dict(self, sd: dict[str, torch.Tensor | int]) -> None:
        """Restore what ``state_dict`` returned (from the same rank of the same configuration)."""
        if int(sd["seed"]) != self.seed:
            raise CompressConfigError(
                f"compressor state was saved with seed {sd['seed']} but this run uses seed "
                f"{self.seed}; resume with the original comm seed"
            )
        self.wire_bytes = int(sd["wire_bytes"])
        self._residuals = {int(k.split(".", 1)[1]): v.clone() for k, v in sd.items()
                           if k.startswith("residual.")}
        self._shared_rng.set_state(sd["rng.shared"])
        if "rng.local" in sd:
            self._local_rng = torch.Generator()
            self._local_rng.set_state(sd["rng.local"])
        self._load_extra_state(sd)

    # -- for subclasses --------------------------------------------------------------------------
    def _exchange(self, key: int, x: torch.Tensor, group: dist.ProcessGroup | None, n: int,
                  shapes: Sequence[Sequence[int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean over the group, this rank's decompressed contribution) for bucket ``x``; the
        contribution's error ``x - contribution`` instead where ``returns_residual``."""
        total = x.clone()
        self._all_reduce(total, group, n)
        return total / n, x

    def _extra_state(self) -> dict[str, torch.Tensor | int]:
        return {}

    def _load_extra_state(self, sd: dict[str, torch.Tensor | int]) -> None:
        return None

    def _all_reduce(self, t: torch.Tensor, group: dist.ProcessGroup | None, n: int) -> None:
        if n > 1:
            if self._allreduce is None or t.dtype != torch.float32:
                dist.all_reduce(t, group=group)
            else:
                self._allreduce(t, group)
            self.wire_bytes += 2 * (n - 1) * t.numel() * t.element_size() // n

    def _all_gather(self, t: torch.Tensor, group: dist.ProcessGroup | None, n: int) -> list[torch.Tensor]:
        if n == 1:
            return [t]
        out = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(out, t, group=group)
        self.wire_bytes += (n - 1) * t.numel() * t.element_size()
        return out

    def _rank_rng(self) -> torch.Generator:
        if self._local_rng is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            self._local_rng = torch.Generator().manual_seed(self.seed + 1_000_003 * (rank + 1))
        return self._local_rng


class CastCompressor(Compressor):
    """fp16 or bf16: divide by n, cast, all-reduce (summed in that dtype by the backend), cast back.

    Round-trip error bound, per element: ``|x - x_hat| <= u |x|`` with ``u = 2**-11`` (fp16) or
    ``2**-8`` (bf16), plus ``2**-25`` absolute for fp16 values below its normal range (6.1e-5).
    Mean error: ``<= n u max_i |x_i|`` (rounding of each term and of each of the n-1 partial sums),
    plus ``n 2**-25`` for fp16. fp16 overflows to inf beyond ``65504`` per ``x/n``: use bf16 for
    gradients of unbounded range. Communication (forward): one all-reduce of half the bytes.
    """

    def __init__(self, dtype: torch.dtype, **kw):
        super().__init__(**kw)
        self.dtype = dtype
        self.name = "fp16" if dtype == torch.float16 else "bf16"

    def _exchange(self, key, x, group, n, shapes=None):
        y = (x / n).to(self.dtype)
        local_hat = y.float() * n
        self._all_reduce(y, group, n)
        return y.float(), local_hat


class QuantCompressor(Compressor):
    """int8 or int4 with one fp32 scale per block of ``block`` elements, exchanged by all-gather.

    ``scale = max|x| / L`` per block (``L = 127`` for int8, ``7`` for int4; int4 packs two values
    per byte). Payloads are all-gathered, not summed, because a sum of n int8 values overflows
    int8; each rank then decodes every payload and averages in fp32 (same order on every rank).
    Round-trip error bound, per element: ``<= scale / 2`` with round-to-nearest, ``< scale`` with
    stochastic rounding (which is unbiased). Mean error: ``<=`` the largest of the ranks' bounds.
    Communication (forward): one all-gather of ``bits/8`` bytes per element plus 4 bytes per block.
    Blocks are small (128 by default: 3% more bytes for int8, 6% for int4) because a bucket packs
    tensors whose gradients differ by orders of magnitude: with 1024-element blocks a tensor of
    small gradients that shares a block with a large one quantizes to zero, moves only when error
    feedback releases a whole quantization step, and training ended 21% (int8) above fp32 in
    tests/comm/test_training.py's setup instead of within 0.5%.
    """

    def __init__(self, bits: int, *, block: int = 128, stochastic_rounding: bool = False, **kw):
        super().__init__(**kw)
        if bits not in (4, 8):
            raise CompressConfigError(f"quantization supports 8 or 4 bits, not {bits}")
        if block < 2 or block % 2:
            raise CompressConfigError(f"quantization block must be an even number >= 2, not {block}")
        self.bits, self.block, self.stochastic = bits, block, stochastic_rounding
        self.levels = 127 if bits == 8 else 7
        self.name = f"int{bits}"

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload, scales) for bucket ``x``: int8 values, or uint8 with two int4 values per byte."""
        # In-place steps on one bucket-sized temporary: on a CPU rank this work competes with backward.
        pad = -x.numel() % self.block
        blocks = (torch.nn.functional.pad(x, (0, pad)) if pad else x).view(-1, self.block)  # (num_blocks, block)
        scales = blocks.abs().amax(dim=1) / self.levels  # (num_blocks,)
        q = blocks / torch.where(scales > 0, scales, 1.0)[:, None]
        if self.stochastic:
            q.add_(torch.rand(q.shape, generator=self._rank_rng())).floor_()
        else:
            q.round_()
        q = q.clamp_(-self.levels, self.levels).view(-1)
        if self.bits == 8:
            return q.to(torch.int8), scales
        nib = q.add_(8).to(torch.uint8)  # 1..15
        return nib[0::2] | (nib[1::2] << 4), scales

    def decode(self, payload: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
        """Inverse of ``encode`` (up to the rounding), trimmed to ``numel`` elements."""
        if self.bits == 8:
            q = payload.float()
        else:  # unpacked and re-centred on bytes, which is cheaper than on floats
            lo, hi = (payload & 0xF).view(torch.int8) - 8, (payload >> 4).view(torch.int8) - 8
            q = torch.stack([lo, hi], dim=1).view(-1).float()
        return q.view(-1, self.block).mul_(scales[:, None]).view(-1)[:numel]

    def _exchange(self, key, x, group, n, shapes=None):
        payload, scales = self.encode(x)
        local_hat = self.decode(payload, scales, x.numel())
        payloads, all_scales = self._all_gather(payload, group, n), self._all_gather(scales, group, n)
        me = dist.get_rank(group) if n > 1 else 0
        total = torch.zeros_like(x)
        for i, (p, s) in enumerate(zip(payloads, all_scales, strict=True)):  # rank order on every rank
            total += local_hat if i == me else self.decode(p, s, x.numel())
        return total.div_(n), local_hat


class TopKCompressor(Compressor):
    """Top-k: each rank keeps its ``k = ceil(ratio N)`` largest-magnitude entries.

    (index, value) pairs (int32 + fp32) are all-gathered; every rank scatters them into a dense
    buffer and divides by n. Round-trip error bound: every dropped entry is no larger in magnitude
    than the smallest kept one, and ``||x - x_hat||^2 <= (1 - k/N) ||x||^2``. The mean is the exact
    mean of the ranks' sparsified buckets. Communication (forward): one all-gather of 8k bytes.
    """

    name = "topk"
    returns_residual = True

    def __init__(self, ratio: float, **kw):
        super().__init__(**kw)
        self.ratio = ratio

    def _exchange(self, key, x, group, n, shapes=None):
        k = min(x.numel(), max(1, math.ceil(self.ratio * x.numel())))
        idx = _topk_indices(x.abs(), k)
        vals = x[idx]
        all_idx = self._all_gather(idx.to(torch.int32), group, n)
        all_vals = self._all_gather(vals, group, n)
        total = torch.zeros_like(x)
        for i, v in zip(all_idx, all_vals, strict=True):
            total.index_add_(0, i.long(), v)
        return total.div_(n), x.index_fill(0, idx, 0.0)  # the residual: x without its kept entries


class RandomKCompressor(Compressor):
    """Random-k: every rank keeps the same ``k = ceil(ratio N)`` random entries.

    The indices come from a generator seeded identically on all ranks (advanced once per call, in
    the same order everywhere), so only the values travel, in one all-reduce; this halves the
    bytes of an (index, value) all-gather and does not grow with n. Values are not rescaled by
    N/k: the estimate is biased towards zero, which error feedback corrects over steps.
    Round-trip error bound: exact on the kept entries, zero elsewhere, so ``||x - x_hat|| <= ||x||``
    and ``E||x - x_hat||^2 = (1 - k/N) ||x||^2``. Communication (forward): an all-reduce of 4k bytes.
    """

    name = "randomk"
    returns_residual = True

    def __init__(self, ratio: float, **kw):
        super().__init__(**kw)
        self.ratio = ratio

    def _exchange(self, key, x, group, n, shapes=None):
        k = min(x.numel(), max(1, math.ceil(self.ratio * x.numel())))
        idx = _random_subset(x.numel(), k, self._shared_rng)
        vals = x[idx]
        residual = x.index_fill(0, idx, 0.0)  # x without its kept entries
        self._all_reduce(vals, group, n)
        return torch.zeros_like(x).index_put_((idx,), vals.div_(n)), residual
