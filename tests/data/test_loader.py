"""DistributedLoader: disjoint ranks, global batches independent of dp, even eval split, exact resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from plait.config import ConfigError
from plait.data.loader import DistributedBatchSampler, DistributedLoader, is_rank_aware

N = 103  # not a multiple of any batch size below, so every tail rule is exercised


class _Indices(torch.utils.data.Dataset):
    """Sample i is i, so a batch shows which indices it holds; records set_epoch calls."""

    def __init__(self, n: int = N) -> None:
        self.n = n
        self.epochs: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


def _samplers(dp: int, batch_size: int, accumulation: int = 1, **kw: object) -> list[DistributedBatchSampler]:
    return [DistributedBatchSampler(N, batch_size, dp_rank=r, dp_size=dp, accumulation=accumulation, seed=7, **kw)
            for r in range(dp)]


def _global_batches(dp: int, batch_size: int, accumulation: int, epoch: int) -> list[set[int]]:
    """Per optimizer step, the union of every rank's micro-batches of that step."""
    per_rank = [s.batches(epoch) for s in _samplers(dp, batch_size, accumulation)]
    steps = len(per_rank[0]) // accumulation
    return [{i for rank in per_rank for mb in rank[k * accumulation:(k + 1) * accumulation] for i in mb}
            for k in range(steps)]


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


def _drain(loader: DistributedLoader) -> list[list[int]]:
    return [b.tolist() for b in loader]


def test_ranks_are_disjoint_and_cover_each_sample_at_most_once() -> None:
    for epoch in range(3):
        per_rank = [_flat(s.batches(epoch)) for s in _samplers(4, 3, accumulation=2)]
        union = [i for r in per_rank for i in r]
        assert len(union) == len(set(union)) == N // 24 * 24
        assert all(len(r) == len(union) // 4 for r in per_rank)


def test_global_batches_do_not_depend_on_dp_size() -> None:
    # Global batch 24 split as 1 x 24 x 1, 2 x 4 x 3, 4 x 3 x 2 (dp x micro-batch x accumulation).
    for epoch in range(2):
        reference = _global_batches(1, 24, 1, epoch)
        assert len(reference) == N // 24
        assert _global_batches(2, 4, 3, epoch) == reference
        assert _global_batches(4, 3, 2, epoch) == reference


def test_order_is_deterministic_and_changes_with_epoch_and_seed() -> None:
    a, b = _samplers(2, 4)[1], _samplers(2, 4)[1]
    assert a.batches(0) == b.batches(0) and a.batches(3) == b.batches(3)
    assert a.batches(0) != a.batches(1)
    other_seed = DistributedBatchSampler(N, 4, dp_rank=1, dp_size=2, seed=8)
    assert other_seed.batches(0) != a.batches(0)
    assert len(a) == len(a.batches(0)) == N // 8 and a.global_batch_size == 8
    a.set_epoch(1)
    assert list(a) == a.batches(1)


@pytest.mark.parametrize("shuffle", [False, True])
def test_eval_style_gives_every_rank_equal_batches(shuffle: bool) -> None:
    # 103 samples over 4 ranks use 100: 5 global batches of 4 x 5, or 4 of 4 x 6 and a last one of 4 x 1.
    for dp, batch_size in [(4, 5), (4, 6), (3, 4), (5, 7)]:
        samplers = _samplers(dp, batch_size, accumulation=3, shuffle=shuffle, drop_last=False)
        per_rank = [s.batches(0) for s in samplers]
        sizes = [[len(b) for b in r] for r in per_rank]
        assert all(s == sizes[0] for s in sizes) and all(len(r) == len(samplers[0]) for r in per_rank)
        union = [i for r in per_rank for i in _flat(r)]
        used = N // dp * dp
        assert len(union) == len(set(union)) == used
        if not shuffle:
            assert set(union) == set(range(used))
        assert samplers[0].accumulation == 1 and samplers[0].global_batch_size == batch_size * dp


def test_too_small_datasets_are_rejected_with_what_to_do() -> None:
    with pytest.raises(ConfigError, match=r"holds 103 samples, fewer than one global batch of 128 .*4 x 8 x 4.*"
                                          r"train.global_batch_size"):
        DistributedBatchSampler(N, 4, dp_rank=0, dp_size=8, accumulation=4)
    with pytest.raises(ConfigError, match="fewer than the 4 data-parallel ranks"):
        DistributedBatchSampler(3, 4, dp_rank=0, dp_size=4, shuffle=False, drop_last=False)


def _loader(dataset: _Indices | None = None, dp: int = 2, rank: int = 0, batch_size: int = 4, accumulation: int = 2,
            **kw: object) -> DistributedLoader:
    return DistributedLoader(dataset if dataset is not None else _Indices(), batch_size, dp_rank=rank, dp_size=dp,
                             accumulation=accumulation, seed=3, **kw)


def test_skip_leaves_out_whole_global_batches_and_names_their_samples() -> None:
    """skip(n) on every rank leaves out the same n global batches (across an epoch's end), returns every rank's
    samples of them in data order, and keeps the windows in the state, which loads back; training continues with
    the batch after them."""
    loaders = [_loader(rank=r) for r in range(2)]  # global batch 16 = 4 x dp 2 x accumulation 2
    per_epoch = len(loaders[0]) // 2
    for loader in loaders:
        loader.advance(2 * (per_epoch - 1))  # one global batch before the epoch's end
    ids = [loader.skip(3) for loader in loaders]
    order0, order1 = loaders[0].sampler._order(0), loaders[0].sampler._order(1)
    assert ids[0] == ids[1] == order0[(per_epoch - 1) * 16:per_epoch * 16].tolist() + order1[:32].tolist()
    state = loaders[0].state_dict()
    assert state["skipped"] == [0, per_epoch - 1, 1, 1, 0, 2] and (state["epoch"], state["position"]) == (1, 4)
    again = _loader(rank=1)
    again.load_state_dict(state)
    assert again.skipped_samples() == ids[0]
    first = next(iter(again)).tolist()  # rank 1's first micro-batch of global batch 2 of epoch 1
    assert first == order1[2 * 16 + 8:2 * 16 + 12].tolist()


def test_loader_iterates_epochs_and_calls_set_epoch() -> None:
    dataset = _Indices()
    loader = _loader(dataset)
    epochs = [_drain(loader) for _ in range(3)]
    assert dataset.epochs == [0, 1, 2] and loader.epoch == 2 and loader.position == len(loader) == N // 16 * 2
    for e, batches in enumerate(epochs):
        assert batches == loader.sampler.batches(e)
    # A step loop restarts the iterator on StopIteration and gets the next epoch.
    it = iter(loader)
    assert next(it).tolist() == loader.sampler.batches(3)[0] and loader.position == 1


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("stop", [3, 11, 12])  # mid-epoch, one before the epoch's end, at its end (12 per epoch)
def test_resume_mid_epoch_continues_the_uninterrupted_run(num_workers: int, stop: int) -> None:
    uninterrupted = _loader(accumulation=1)
    expected = _drain(uninterrupted) + _drain(uninterrupted)

    first = _loader(accumulation=1, num_workers=num_workers)
    it = iter(first)
    seen = [next(it).tolist() for _ in range(stop)]
    state = first.state_dict()  # workers have prefetched beyond `stop`; the state must not count those
    del it
    assert state["position"] == stop and state.pop("skipped") == [] and all(type(v) is int for v in state.values())
    resumed = _loader(accumulation=1, num_workers=num_workers)
    resumed.load_state_dict(state)
    rest = []
    while (resumed.epoch, resumed.position) != (1, len(resumed)):  # the rest of epoch 0, then all of epoch 1
        rest += _drain(resumed)
    assert seen + rest == expected


def test_state_survives_torch_save_with_weights_only(tmp_path: Path) -> None:
    loader = _loader()
    it = iter(loader)
    next(it)
    path = tmp_path / "loader.pt"
    torch.save(loader.state_dict(), path)
    fresh = _loader()
    fresh.load_state_dict(torch.load(path, weights_only=True))
    assert fresh.state_dict() == loader.state_dict()


def _steps(loaders: list[DistributedLoader], accumulation: int, num_steps: int) -> list[set[int]]:
    """The samples of each of the next ``num_steps`` optimizer steps, over all ranks."""
    iters = [iter(ld) for ld in loaders]
    steps = []
    for _ in range(num_steps):
        steps.append({i for it in iters for _ in range(accumulation) for i in next(it).tolist()})
    return steps


def test_resume_at_another_dp_size_sees_the_same_global_batches() -> None:
    # Global batch 16: 2 ranks x 4 x accumulation 2 before, 4 ranks x 2 x accumulation 2 after.
    reference = [_loader(dp=1, batch_size=16, accumulation=1)]
    expected = _steps(reference, 1, 6)  # 6 steps per epoch of 103 samples
    before = [_loader(dp=2, rank=r, batch_size=4, accumulation=2) for r in range(2)]
    assert _steps(before, 2, 2) == expected[:2]
    state = before[0].state_dict()
    assert state == before[1].state_dict()
    after = [_loader(dp=4, rank=r, batch_size=2, accumulation=2) for r in range(4)]
    for ld in after:
        ld.load_state_dict(state)
    assert after[0].position == 4
    assert _steps(after, 2, 4) == expected[2:]


def test_resume_mid_step_at_another_dp_size_is_refused() -> None:
    loader = _loader(dp=2, accumulation=2)
    next(iter(loader))
    with pytest.raises(ConfigError, match="optimizer-step boundary"):
        _loader(dp=4, batch_size=2, accumulation=2).load_state_dict(loader.state_dict())


@pytest.mark.parametrize(("field", "value", "message"), [
    ("seed", 4, "train.seed=4 .* seed differ"),
    ("global_batch_size", 32, "global batch 32 .* global_batch_size differ"),
    ("num_samples", 99, "over 99 samples .* num_samples differ"),
    ("shuffle", 0, "shuffle=False.* shuffle differ"),
])
def test_resume_with_another_data_order_is_refused(field: str, value: int, message: str) -> None:
    state = _loader().state_dict() | {field: value}
    with pytest.raises(ConfigError, match=message):
        _loader().load_state_dict(state)
    with pytest.raises(ConfigError, match="lacks position"):
        _loader().load_state_dict({k: v for k, v in _loader().state_dict().items() if k != "position"})


def test_eval_loader_resumes_at_another_dp_size() -> None:
    kw = {"shuffle": False, "drop_last": False, "accumulation": 1}
    before = _loader(dp=2, batch_size=6, **kw)
    it = iter(before)
    next(it), next(it)
    after = _loader(dp=4, batch_size=3, **kw)
    after.load_state_dict(before.state_dict())
    assert after.position == 2 and _drain(after)[0] == list(range(24, 27))


def test_collate_fn_and_dataloader_kwargs_pass_through() -> None:
    loader = _loader(collate_fn=lambda items: ("collated", items), pin_memory=False)
    tag, items = next(iter(loader))
    assert tag == "collated" and items == loader.sampler.batches(0)[0]


@pytest.mark.parametrize("kwarg", ["sampler", "batch_sampler"])
def test_owned_dataloader_kwargs_are_rejected(kwarg: str) -> None:
    with pytest.raises(ConfigError, match=f"{kwarg} cannot be passed .* plait sets them"):
        _loader(**{kwarg: None})


def test_is_rank_aware() -> None:
    dataset = _Indices()
    sharded = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=0)
    assert is_rank_aware(DataLoader(dataset, batch_size=4, sampler=sharded))
    batch_sampler = torch.utils.data.BatchSampler(sharded, batch_size=4, drop_last=True)
    assert is_rank_aware(DataLoader(dataset, batch_sampler=batch_sampler))
    assert is_rank_aware(DataLoader(dataset, batch_sampler=DistributedBatchSampler(N, 4, dp_rank=0, dp_size=2)))
    assert is_rank_aware(_loader(dataset))
    assert not is_rank_aware(DataLoader(dataset, batch_size=4, shuffle=True))
    assert not is_rank_aware(DataLoader(dataset, batch_size=4))
