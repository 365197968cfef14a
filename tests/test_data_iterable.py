"""``Plait.setup_dataloader`` on Hugging Face data sets, iterable data sets, a StatefulDataLoader and a plain
iterable, at dp=2 (gloo, spawned): each rank reads its own share (together: every sample once), and a
loader restored from the gathered checkpoint state continues with exactly the batches the original went on
to read. The Hugging Face iterable data set goes through ``Plait.save`` / ``Plait.load`` (the per-rank
states gathered into the checkpoint and read back with ``weights_only``); its state cannot be re-dealt to
another degree (a clear error). A plain iterable is accepted with one warning that it cannot be resumed.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import run_ranks

N, BATCH = 48, 2


def _plait(root: str):
    import plait

    return plait.Plait(run={"dir": root}, train={"global_batch_size": 2 * BATCH, "micro_batch_size": BATCH},
                       observe={"progress": False, "trackers": []})


def _values(batch) -> list[int]:
    x = batch["x"] if isinstance(batch, dict) else batch
    return torch.as_tensor(x).flatten().tolist()


class Numbers(torch.utils.data.IterableDataset):
    """0..N-1, no state_dict: resumed by reading and dropping what was used."""

    def __iter__(self):
        return iter(range(N))


def _kinds():
    import datasets
    from torchdata.stateful_dataloader import StatefulDataLoader

    table = datasets.Dataset.from_dict({"x": list(range(N))}).with_format("torch")
    return {"hf_map": lambda: table,
            "hf_iterable": lambda: table.to_iterable_dataset(num_shards=4),
            "torch_iterable": Numbers,
            "stateful_loader": lambda: StatefulDataLoader(table.to_iterable_dataset(num_shards=4), batch_size=BATCH)}


def _first_epoch(loader) -> list[int]:
    return [v for batch in loader for v in _values(batch)]


def _group(rank: int, world: int, root: str) -> dict:
    from plait.data.resumable import checkpoint_state

    p, out = _plait(f"{root}/run"), {}
    for name, make in _kinds().items():
        loader = p.setup_dataloader(make())
        out[name] = {"epoch": _first_epoch(loader)}
        loader = p.setup_dataloader(make())
        it = iter(loader)
        [next(it) for _ in range(3)]
        state = checkpoint_state(loader)  # collective: every rank's state
        out[name]["next"] = [_values(next(it)) for _ in range(3)]
        again = p.setup_dataloader(make())
        again.load_state_dict(state)
        it2 = iter(again)
        out[name]["resumed"] = [_values(next(it2)) for _ in range(3)]
        out[name]["state"] = state
    # through the engine's checkpoint: Plait.save gathers the per-rank states, Plait.load reads them back
    model, opt = p.setup(torch.nn.Linear(1, 1), optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    loader = p.setup_dataloader(_kinds()["hf_iterable"]())
    it = iter(loader)
    [next(it) for _ in range(2)]
    p.save(f"{root}/ckpt", model=model, optimizer=opt, dataloader=loader)
    expected = [_values(next(it)) for _ in range(2)]
    fresh = p.setup_dataloader(_kinds()["hf_iterable"]())
    p.load(f"{root}/ckpt", model=model, optimizer=opt, dataloader=fresh)
    it = iter(fresh)
    out["engine"] = (expected, [_values(next(it)) for _ in range(2)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = p.setup_dataloader(iter([torch.tensor([i]) for i in range(8)]))
    out["plain"] = ([str(w.message) for w in caught], _first_epoch(plain))
    p.close()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(_group, 2, str(tmp_path_factory.mktemp("iterable")), timeout=240)


@pytest.mark.parametrize("kind", ["hf_map", "hf_iterable", "torch_iterable", "stateful_loader"])
def test_each_rank_reads_its_share_and_resumes_exactly(ranks, kind) -> None:
    a, b = ranks[0][kind], ranks[1][kind]
    assert not set(a["epoch"]) & set(b["epoch"])  # no sample on two ranks
    if kind == "hf_map":  # plait's loader: whole global batches, the tail that does not fill one dropped
        assert len(a["epoch"]) == len(b["epoch"]) == N // 2
    else:
        assert sorted(a["epoch"] + b["epoch"]) == list(range(N))
    for r in ranks:
        assert r[kind]["resumed"] == r[kind]["next"] and r[kind]["next"]


def test_engine_checkpoint_restores_every_rank(ranks) -> None:
    for r in ranks:
        expected, got = r["engine"]
        assert got == expected and expected


def test_iterable_state_is_not_redealt_to_another_degree(ranks) -> None:
    from plait.data.corpus import DataError
    from plait.data.resumable import PerRankLoader

    loader = PerRankLoader(None, dp_rank=0, dp_size=1)
    with pytest.raises(DataError, match="cannot be re-dealt to 1 ranks: resume at degree 2"):
        loader.load_state_dict(ranks[0]["hf_iterable"]["state"])


def test_plain_iterable_is_accepted_with_one_warning(ranks) -> None:
    for rank, r in enumerate(ranks):
        messages, values = r["plain"]
        assert len(messages) == 1 and "cannot resume" in messages[0]
        assert values == list(range(rank, 8, 2))
