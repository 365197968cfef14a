"""Sampler: disjoint across data-parallel ranks, deterministic, independent of dp, exact resume."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.data.corpus import embedded_corpus_bytes, load_splits
from plait.data.sampler import WindowSampler, validation_batches

TOKENS = torch.arange(5000) % 251


def _sampler(rank: int, dp: int, seed: int = 3, micro: int = 2, gbs: int = 8) -> WindowSampler:
    return WindowSampler(TOKENS, seq_len=16, global_batch_size=gbs, micro_batch_size=micro,
                         dp_rank=rank, dp_size=dp, seed=seed)


def test_ranks_are_disjoint_and_cover_the_global_batch() -> None:
    for step in range(70):  # crosses epoch boundaries (38 batches per epoch)
        shares = [_sampler(r, 4).rank_indices(step) for r in range(4)]
        union = torch.cat(shares)
        assert len(set(union.tolist())) == len(union) == 8
        assert torch.equal(union, _sampler(0, 1).rank_indices(step))


def test_deterministic_for_a_seed_and_different_across_seeds() -> None:
    a, b, c = _sampler(0, 2), _sampler(0, 2), _sampler(0, 2, seed=4)
    xa, xb, xc = a.next_batch(), b.next_batch(), c.next_batch()
    assert all(torch.equal(p[0], q[0]) for p, q in zip(xa, xb, strict=True))
    assert not torch.equal(xa[0][0], xc[0][0])


def test_targets_are_inputs_shifted_by_one() -> None:
    (x, y), *_ = _sampler(1, 2).next_batch()
    assert x.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1])


@settings(max_examples=25, deadline=None)
@given(stop=st.integers(0, 90), dp=st.sampled_from([1, 2, 4]))
def test_exact_resume_mid_epoch(stop: int, dp: int) -> None:
    straight = _sampler(dp - 1, dp)
    for _ in range(stop):
        straight.next_batch()
    expected = straight.next_batch()
    first = _sampler(dp - 1, dp)
    for _ in range(stop):
        first.next_batch()
    resumed = _sampler(dp - 1, dp)
    resumed.load_state_dict(first.state_dict())
    got = resumed.next_batch()
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(got, expected, strict=True))


def test_validation_set_is_shared_out_and_layout_independent() -> None:
    both = validation_batches(TOKENS, 16, 2, 10, 0, 1)
    parts = validation_batches(TOKENS, 16, 2, 10, 0, 2) + validation_batches(TOKENS, 16, 2, 10, 1, 2)
    wide = validation_batches(TOKENS, 16, 4, 10, 0, 1)  # another micro-batch size: the same 10 sequences
    assert len(both) == len(parts) == 5 and sum(len(x) for x, _ in wide) == 10
    rows = [sorted(r.tolist() for x, _ in b for r in x) for b in (both, parts, wide)]
    assert rows[0] == rows[1] == rows[2]


def test_embedded_corpus_and_split() -> None:
    raw = embedded_corpus_bytes()
    assert 400_000 < len(raw) < 600_000
    splits = load_splits("", 256, 0.05, 128)
    assert len(splits.train) + len(splits.val) == len(raw)
    assert int(splits.train.max()) < 256
