"""Loss spikes that never kill a healthy run, and the data window a rollback leaves out.

* The default rule on the bump that stopped a healthy run (``plait train`` of a 4-layer GPT at lr 3e-3 without
  warm-up: step 66, loss 4.1496 against a running median of 3.2868): not a spike (it is inside the warm-up, and
  26% above the median is under the 50% jump); the former rule (6 robust deviations alone) flagged it. A real
  spike after the warm-up is flagged, and the limit is the larger of the two bounds.
* Two corrupted global batches close together (random targets: a loss spike made by the data), the issue's
  command otherwise (2 workers, lr 3e-3, no warm-up, deterministic). The first spike's rollback leaves its window
  out; the training after it meets the second corrupted batch before the next checkpoint. The former code then
  rolled back to the same checkpoint leaving out only the first window again, so the very same batches came back
  and the spike with them, bit for bit, until ``TrainingDiverged: ... after 3 rollbacks``. Now each deterministic
  replay names the data as the cause, the second rollback leaves out everything up to the second spike, and the
  run ends. The skipped samples (which include every corrupted one) are in the log, in ``fault.jsonl`` and in the
  checkpoint's loader state; a resume from the rollback's checkpoint (a crash before the next save) leaves out
  the same samples and ends with the same weights, bit for bit.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import run_weights

from plait.config import Config
from plait.config_sections import FaultConfig
from plait.fault.recovery import Recovery, TrainingDiverged
from plait.fault.spikes import SpikeDetector

CORRUPT = """
    import torch

    from plait.data.corpus import embedded_corpus_bytes
    from plait.data.loader import DistributedBatchSampler
    from plait.data.text import TokenWindows


    class Corrupted(torch.utils.data.Dataset):
        '''The embedded corpus in windows; the samples of some global batches get random targets (a testing aid).'''

        def __init__(self, windows, bad):
            self.windows, self.bad = windows, set(bad)

        def __len__(self):
            return len(self.windows)

        def __getitem__(self, i):
            x, y = self.windows[i]
            if i in self.bad:
                y = torch.randint(256, y.shape, generator=torch.Generator().manual_seed(i))
            return x, y


    def build(batches=(), seed=7, global_batch=8, seq_len=32):
        tokens = torch.frombuffer(bytearray(embedded_corpus_bytes()), dtype=torch.uint8).long()
        train, held = TokenWindows(tokens[:-20000], seq_len), TokenWindows(tokens[-20000:], seq_len, limit=64)
        # the data order of plait's loader depends on (seed, epoch, number of samples) alone
        order = DistributedBatchSampler(len(train), global_batch, dp_rank=0, dp_size=1, seed=seed)._order(0)
        bad = [int(i) for b in batches for i in order[b * global_batch:(b + 1) * global_batch]]
        return Corrupted(train, bad), held
"""
# the command, shortened: 2 workers, micro-batch 4, global batch 8, fp32, deterministic, seed 7, lr 3e-3
# without warm-up; a smaller GPT and window so that the run is over in seconds
ARGS = ["--model.n_layer=2", "--model.d_model=32", "--model.n_head=2", "--model.seq_len=32", "--model.vocab_size=256",
        "--data.factory=corrupt:build", "--train.micro_batch_size=4", "--train.global_batch_size=8",
        "--train.precision=fp32", "--train.deterministic=true", "--train.seed=7", "--optim.lr=0.003",
        "--optim.warmup_steps=0", "--checkpoint.every=45", "--parallel.nproc=2", "--fault.spike_window=20",
        "--fault.max_restarts=0", "--train.eval_every=0", "--train.eval_sequences=16", "--observe.progress=false",
        "--observe.trackers=[]"]
BAD = [49, 53]  # global batches (0-based): those of steps 50 and 54 in data order


def _train(tmp: Path, *args: str, flags: list[str] = ARGS) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "plait.cli", "train", *flags, *args], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=300)


def _events(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "fault.jsonl").read_text().splitlines()]


def _loader_state(checkpoint: Path) -> dict:
    return torch.load(checkpoint / "state.pt", weights_only=True)["dataloader"]


def test_the_reported_bump_is_no_spike_and_a_real_one_is() -> None:
    f = FaultConfig()
    g = torch.Generator().manual_seed(0)
    history = (3.2868 + 0.05 * torch.randn(65, generator=g, dtype=torch.float64)).tolist()

    def fed(detector: SpikeDetector) -> SpikeDetector:
        for step, x in enumerate(history, 1):
            detector.observe(x, 1.0, step)
        return detector

    old = fed(SpikeDetector(f.spike_threshold, f.spike_window))  # the former rule: deviations alone, no warm-up
    assert old.observe(4.1496, 1.0, 66) == "spike"
    after = max(30, 2 * f.spike_window)  # plait train's default warm-up: max(optim.warmup_steps, 2 x window)
    new = fed(SpikeDetector(f.spike_threshold, f.spike_window, jump=f.spike_jump, after_steps=after))
    assert not new.judging(66) and new.observe(4.1496, 1.0, 66) is None
    # past the warm-up the same window judges: 26% above the median is no spike, 60% above is
    assert new.judging(after + 1) and new.observe(4.1496, 1.0, after + 1) is None
    median = new.median()
    assert new.limit() == max(median * (1 + f.spike_jump), new.limit()) and new.limit() >= 1.5 * median
    assert new.observe(1.6 * median, 1.0, after + 2) == "spike"
    assert new.observe(float("nan"), 1.0, after + 3) == "nonfinite"


def test_with_no_rollback_left_only_a_loss_that_does_not_come_back_stops(tmp_path: Path) -> None:
    """No checkpoint to roll back to: spikes are warnings, however many, as long as the loss comes back within
    fault.spike_patience steps; a loss that stays above the limit that long is TrainingDiverged."""
    import types

    trainer = types.SimpleNamespace(cfg=Config(), run_dir=tmp_path, rank0=True, log=logging.getLogger("spikes"),
                                    p=types.SimpleNamespace(prometheus=None, barrier=lambda: None),
                                    state=types.SimpleNamespace(step=0))
    recovery, step = Recovery(trainer), 0
    patience = trainer.cfg.fault.spike_patience

    def losses(values: list[float]) -> bool:
        nonlocal step
        history = []
        for x in values:
            step += 1
            history.append({"step": step, "global_loss": x, "grad_norm": 1.0})
        return recovery.after_step({"step": step, "step_s": 0.1, "history": history})

    healthy = [3.0 + 0.01 * (i % 7) for i in range(150)]
    assert not losses(healthy)
    assert not losses([6.0] * (patience - 1) + healthy[:5])  # up for patience - 1 steps, then back: no stop
    assert not losses([6.0] * 3 + [3.0] + [6.0] * (patience - 1))  # each run of spikes shorter than the patience
    spikes = [e for e in _events(tmp_path) if e["event"] == "spike"]
    assert len(spikes) == 2 * patience + 1 and not any(e.get("rolled_back", True) for e in spikes)
    with pytest.raises(TrainingDiverged, match="does not come back"):
        losses([6.0])  # the last run of spikes reaches the patience


def test_data_spikes_are_left_out_and_a_resume_leaves_out_the_same(tmp_path: Path) -> None:
    (tmp_path / "corrupt.py").write_text(textwrap.dedent(CORRUPT))
    bad = ",".join(map(str, BAD))
    run = _train(tmp_path, "--train.steps=70", f"--data.args.batches=[{bad}]", "--run.dir=spiky")
    assert run.returncode == 0, run.stderr[-3000:]
    log, root = run.stderr, tmp_path / "spiky"
    summary = json.loads((root / "summary.json").read_text())
    assert summary["steps"] == 70 and summary["rollbacks"] == 4 and summary["replays"] == 2
    assert summary["left_out_batches"] == 9
    events = _events(root)
    spikes = [(e["step"], e["replay"]) for e in events if e["event"] == "spike"]
    # step 50 (batch 49), replayed, then left out; then step 49 of the new timeline (batch 49 + 5 = 54th: index 53)
    assert spikes == [(50, True), (50, False), (49, True), (49, False)], events
    replays = [e for e in events if e["event"] == "replay"]
    assert [r["reproduced"] for r in replays] == [True, True] and all(r["loss"] == r["spike_loss"] for r in replays)
    assert log.count("reproduced the spike bit for bit") == 2 and "it is the data" in log
    skips = [e for e in events if e["event"] == "skip"]
    assert [(s["at_step"], s["until"]) for s in skips] == [(45, 50), (45, 54)]
    skipped = [e for e in events if e["event"] == "skipped"]
    # every load of step 45 after a rollback leaves the window out: 5 batches, then all 9 up to the second spike
    assert [(s["at_step"], s["batches"]) for s in skipped] == [(45, 5), (45, 5), (45, 9)]
    sys.path.insert(0, str(tmp_path))
    try:
        import corrupt

        bad_ids = set(corrupt.build(BAD)[0].bad)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("corrupt", None)
    ids = skipped[-1]["samples"]
    assert len(ids) == 9 * 8 == len(set(ids)) and bad_ids <= set(ids)
    assert "leaving out 9 global batches (samples " + ", ".join(map(str, ids[:16])) in log
    # the checkpoint's data position state holds the window; its samples are the logged ones
    state = _loader_state(root / "checkpoints" / "step_0000070")
    assert state["skipped"] == [0, 45, 9] and state["position"] == 70 + 9

    # A crash after the rollback and before the next save: resume from step 45 with the fault log
    resumed = tmp_path / "resumed"
    shutil.copytree(root, resumed, ignore=shutil.ignore_patterns("step_0000070", "model", "summary.json"))
    (resumed / "checkpoints" / "latest").write_text("step_0000045")
    again = _train(tmp_path, "--resume", str(resumed), flags=[])
    assert again.returncode == 0, again.stderr[-3000:]
    later = [e for e in _events(resumed) if e["event"] == "skipped"][len(skipped):]
    assert [(e["at_step"], e["batches"], e["samples"]) for e in later] == [(45, 9, ids)]
    a, b = run_weights(root), run_weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
