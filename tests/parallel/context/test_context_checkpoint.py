"""Checkpoints saved under context parallelism resume at cp=1, and the reverse, as if never interrupted.

cp holds no state of its own (the weights and optimizer are whole on every cp rank), but the data position must
resume exactly. Through ``plait train``'s trainer (``build_trainer``, text windows, dropout 0, 3 of 6 AdamW steps
with the LR schedule of 6): 3 steps at cp=2 (2 ranks, ring) then 3 more resumed in one process, and 3 steps in one
process then 3 more resumed at cp=2, each equal to 6 straight steps in one process: every logged loss (steps 1-6,
the resumed half read from the same metrics file) within 2e-5 and every exported weight within 5e-5 (the bounds of
the trainer's resharding tests; float32, the ring merges attention blocks in another order than one process).
Observed: losses 4.8e-7, weights 6.9e-6. A resumed run that read its data from the start again, or lost the
optimizer's state, moves the losses of steps 4-6 by far more.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import run_ranks, run_weights

BASE = [
    "--model.n_layer=2", "--model.d_model=32", "--model.n_head=4", "--model.seq_len=16", "--model.dropout=0",
    "--train.global_batch_size=8", "--train.micro_batch_size=8", "--train.log_every=1", "--train.eval_every=0",
    "--train.eval_sequences=8", "--optim.warmup_steps=1", "--optim.lr=3e-3", "--optim.decay_steps=6",
    "--checkpoint.every=0", "--observe.progress=false", "--observe.trackers=[]", "--train.deterministic=true",
]
CP2 = ["--parallel.cp=2", "--parallel.cp_impl=ring"]


def _train(rank: int, world: int, root: str, variants: dict[str, tuple[list[str], bool]]) -> dict:
    from plait.config import load_config
    from plait.recipes import build_trainer
    from plait.recipes import validate_config as validate

    out = {}
    for name, (extra, resume) in variants.items():
        cfg = validate(load_config(overrides=BASE + extra + [f"--run.dir={root}/{name}"]), world)
        Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
        trainer = build_trainer(cfg)
        if resume:
            trainer.resume()
        trainer.fit()
        out[name] = cfg.run.dir
    return out


def _losses(run_dir: str) -> list[tuple[int, float]]:
    lines = [json.loads(x) for x in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in lines if "loss" in r]


def _context(run_dir: str) -> dict | None:
    """The context-parallel layout the run's summary reports (None: none)."""
    return json.loads(Path(run_dir, "summary.json").read_text()).get("context_parallel")


def test_checkpoint_moves_between_cp_and_one_process(tmp_path: Path) -> None:
    root = str(tmp_path)
    one = run_ranks(_train, 1, root, {"straight": (["--train.steps=6"], False),
                                      "cp1_then_cp2": (["--train.steps=3"], False)})[0]
    two = run_ranks(_train, 2, root, {"cp2_then_cp1": (CP2 + ["--train.steps=3"], False),
                                      "cp1_then_cp2": (CP2 + ["--train.steps=6"], True)}, timeout=400)[0]
    layouts = {name: _context(two[name]) for name in two}  # before the one-process half overwrites the summary
    run_ranks(_train, 1, root, {"cp2_then_cp1": (["--train.steps=6"], True)})
    assert layouts == {"cp2_then_cp1": {"cp": 2, "impl": "ring"}, "cp1_then_cp2": {"cp": 2, "impl": "ring"}}, layouts
    assert _context(two["cp2_then_cp1"]) is None  # the second half ran in one process
    ref_losses, ref_weights = _losses(one["straight"]), run_weights(one["straight"])
    assert [s for s, _ in ref_losses] == [1, 2, 3, 4, 5, 6] and ref_losses[-1][1] < ref_losses[0][1]
    for name in ("cp2_then_cp1", "cp1_then_cp2"):
        losses = _losses(two[name])
        assert [s for s, _ in losses] == [1, 2, 3, 4, 5, 6], (name, losses)  # resumed, not retrained
        assert max(abs(a - b) for (_, a), (_, b) in zip(losses, ref_losses, strict=True)) < 2e-5, name
        got = run_weights(two[name])
        assert got.keys() == ref_weights.keys()
        for k in ref_weights:
            torch.testing.assert_close(got[k], ref_weights[k], atol=5e-5, rtol=0, msg=f"{name}: {k}")
