"""Gradient compressors: round-trip bounds, multi-rank means, error feedback and exact resume.

The bounds asserted are the ones each compressor states in its docstring (plait/comm/compress.py);
a small relative slack (1e-6) covers fp32 rounding in the bound arithmetic itself.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.distributed as dist
from helpers import run_ranks

from plait.comm import compress
from plait.comm.algorithms import ring_all_reduce
from plait.comm.compress import COMPRESSORS, CompressConfigError
from plait.comm.compressors import build_compressor
from plait.comm.powersgd import PowerSGDCompressor

N = 5000  # not a multiple of the quantization block (128) nor a square


def _bucket(seed: int, numel: int = N) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Entries spanning several orders of magnitude, as gradients do.
    return torch.randn(numel, generator=g) * torch.exp(2 * torch.randn(numel, generator=g))


def _block_scales(x: torch.Tensor, levels: int, block: int = 128) -> torch.Tensor:
    """Per-element quantization step ``max|block| / levels``."""
    pad = -x.numel() % block
    blocks = torch.nn.functional.pad(x, (0, pad)).view(-1, block)
    return (blocks.abs().amax(1, keepdim=True) / levels).expand(-1, block).reshape(-1)[: x.numel()]


def test_cast_roundtrip_within_bound() -> None:
    x = _bucket(0)
    for name, u, tiny in (("fp16", 2**-11, 2**-25), ("bf16", 2**-8, 0.0)):
        err = (build_compressor(name).roundtrip(0, x) - x).abs()
        assert (err <= u * x.abs() * (1 + 1e-6) + tiny).all(), name


@pytest.mark.parametrize("name,levels", [("int8", 127), ("int4", 7)])
def test_quant_roundtrip_within_bound(name: str, levels: int) -> None:
    x = _bucket(1)
    step = _block_scales(x, levels)
    nearest = build_compressor(name).roundtrip(0, x)
    assert ((nearest - x).abs() <= step / 2 * (1 + 1e-6)).all()
    comp = build_compressor(name, stochastic_rounding=True, seed=3)
    outs = torch.stack([comp.roundtrip(0, x) for _ in range(400)])
    assert ((outs - x).abs() < step * (1 + 1e-6)).all()
    # Unbiased: the average of 400 draws is within 4 standard errors (step / 2 / sqrt(400)) of x.
    assert ((outs.mean(0) - x).abs() <= 4 * step / 2 / 20 + 1e-7).all()


def test_int4_packs_two_values_per_byte() -> None:
    comp = build_compressor("int4")
    payload, scales = comp.encode(_bucket(2))
    assert payload.dtype == torch.uint8 and payload.numel() == 40 * 128 // 2 and scales.numel() == 40


def test_topk_and_randomk_roundtrip_within_bound() -> None:
    x = _bucket(3)
    k = math.ceil(0.05 * N)
    top = build_compressor("topk", ratio=0.05).roundtrip(0, x)
    kept = top != 0
    assert kept.sum() == k
    assert x[~kept].abs().max() <= x[kept].abs().min()
    assert (top - x).norm() ** 2 <= (1 - k / N) * x.norm() ** 2
    rnd = build_compressor("randomk", ratio=0.05).roundtrip(0, x)
    kept = rnd != 0
    assert kept.sum() == k and torch.equal(rnd[kept], x[kept])
    assert (rnd - x).norm() <= x.norm()


def test_powersgd_roundtrip_within_bound() -> None:
    rows, cols = PowerSGDCompressor.shape(N)
    assert rows * cols >= N and rows == 71 and cols == 71
    g = torch.Generator().manual_seed(4)
    low = (torch.randn(rows, 3, generator=g) @ torch.randn(3, cols, generator=g)).view(-1)[:N]
    comp = build_compressor("powersgd", powersgd_rank=4)
    # A rank-3 bucket (its padding only drops entries) is reproduced to fp32 rounding.
    low_m = torch.nn.functional.pad(low, (0, rows * cols - N)).view(rows, cols)
    assert torch.linalg.matrix_rank(low_m) <= 4
    assert (comp.roundtrip(0, low) - low).norm() <= 1e-5 * low.norm()
    # A full-rank bucket: never worse than ||M||, and warm starts approach the best rank-4 error.
    x = torch.randn(N, generator=g) + low
    m = torch.nn.functional.pad(x, (0, rows * cols - N)).view(rows, cols)
    best = torch.linalg.svdvals(m)[4:].norm()
    errs = [(comp.roundtrip(1, x) - x).norm() for _ in range(30)]
    assert all(e <= x.norm() for e in errs)
    assert errs[-1] <= 1.05 * best and errs[-1] < errs[0]


def test_powersgd_compresses_each_matrix_of_a_bucket() -> None:
    """With the bucket's shapes, low-rank weight gradients are reproduced and 1-D tensors sent exactly;
    the same bucket as one padded matrix loses most of it (the reshape breaks each matrix's rank)."""
    g = torch.Generator().manual_seed(6)
    shapes = [(48, 40), (40,), (40, 3, 8), (7,)]
    parts = [(torch.randn(48, 2, generator=g) @ torch.randn(2, 40, generator=g)).view(-1),
             torch.randn(40, generator=g),
             (torch.randn(40, 3, generator=g) @ torch.randn(3, 24, generator=g)).view(-1),
             torch.randn(7, generator=g)]
    x = torch.cat(parts)
    comp = build_compressor("powersgd", powersgd_rank=4)
    hat = comp.roundtrip(0, x, shapes=shapes)
    assert (hat - x).norm() <= 1e-5 * x.norm()
    assert torch.equal(hat[1920:1960], parts[1]) and torch.equal(hat[-7:], parts[3])
    flat = build_compressor("powersgd", powersgd_rank=4).roundtrip(0, x)
    assert (flat - x).norm() > 0.3 * x.norm()
    # Error feedback keeps the exact complement: residual = input - this rank's contribution.
    comp = build_compressor("powersgd", powersgd_rank=1)
    y = x + 0.1 * torch.randn(x.numel(), generator=g)
    out = comp.allreduce_mean(1, y, None, shapes=shapes)
    torch.testing.assert_close(out + comp.residual(1), y, rtol=0, atol=1e-5)
    with pytest.raises(CompressConfigError, match="shapes hold 2000 elements"):
        comp.allreduce_mean(1, y, None, shapes=[(50, 40)])


@pytest.mark.parametrize("name", ["fp16", "int4", "topk", "randomk", "powersgd"])
def test_error_feedback_tracks_the_true_sum(name: str) -> None:
    """Single rank: sum of outputs + residual == sum of inputs, and the residual stays bounded."""
    g = torch.Generator().manual_seed(5)
    drift = torch.randn(N, generator=g)
    steps, ratio = 200, 0.05
    errs = {}
    for ef in (True, False):
        comp = build_compressor(name, ratio=ratio, powersgd_rank=2, error_feedback=ef)
        sum_in, sum_out, peak = torch.zeros(N), torch.zeros(N), 0.0
        for _ in range(steps):
            x = drift + 0.3 * torch.randn(N, generator=g)
            sum_in += x
            sum_out += comp.allreduce_mean(0, x, None)
            peak = max(peak, x.norm().item())
        errs[ef] = ((sum_out - sum_in).norm() / sum_in.norm()).item()
        if ef:
            res = comp.residual(0)
            torch.testing.assert_close(sum_out + res, sum_in, rtol=1e-4, atol=1e-3)
            # Bounded, not growing with the steps: an entry waits ~1/ratio steps to be sent.
            assert res.norm() <= 2 / ratio * peak
    assert errs[True] <= 0.2, errs
    if name != "fp16":  # fp16 barely loses anything even without feedback
        assert errs[True] < errs[False] / 4, errs


@pytest.mark.parametrize("name", ["int8", "topk", "randomk", "powersgd"])
def test_state_dict_resume_gives_identical_outputs(name: str) -> None:
    kw = {"ratio": 0.05, "powersgd_rank": 2, "seed": 7, "stochastic_rounding": name == "int8"}
    comp = build_compressor(name, **kw)
    xs = [_bucket(10 + i, 3000) for i in range(8)]
    for x in xs[:4]:
        comp.allreduce_mean(0, x, None)
        comp.allreduce_mean(1, 2 * x[:1000], None)
    buf = io.BytesIO()
    torch.save(comp.state_dict(), buf)
    buf.seek(0)
    resumed = build_compressor(name, **kw)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    for x in xs[4:]:
        assert torch.equal(comp.allreduce_mean(0, x, None), resumed.allreduce_mean(0, x, None))
        assert torch.equal(comp.allreduce_mean(1, 2 * x[:1000], None),
                           resumed.allreduce_mean(1, 2 * x[:1000], None))


def test_bad_settings_and_buckets_are_clear_errors() -> None:
    with pytest.raises(CompressConfigError, match="choose one of none, fp16"):
        build_compressor("zip")
    with pytest.raises(CompressConfigError, match="ratio must be in"):
        build_compressor("topk", ratio=0.0)
    with pytest.raises(CompressConfigError, match="stochastic rounding applies"):
        build_compressor("topk", stochastic_rounding=True)
    with pytest.raises(CompressConfigError, match="flat 1-D fp32"):
        build_compressor("int8").allreduce_mean(0, torch.zeros(4, 4), None)
    assert build_compressor("int8").allreduce_mean(0, torch.zeros(0), None).numel() == 0


def _multi_rank(rank: int, n: int) -> dict[str, list]:
    """Each compressor's mean on ``n`` ranks, its bound, and error-feedback bookkeeping."""
    xs = [_bucket(100 + r) for r in range(n)]
    exact = torch.stack(xs).mean(0)
    out = {}
    for name in COMPRESSORS:
        comp = build_compressor(name, ratio=0.05, powersgd_rank=4, error_feedback=False, seed=11)
        got = comp.allreduce_mean(0, xs[rank], None)
        err = (got - exact).abs()
        if name in ("fp16", "bf16"):
            u, tiny = (2**-11, 2**-25) if name == "fp16" else (2**-8, 0.0)
            ok = (err <= n * u * torch.stack(xs).abs().amax(0) + n * tiny).all()
        elif name in ("int8", "int4"):
            levels = 127 if name == "int8" else 7
            ok = (err <= torch.stack([_block_scales(x, levels) for x in xs]).amax(0) / 2 + 1e-6).all()
        elif name == "powersgd":
            ok = (got - exact).norm() <= exact.norm() + 1e-4  # a projection of the mean
        else:  # the exact mean of each rank's own round trip (randomk: same seed, same indices)
            trips = [build_compressor(name, ratio=0.05, seed=11).roundtrip(0, x) for x in xs]
            ok = torch.allclose(got, torch.stack(trips).mean(0), rtol=1e-6, atol=1e-6)
        if name == "none":
            ok = torch.allclose(got, exact, rtol=1e-6, atol=1e-6)
        out[name] = [bool(ok), got.sum().item(), comp.wire_bytes]
    # Error feedback on n ranks: sum of outputs + mean residual == mean of the inputs' sums.
    for name in ("int8", "topk", "randomk", "powersgd"):
        comp = build_compressor(name, ratio=0.05, powersgd_rank=2, seed=11)
        sum_out = torch.zeros(N)
        for step in range(6):
            sum_out += comp.allreduce_mean(0, xs[rank] * (step + 1), None)
        res = comp.residual(0).clone()
        dist.all_reduce(res)
        want = exact * sum(range(1, 7))
        out[f"ef-{name}"] = [torch.allclose(sum_out + res / n, want, rtol=1e-4, atol=1e-3)]
    # Through plait's ring instead of the backend: the same result up to summation order.
    for name in ("none", "randomk", "powersgd"):
        a = build_compressor(name, ratio=0.05, seed=11).allreduce_mean(0, xs[rank], None)
        b = build_compressor(name, ratio=0.05, seed=11, allreduce=ring_all_reduce).allreduce_mean(
            0, xs[rank], None)
        out[f"ring-{name}"] = [torch.allclose(a, b, rtol=1e-4, atol=1e-5)]
    return out


def test_multi_rank_means_within_bounds() -> None:
    n = 3
    results = run_ranks(_multi_rank, n)
    for name, (ok, *_) in results[0].items():
        assert all(r[name][0] for r in results), f"{name} outside its bound on some rank"
        assert ok
    for name in COMPRESSORS:  # the same result on every rank
        assert len({r[name][1] for r in results}) == 1, name
    full = results[0]["none"][2]
    assert full == 2 * (n - 1) * N * 4 // n
    assert results[0]["fp16"][2] == full // 2
    for name in ("int8", "int4", "topk", "randomk", "powersgd"):
        assert 0 < results[0][name][2] < full, name


def test_topk_prefilter_equals_full_topk_and_random_subset_is_uniform() -> None:
    """Buckets past 65,536 entries take the fast paths: top-k through a sampled threshold (must pick
    exactly torch.topk's entries, also when the bucket packs tensors of very different scales), and
    random-k by drawing with replacement (k distinct indices, the same for the same generator state,
    spread evenly: a biased pick, e.g. the k smallest distinct draws, fails the quarter counts)."""
    g = torch.Generator().manual_seed(5)
    n = 300_000
    a = torch.cat([torch.randn(n // 2, generator=g) * 1e-3, torch.randn(n - n // 2, generator=g)]).abs()
    for k in (1, 3_000, 60_000):
        got = compress._topk_indices(a, k).sort().values
        assert torch.equal(got, a.topk(k).indices.sort().values), k
    k, draws, quarters = 1_000, 40, torch.zeros(4)
    for seed in range(draws):
        idx = compress._random_subset(100_000, k, torch.Generator().manual_seed(seed))
        again = compress._random_subset(100_000, k, torch.Generator().manual_seed(seed))
        assert torch.equal(idx, again) and idx.unique().numel() == k and 0 <= idx.min() and idx.max() < 100_000
        quarters += torch.bincount(idx // 25_000, minlength=4)
    expected = draws * k / 4
    assert ((quarters - expected).abs() / expected).max() < 0.05
