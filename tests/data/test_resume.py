"""A streamed run killed mid-epoch resumes bit for bit (``plait train``, 2 ranks, 2 reader workers each).

The documents are the Parquet and JSON Lines shards of ``tests/data_common.py`` with its tokenizer,
packed with the document mask, read by the streaming reader (``data.streaming``, ``data.num_workers=2``,
a shuffle buffer), in deterministic fp32. One run trains 12 steps undisturbed; another is SIGKILLed on
rank 1 after step 4 (a checkpoint every 3 steps, so mid-epoch and between checkpoints), restarts by
itself from the step-3 checkpoint, and must log the same 12 losses, bit for bit, and end with the same
weights. Three micro-batches per step and rank: the checkpoint falls after 9 of them, so the next batch
is the second worker's (the saved turn of the round robin matters).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from data_common import make_corpus
from helpers import run_weights

STEPS = 12


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def _start(corpus: dict, run_dir: Path) -> subprocess.Popen:
    root = corpus["root"]
    args = [f"--data.path={root}/[pj][ql]/*", f"--data.tokenizer={corpus['tokenizer']}", "--data.streaming=true",
            "--data.num_workers=2", "--data.shuffle_buffer=64", "--data.document_mask=true",
            "--model.n_layer=2", "--model.d_model=32", "--model.n_head=2", "--model.seq_len=64",
            "--train.global_batch_size=6", "--train.micro_batch_size=1", "--train.eval_sequences=8",
            f"--train.steps={STEPS}", "--train.eval_every=0", "--train.log_every=1", "--train.deterministic=true",
            "--observe.progress=false", "--observe.trackers=[]", "--checkpoint.every=3", "--parallel.nproc=2",
            "--fault.max_restarts=2", "--fault.restart_backoff_s=0.2", "--comm.timeout_s=20",
            f"--run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "plait.cli", "train", *args], cwd=run_dir.parent, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


def _losses(run_dir: Path) -> list[float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines if "loss" in r]


def _kill_after(run_dir: Path, step: int, rank: int, done: list) -> None:
    while not done:
        try:
            steps = int(json.loads((run_dir / "progress.json").read_text())["steps"])
            pid = int((run_dir / "workers" / f"rank{rank}.pid").read_text().split()[0])
        except (OSError, ValueError, KeyError):
            steps, pid = 0, None
        if pid is not None and steps >= step:
            os.kill(pid, signal.SIGKILL)
            done.append(steps)
            return
        time.sleep(0.02)


def test_sigkill_mid_epoch_resumes_bit_for_bit(corpus, tmp_path) -> None:
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    code, err = _finish(_start(corpus, clean))
    assert code == 0, err[-3000:]
    done: list[int] = []
    proc = _start(corpus, killed)
    killer = threading.Thread(target=_kill_after, args=(killed, 4, 1, done), daemon=True)
    killer.start()
    code, err = _finish(proc)
    done.append(-1)  # stops the killer if it never fired
    assert code == 0, err[-3000:]
    assert 4 <= done[0] < 6 and err.count("restart ") == 1, (done, err[-3000:])
    a, b = _losses(clean), _losses(killed)
    assert len(a) == STEPS and a == b  # every step's loss, bit for bit
    wa, wb = run_weights(clean), run_weights(killed)  # the weights each run exported at its end
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a[-1] < a[0]
