"""Checkpoint safety: a crash during a save leaves the last good checkpoint intact and loadable."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from plait.checkpoint import dcp as ckpt
from plait.data.corpus import DataError, load_splits
from plait.engine import Plait


def _trained(seed: int, steps: int = 1) -> tuple[Plait, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    p = Plait(train={"global_batch_size": 2, "micro_batch_size": 2},
              observe={"progress": False, "trackers": []})
    model, opt = p.setup(torch.nn.Linear(4, 3), optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=0.1))
    for _ in range(steps):
        p.backward(model(torch.randn(2, 4)).sum())
        p.step()
    return p, model, opt


def _save(p: Plait, model, opt, run_dir: Path, step: int, keep: int, extra: dict) -> Path:
    """What the Trainer does: a complete checkpoint, then ``latest`` moved to it."""
    path = p.save(ckpt.step_dir(run_dir, step), model=model, optimizer=opt, extra=extra)
    ckpt.point_latest(run_dir, path, keep)
    return path


def test_crash_during_save_keeps_last_good(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p, model, opt = _trained(0)
    _save(p, model, opt, tmp_path, 1, 2, {"sampler": {"consumed": 1}})
    good = {k: v.clone() for k, v in model.state_dict().items()}
    p.backward(model(torch.randn(2, 4)).sum())
    p.step()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.dcp, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        _save(p, model, opt, tmp_path, 2, 2, {"sampler": {"consumed": 2}})
    monkeypatch.undo()
    assert not ckpt.step_dir(tmp_path, 2).exists()  # only the .tmp the crash left, never a half checkpoint
    latest = ckpt.latest_checkpoint(tmp_path)
    assert latest is not None and latest.name == "step_0000001"
    fresh, fresh_model, fresh_opt = _trained(1)
    extra = fresh.load(latest, model=fresh_model, optimizer=fresh_opt)
    assert extra == {"sampler": {"consumed": 1}} and fresh.steps == 1
    assert all(torch.equal(good[k], v) for k, v in fresh_model.state_dict().items())
    # The next good save cleans the crashed save's leftovers and moves `latest`.
    _save(fresh, fresh_model, fresh_opt, tmp_path, 3, 1, {})
    names = sorted(q.name for q in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_0000003"]


def test_optimizer_state_is_restored(tmp_path: Path) -> None:
    saved, model, opt = _trained(0, steps=2)
    saved.save(tmp_path / "c", model=model, optimizer=opt)
    fresh, fresh_model, fresh_opt = _trained(1, steps=0)  # no optimizer state yet: loading must create it
    fresh.load(tmp_path / "c", model=fresh_model, optimizer=fresh_opt)
    for p, q in zip(model.parameters(), fresh_model.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key]), key


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
