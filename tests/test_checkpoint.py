"""Checkpoint safety: a crash during a save leaves the last good checkpoint intact and loadable."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from plait.config import load_config
from plait.data.corpus import DataError, load_splits
from plait.parallel.apply import Layout
from plait.parallel.data import LocalGrads
from plait.train import checkpoint as ckpt


def _layout(seed: int, steps: int = 1) -> Layout:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    layout = Layout(model, load_config(), LocalGrads(model))
    for _ in range(steps):
        model(torch.randn(2, 4)).sum().backward()
        layout.optimizer.step()
    return layout


def test_crash_during_save_keeps_last_good(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = _layout(0)
    ckpt.save_checkpoint(tmp_path, 1, layout, {"sampler": {"consumed": 1}}, rank=0, keep=2)
    good = {k: v.clone() for k, v in layout.model.state_dict().items()}
    layout.model(torch.randn(2, 4)).sum().backward()
    layout.optimizer.step()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.dcp, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(tmp_path, 2, layout, {"sampler": {"consumed": 2}}, rank=0, keep=2)
    monkeypatch.undo()
    latest = ckpt.latest_checkpoint(tmp_path)
    assert latest is not None and latest.name == "step_0000001"
    fresh = _layout(1)
    meta = ckpt.load_checkpoint(latest, fresh, rank=0)
    assert meta["step"] == 1 and meta["sampler"]["consumed"] == 1
    assert all(torch.equal(good[k], v) for k, v in fresh.model.state_dict().items())
    # The next good save cleans the crashed save's leftovers and moves `latest`.
    ckpt.save_checkpoint(tmp_path, 3, fresh, {}, rank=0, keep=1)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_0000003"]


def test_optimizer_state_is_restored(tmp_path: Path) -> None:
    saved = _layout(0, steps=2)
    ckpt.save_checkpoint(tmp_path, 1, saved, {}, rank=0, keep=1)
    fresh = _layout(1, steps=0)  # no optimizer state yet: loading must create it
    ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path), fresh, rank=0)
    for p, q in zip(saved.model.parameters(), fresh.model.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(saved.optimizer.state[p][key], fresh.optimizer.state[q][key]), key


def test_user_text_and_token_files(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("héllo world\n" * 200)
    splits = load_splits(str(text), 256, 0.1, 16)
    assert splits.train[:6].tolist() == list("héllo".encode())
    tokens = tmp_path / "tokens.bin"
    np.arange(3000, dtype=np.uint16).tofile(tokens)
    assert load_splits(str(tokens), 4096, 0.1, 16).train[:3].tolist() == [0, 1, 2]
    with pytest.raises(DataError, match="set model.vocab_size to at least 3000"):
        load_splits(str(tokens), 256, 0.1, 16)
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe" * 100)
    with pytest.raises(DataError, match="is not UTF-8 text"):
        load_splits(str(tmp_path / "bad.txt"), 256, 0.1, 16)
