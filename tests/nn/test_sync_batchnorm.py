"""plait.nn.SyncBatchNorm against single-process nn.BatchNorm on the concatenated global batch.

Two gloo ranks each take a slice (sizes may differ, zero included) of one fixed global batch through
``layer -> BatchNorm -> ReLU -> sum / divisor``: one forward for running statistics, then one forward
and backward. The reference runs the same weights on the whole batch with the mean loss.

Tolerances: float32 throughout, and the sync layer sums per rank, then across ranks, so only the
reduction order differs from the reference: outputs and running statistics agree to ``atol=1e-5``,
gradients (magnitudes around 1e-3 to 1) to ``rtol=1e-4, atol=1e-6``; ``num_batches_tracked`` exactly.
Outside training, or with one rank, the layer is ``nn.BatchNorm`` and must agree bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import run_ranks
from torch import nn

from plait.models.resnet import ResNet
from plait.nn import SyncBatchNorm, convert_sync_batchnorm

GRAD_TOL = {"rtol": 1e-4, "atol": 1e-6}
VALUE_TOL = {"rtol": 0.0, "atol": 1e-5}
# (name, kind, local batch sizes per rank, momentum, loss divisor): "global" divides each rank's output
# sum by the global element count (its share of the global mean; gradients are then SUMMED over ranks),
# "local" by its own (each rank's mean loss; gradients AVERAGED over ranks, which is exact only for equal
# local batches, so that case uses 8 and 8).
CASES = [
    ("bn2d_uneven", "2d", (6, 10), 0.1, "global"),
    ("bn1d_uneven_cumulative", "1d", (3, 9), None, "global"),
    ("bn1d_empty_rank", "1d", (0, 12), 0.1, "global"),
    ("bn2d_equal_mean_loss", "2d", (8, 8), 0.1, "local"),
]
NUM_CHANNELS = 4


def _per_sample(kind: str) -> int:
    return NUM_CHANNELS * (25 if kind == "2d" else 1)  # output elements per sample: (4, 5, 5) or (4,)


def _build(kind: str, momentum: float | None) -> nn.Sequential:
    torch.manual_seed(0)
    if kind == "2d":
        layer, bn = nn.Conv2d(3, NUM_CHANNELS, 3, padding=1), nn.BatchNorm2d(NUM_CHANNELS, momentum=momentum)
    else:
        layer, bn = nn.Linear(5, NUM_CHANNELS), nn.BatchNorm1d(NUM_CHANNELS, momentum=momentum)
    with torch.no_grad():  # away from the (1, 0) init so the affine gradients are exercised
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return nn.Sequential(layer, bn, nn.ReLU())


def _batches(kind: str, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    shape = (total, 3, 5, 5) if kind == "2d" else (total, 5)
    # Means well away from zero, so a variance computed as E[x^2] - E[x]^2 would show its error.
    return torch.randn(shape, generator=g) * 2 + 3, torch.randn(shape, generator=g) * 0.5 - 1


def _train_two_steps(model: nn.Sequential, a: torch.Tensor, b: torch.Tensor, divisor: int) -> dict:
    model.train()
    model(a)  # first step: running statistics only
    x = b.clone().requires_grad_()
    out = model(x)  # (N, 4, 5, 5) or (N, 4)
    (out.sum() / divisor).backward()
    bn = model[1]
    return {
        "out": out.detach(), "x_grad": x.grad,
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "running_mean": bn.running_mean.clone(), "running_var": bn.running_var.clone(),
        "num_batches_tracked": bn.num_batches_tracked.clone(),
    }


def _rank_cases(rank: int, world_size: int) -> dict:
    results = {}
    for name, kind, sizes, momentum, loss_over in CASES:
        a, b = _batches(kind, sum(sizes))
        lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
        model = convert_sync_batchnorm(_build(kind, momentum))
        divisor = _per_sample(kind) * (sum(sizes) if loss_over == "global" else sizes[rank])
        results[name] = _train_two_steps(model, a[lo:hi], b[lo:hi], divisor)
    # Eval mode uses the running statistics only: bit-identical to nn.BatchNorm on each rank's own data.
    ref = _build("2d", 0.1)
    ref(torch.randn(7, 3, 5, 5) + 2)  # non-trivial running statistics
    ref.eval()
    synced = convert_sync_batchnorm(copy.deepcopy(ref))
    x = torch.randn(5 + rank, 3, 5, 5)
    with torch.no_grad():
        results["eval_equal"] = torch.equal(synced(x), ref(x))
    return results


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_rank_cases, 2)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_two_ranks_match_one_process_on_global_batch(two_ranks: list[dict], case: tuple) -> None:
    name, kind, sizes, momentum, loss_over = case
    a, b = _batches(kind, sum(sizes))
    ref = _train_two_steps(_build(kind, momentum), a, b, _per_sample(kind) * sum(sizes))
    got = [r[name] for r in two_ranks]
    world_size = len(got)

    torch.testing.assert_close(torch.cat([g["out"] for g in got]), ref["out"], **VALUE_TOL)
    for g in got:
        for key in ("running_mean", "running_var"):
            torch.testing.assert_close(g[key], ref[key], **VALUE_TOL)
        assert int(g["num_batches_tracked"]) == int(ref["num_batches_tracked"]) == 2

    x_grad = torch.cat([g["x_grad"] for g in got])
    if loss_over == "global":
        # Each rank's loss is its share of the global mean: input gradients equal the reference's and
        # parameter gradients SUMMED over ranks equal it.
        torch.testing.assert_close(x_grad, ref["x_grad"], **GRAD_TOL)
        reduce = sum
    else:
        # Each rank's loss is its own mean (the data-parallel contract): input gradients are world_size
        # times the reference's, and parameter gradients AVERAGED over ranks equal it.
        torch.testing.assert_close(x_grad, world_size * ref["x_grad"], **GRAD_TOL)
        reduce = lambda gs: sum(gs) / world_size
    for p in ref["grads"]:
        torch.testing.assert_close(reduce([g["grads"][p] for g in got]), ref["grads"][p], **GRAD_TOL, msg=p)


def test_eval_mode_on_two_ranks_is_batchnorm(two_ranks: list[dict]) -> None:
    assert all(r["eval_equal"] for r in two_ranks)


def _compare_with_batchnorm(rank: int = 0, world_size: int = 1) -> bool:
    """Train and eval steps through SyncBatchNorm and nn.BatchNorm2d agree bit for bit (no group of > 1)."""
    ref = _build("2d", 0.1)
    synced = convert_sync_batchnorm(copy.deepcopy(ref))
    a, b = _batches("2d", 6)
    r, s = _train_two_steps(ref, a, b, 6), _train_two_steps(synced, a, b, 6)
    same = all(torch.equal(r[k], s[k]) for k in ("out", "x_grad", "running_mean", "running_var",
                                                  "num_batches_tracked"))
    same &= all(torch.equal(r["grads"][p], s["grads"][p]) for p in r["grads"])
    ref.eval(), synced.eval()
    with torch.no_grad():
        return same and torch.equal(ref(a), synced(a))


def test_single_process_is_batchnorm() -> None:
    assert _compare_with_batchnorm()


def test_world_size_one_is_batchnorm() -> None:
    assert run_ranks(_compare_with_batchnorm, 1) == [True]


def test_convert_keeps_state_dict_and_parameters() -> None:
    torch.manual_seed(0)
    model = ResNet(width=8, num_blocks=2)
    model(torch.randn(4, 1, 8, 8))  # non-trivial running statistics
    params = dict(model.named_parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    num_bn = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())

    assert convert_sync_batchnorm(model, process_group=None) is model
    after = model.state_dict()
    assert list(after) == list(before)
    for k in before:
        assert torch.equal(after[k], before[k]), k
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert sum(isinstance(m, SyncBatchNorm) for m in model.modules()) == num_bn > 0
    # The same Parameter objects, so an optimizer built before the conversion still updates the model.
    assert all(p is params[n] for n, p in model.named_parameters())


def test_convert_top_level_batchnorm_copies_settings() -> None:
    bn = nn.BatchNorm1d(3, eps=1e-3, momentum=None, affine=False, track_running_stats=True).eval()
    out = convert_sync_batchnorm(bn)
    assert isinstance(out, SyncBatchNorm) and out is not bn
    assert (out.eps, out.momentum, out.affine, out.track_running_stats, out.training) == (1e-3, None, False, True,
                                                                                           False)
    assert out.weight is None and out.running_mean is bn.running_mean
