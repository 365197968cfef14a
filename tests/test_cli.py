"""The command line end to end: resume equivalence, launcher failures, and bad input.

Runs that train start ``plait`` as a user would, in a subprocess, with 2 local workers under the elastic
agent; commands that start no worker (configuration errors, sampling) go through ``plait.cli.main`` here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import TINY_CLI, cli_argv, cli_env, plait_cli, run_all, run_weights, succeeded

from plait.cli import main


def _in_process(argv: list[str], cwd: Path, monkeypatch: pytest.MonkeyPatch,
                capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """``plait ARGV`` through ``plait.cli.main``, what ``python -m plait.cli`` calls, in this process: for a
    command that starts no worker (a configuration error: the exit code and one line of a separate process are
    tested in engine/test_errors.py; sampling), a process of its own would only add start-up."""
    monkeypatch.chdir(cwd)
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_resume_equals_uninterrupted(tmp_path: Path) -> None:
    """3 steps, then resume to 6, ends with exactly (bit for bit) the parameters of 6 straight steps."""
    det = TINY_CLI + ["--train.deterministic=true", "--optim.decay_steps=6", "--checkpoint.every=0"]
    # side by side: deterministic, so the same results whatever speed they share
    first = run_all({name: cli_argv("train", *det, f"--train.steps={steps}", f"--run.dir={tmp_path}/{name}")
                     for name, steps in (("straight", 6), ("split", 3))}, cwd=tmp_path, env=cli_env(), timeout=300)
    for p in first.values():
        succeeded(p)
    resumed = succeeded(plait_cli("train", "--resume", f"{tmp_path}/split", "--train.steps=6", cwd=tmp_path))
    assert "resumed from" in resumed.stderr
    a = run_weights(f"{tmp_path}/straight")
    b = run_weights(f"{tmp_path}/split")
    for k in a:
        assert torch.equal(a[k], b[k]), k
    losses = [json.loads(x).get("loss") for x in Path(tmp_path, "split/metrics.jsonl").read_text().splitlines()]
    straight = [json.loads(x).get("loss") for x in Path(tmp_path, "straight/metrics.jsonl").read_text().splitlines()]
    assert [x for x in losses if x is not None] == [x for x in straight if x is not None]
    summary = json.loads(Path(tmp_path, "split/summary.json").read_text())
    assert summary["steps"] == 6 and summary["world_size"] == 2


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished one-process run (sampled from, and not to be overwritten)."""
    root = tmp_path_factory.mktemp("cli")
    succeeded(plait_cli("train", *TINY_CLI, "--train.steps=2", "--parallel.nproc=1", f"--run.dir={root}/r", cwd=root))
    return root / "r"


def test_sample_from_finished_run(finished_run: Path, monkeypatch, capsys) -> None:
    code, out, err = _in_process(["sample", str(finished_run), "--prompt", "def ", "--tokens", "20"],
                                 finished_run.parent, monkeypatch, capsys)
    assert code == 0, err
    assert out.startswith("def ") and len(out.encode()) >= 20


def test_failing_worker_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "odd.bin"
    bad.write_bytes(b"\x01\x02\x03")  # an odd byte count cannot be uint16 tokens: every worker fails loading it
    p = plait_cli("train", *TINY_CLI, "--train.steps=2", f"--data.path={bad}", f"--run.dir={tmp_path}/f", cwd=tmp_path)
    assert p.returncode == 1
    assert "plait: error: rank " in p.stderr and "failed: DataError:" in p.stderr and "odd number of bytes" in p.stderr
    assert "Traceback" not in p.stderr


BAD_INPUT = [
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
]


@pytest.mark.parametrize(("args", "message"), BAD_INPUT)
def test_bad_input_gives_clear_message(tmp_path: Path, monkeypatch, capsys, args: list[str], message: str) -> None:
    (tmp_path / "EMPTY").mkdir()
    code, _, err = _in_process(["train", *[a.replace("EMPTY", str(tmp_path / "EMPTY")) for a in args]], tmp_path,
                               monkeypatch, capsys)
    assert code == 2
    assert message.replace("EMPTY", str(tmp_path / "EMPTY")) in err
    assert "Traceback" not in err


def test_refuses_to_overwrite_a_run(finished_run: Path, monkeypatch, capsys) -> None:
    code, _, err = _in_process(["train", *TINY_CLI, "--train.steps=1", "--parallel.nproc=1",
                                f"--run.dir={finished_run}"], finished_run.parent, monkeypatch, capsys)
    assert code == 2 and f"continue it with --resume {finished_run}" in err
