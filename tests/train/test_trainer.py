"""Trainer behaviour on one process: precision modes, skipped non-finite steps, determinism, schedule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import run_ranks

from plait.components.optim import lr_at
from plait.config import OptimConfig
from plait.recipes import load_recipe_config as load_config  # plait train's config: the gpt recipe's defaults
from plait.recipes import validate_config as validate

TINY = ["--model.n_layer=1", "--model.d_model=32", "--model.n_head=2", "--model.seq_len=16",
        "--train.global_batch_size=4", "--train.micro_batch_size=2", "--train.eval_sequences=4",
        "--observe.progress=false", "--observe.trackers=[]", "--optim.warmup_steps=1"]


def _trainer(root: str, name: str, extra: list[str]):
    from plait.recipes import build_trainer

    cfg = validate(load_config(overrides=TINY + extra + [f"--run.dir={root}/{name}"]), 1)
    Path(cfg.run.dir).mkdir(parents=True)
    return build_trainer(cfg)


def _skip_nonfinite(root: str, precision: str) -> dict:
    t = _trainer(root, precision, [f"--train.precision={precision}", "--optim.skip_nonfinite=true"])
    first = t.train_step()
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    scale_before = t.scaler.scale
    handle = t.model.blocks[0].mlp.fc.weight.register_hook(lambda g: g * float("inf"))
    bad = t.train_step()
    handle.remove()
    unchanged = all(torch.equal(before[k], v) for k, v in t.model.state_dict().items())
    scale_after = t.scaler.scale
    good = t.train_step()
    moved = not all(torch.equal(before[k], v) for k, v in t.model.state_dict().items())
    return {"first_loss": first["loss"], "bad_norm": bad["grad_norm"], "skipped": t.state.skipped_steps,
            "unchanged": unchanged, "moved_after": moved, "scale_before": scale_before,
            "scale_after": scale_after, "good_loss": good["loss"]}


def _two_runs(root: str) -> list[dict]:
    out = []
    for name in ("a", "b"):
        t = _trainer(root, name, ["--train.deterministic=true", "--model.dropout=0.1"])
        for _ in range(3):
            t.train_step()
        out.append({k: v.clone() for k, v in t.model.state_dict().items()})
    return out


def _one_process(rank: int, world: int, root: str) -> dict:
    """Every check of this file in one spawned process (a fresh one per test would cost more than the checks):
    the precision runs first, then the deterministic pair, which turns deterministic algorithms on for good."""
    out = {p: _skip_nonfinite(root, p) for p in ("fp32", "bf16", "fp16")}
    out["deterministic"] = _two_runs(root)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_ranks(_one_process, 1, str(tmp_path_factory.mktemp("trainer")))[0]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_nonfinite_step_is_skipped_and_counted(results: dict, precision: str) -> None:
    r = results[precision]
    assert r["skipped"] == 1 and r["unchanged"] and r["moved_after"]
    assert not torch.isfinite(torch.tensor(r["bad_norm"]))
    assert 4.0 < r["first_loss"] < 7.0 and torch.isfinite(torch.tensor(r["good_loss"]))
    if precision == "fp16":
        assert r["scale_after"] == r["scale_before"] / 2  # the dynamic loss scaler backed off
    else:
        assert r["scale_before"] == r["scale_after"] == 1.0


def test_deterministic_runs_repeat_bit_for_bit(results: dict) -> None:
    a, b = results["deterministic"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_schedule_warmup_then_cosine() -> None:
    cfg = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg, 110) for s in range(110)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:], strict=False))
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)
    # decay_steps decouples the schedule from train.steps, so a run can stop early and resume on it
    cfg.decay_steps = 220
    assert lr_at(109, cfg, 110) > 0.5
