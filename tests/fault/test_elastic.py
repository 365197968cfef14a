"""Elastic world size: a run trained at world 4, resumed at 2, then at 3, global batch 12 throughout.

* the state after a change of world size equals the saved state (a resume at world 2 that trains no
  step exports exactly the weights saved at world 4);
* the final parameters match one process trained on the same global batches, within float32 rounding of
  the different reduction orders (3e-5; accumulation 12 x 1 against 3 x 4, 6 x 2 and 4 x 3);
* every training sample is read exactly once (a recording data set logs each index every process reads);
* a world size that cannot keep the global batch is refused, naming the sizes that can.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import torch
from helpers import run_weights

DATA = """
    import os

    from plait.data.corpus import load_splits
    from plait.data.text import TokenWindows


    class Recording(TokenWindows):
        def __getitem__(self, i):
            with open(os.path.join(os.environ["RECORD_DIR"], f"read.{os.getpid()}"), "a") as f:
                f.write(f"{self.offset} {i}\\n")
            return super().__getitem__(i)


    def build(seq_len=32):
        splits = load_splits("", 256, 0.05, seq_len)
        return Recording(splits.train, seq_len, epoch_offsets=True, seed=1), TokenWindows(splits.val, seq_len, limit=8)
"""
ARGS = ["--model.n_layer=2", "--model.d_model=32", "--model.n_head=2", "--model.seq_len=32",
        "--data.factory=elasticdata:build", "--train.global_batch_size=12", "--train.micro_batch_size=1",
        "--optim.decay_steps=6", "--train.eval_every=0", "--train.log_every=1", "--train.deterministic=true",
        "--observe.progress=false", "--observe.trackers=[]", "--checkpoint.every=0"]


def _start(tmp: Path, record: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RECORD_DIR": str(record),
           "PYTHONPATH": os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "plait.cli", "train", *args], cwd=tmp, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _reads(record: Path) -> Counter:
    return Counter(line for f in record.glob("read.*") for line in f.read_text().splitlines())


def test_world_4_then_2_then_3_keeps_the_global_batch(tmp_path: Path) -> None:
    (tmp_path / "elasticdata.py").write_text(textwrap.dedent(DATA))
    elastic, single = tmp_path / "read-elastic", tmp_path / "read-single"
    elastic.mkdir(), single.mkdir()
    run = tmp_path / "run"
    # The one-process reference runs beside the elastic runs (its own directories; deterministic either way).
    one = _start(tmp_path, single, *ARGS, "--parallel.nproc=1", "--train.steps=6", f"--run.dir={tmp_path}/one")
    try:
        steps = [("4", "2"), ("2", "2"), ("2", "4"), ("3", "6")]  # (world, train.steps); 2 -> 2 trains nothing
        for i, (world, until) in enumerate(steps):
            start = ARGS if i == 0 else ["--resume", str(run)]
            out = _finish(_start(tmp_path, elastic, *start, f"--parallel.nproc={world}", f"--train.steps={until}",
                                 f"--run.dir={run}" if i == 0 else "--fault.max_restarts=0"))
            assert out.returncode == 0, out.stderr[-3000:]
            if i == 0:
                saved_at_4 = run_weights(run)
            if i == 1:  # resumed at world 2, no step trained: exactly the state saved at world 4
                resumed = run_weights(run)
                assert all(torch.equal(resumed[k], v) for k, v in saved_at_4.items())
    finally:
        ref = _finish(one)
    assert ref.returncode == 0, ref.stderr[-3000:]
    a, b = run_weights(run), run_weights(tmp_path / "one")
    assert max((a[k] - b[k]).abs().max().item() for k in b) < 3e-5
    reads, expected = _reads(elastic), _reads(single)
    assert sum(expected.values()) == 6 * 12 and max(expected.values()) == 1
    assert reads == expected  # the same 72 samples, each read once across the three world sizes


def test_a_world_that_cannot_keep_the_global_batch_is_refused(tmp_path: Path, capsys) -> None:
    """A configuration error: through ``plait.cli.main`` in this process (it starts no worker)."""
    from plait.cli import main

    code = main(["train", "--train.global_batch_size=12", "--train.micro_batch_size=1", "--parallel.nproc=5",
                 f"--run.dir={tmp_path}/r"])
    err = capsys.readouterr().err
    assert code == 2
    assert "world sizes that keep this global and micro batch: [1, 2, 3, 4, 6, 12]" in err, err
