"""The command line end to end: resume equivalence, launcher failures, and bad input.

These run ``plait`` as a user would, in a subprocess, with 2 local workers under the elastic agent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

TINY = [
    "--model.n_layer=2", "--model.d_model=32", "--model.n_head=2", "--model.seq_len=32",
    "--train.global_batch_size=8", "--train.micro_batch_size=2", "--train.eval_sequences=8",
    "--train.eval_every=0", "--train.log_every=1", "--optim.warmup_steps=2", "--observe.progress=false",
    "--observe.trackers=[]", "--parallel.nproc=2",
]


def plait(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "plait.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _ok(p: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def test_resume_equals_uninterrupted(tmp_path: Path) -> None:
    """3 steps, then resume to 6, ends with exactly (bit for bit) the parameters of 6 straight steps."""
    det = TINY + ["--train.deterministic=true", "--optim.decay_steps=6", "--checkpoint.every=0"]
    _ok(plait("train", *det, "--train.steps=6", f"--run.dir={tmp_path}/straight", cwd=tmp_path))
    _ok(plait("train", *det, "--train.steps=3", f"--run.dir={tmp_path}/split", cwd=tmp_path))
    resumed = _ok(plait("train", "--resume", f"{tmp_path}/split", "--train.steps=6", cwd=tmp_path))
    assert "resumed from" in resumed.stderr
    a = load_file(f"{tmp_path}/straight/model.safetensors")
    b = load_file(f"{tmp_path}/split/model.safetensors")
    for k in a:
        assert torch.equal(a[k], b[k]), k
    losses = [json.loads(x).get("loss") for x in Path(tmp_path, "split/metrics.jsonl").read_text().splitlines()]
    straight = [json.loads(x).get("loss") for x in Path(tmp_path, "straight/metrics.jsonl").read_text().splitlines()]
    assert [x for x in losses if x is not None] == [x for x in straight if x is not None]
    summary = json.loads(Path(tmp_path, "split/summary.json").read_text())
    assert summary["steps"] == 6 and summary["world_size"] == 2


def test_sample_from_finished_run(tmp_path: Path) -> None:
    _ok(plait("train", *TINY, "--train.steps=2", "--parallel.nproc=1", f"--run.dir={tmp_path}/r", cwd=tmp_path))
    out = _ok(plait("sample", f"{tmp_path}/r", "--prompt", "def ", "--tokens", "20", cwd=tmp_path))
    assert out.stdout.startswith("def ") and len(out.stdout.encode()) >= 20


def test_failing_worker_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "odd.bin"
    bad.write_bytes(b"\x01\x02\x03")  # an odd byte count cannot be uint16 tokens: every worker fails loading it
    p = plait("train", *TINY, "--train.steps=2", f"--data.path={bad}", f"--run.dir={tmp_path}/f", cwd=tmp_path)
    assert p.returncode == 1
    assert "plait: error: rank " in p.stderr and "failed: DataError:" in p.stderr and "odd number of bytes" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--train.stepz=3"], "unknown config key 'train.stepz'; did you mean 'train.steps'?"),
    (["--parallel.dp=3"], "parallel degrees dp=3 x tp=1 x pp=1 = 3 do not match the world size 2"),
    (["--train.global_batch_size=10", "--train.micro_batch_size=4"],
     "train.global_batch_size=10 must equal micro_batch_size (4) x dp (2) x accumulation steps; try"),
    (["--data.path=/nonexistent/corpus.txt"], "data file /nonexistent/corpus.txt does not exist"),
    (["--resume", "EMPTY"], "holds no checkpoint to resume from"),
    (["--parallel.pp=2", "--model.n_layer=1"], "2 pipeline stages (pp=2 x 1 per rank) but model.n_layer=1"),
    (["--parallel.tp=2", "--model.n_head=3", "--model.d_model=96"], "model.n_head=3 does not divide by parallel.tp=2"),
    (["--parallel.pp=2", "--parallel.pp_schedule=interleaved", "--parallel.microbatches=1"],
     "schedule 'interleaved' needs at least as many micro-batches as pipeline stages"),
    (["--parallel.zero=3", "--parallel.nproc=1"], "parallel.zero=3 shards model state across the data-parallel ranks"),
    (["--parallel.zero=2", "--parallel.offload=optimizer"], "this run trains on the CPU"),
    (["--parallel.zero=1", "--parallel.offload=params"], "parallel.offload=params needs parallel.zero=3"),
    (["--parallel.zero=3", "--parallel.dp_shard=3"], "parallel.dp_shard=3 does not divide the 2 data-parallel ranks"),
    (["--parallel.dp_shard=2"], "parallel.dp_shard=2 sets the shard groups of hybrid sharding, which shards "
                                "parameters with FSDP2 (ZeRO-3); set parallel.zero=3"),
])
def test_bad_input_gives_clear_message(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "EMPTY").mkdir()
    p = plait("train", *[a.replace("EMPTY", str(tmp_path / "EMPTY")) for a in args], cwd=tmp_path)
    assert p.returncode == 2
    assert message.replace("EMPTY", str(tmp_path / "EMPTY")) in p.stderr
    assert "Traceback" not in p.stderr


def test_refuses_to_overwrite_a_run(tmp_path: Path) -> None:
    _ok(plait("train", *TINY, "--train.steps=1", "--parallel.nproc=1", f"--run.dir={tmp_path}/r", cwd=tmp_path))
    p = plait("train", *TINY, "--train.steps=1", "--parallel.nproc=1", f"--run.dir={tmp_path}/r", cwd=tmp_path)
    assert p.returncode == 2 and f"continue it with --resume {tmp_path}/r" in p.stderr
