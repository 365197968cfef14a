"""``plait train --nnodes 1:2`` on two simulated machines: two launchers on this machine, one worker each, meeting at
the first one's c10d rendezvous. The run trains at world 2; the second machine dies (its whole process group killed,
as a node that loses power); the first continues alone at world 1 from the newest checkpoint and finishes.
(A machine that comes back is not tested here yet: see docs/clusters.md.)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from plait.runtime.spawn import free_port

# Slow enough to see each phase: rank 0 sleeps after its compute (a testing aid that changes no number).
ARGS = ["--model.n_layer=1", "--model.d_model=32", "--model.n_head=2", "--model.seq_len=16", "--train.steps=30",
        "--train.global_batch_size=4", "--train.micro_batch_size=1", "--train.eval_every=0", "--train.log_every=1",
        "--train.eval_sequences=4", "--optim.warmup_steps=1", "--observe.progress=false", "--observe.trackers=[]",
        "--checkpoint.every=5", "--fault.max_restarts=3", "--fault.slow_rank=0", "--fault.slow_factor=30",
        "--parallel.nproc=1"]


def _start(tmp: Path, endpoint: str, *args: str) -> subprocess.Popen:
    nodes = ["--nnodes", "1:2", "--rdzv-endpoint", endpoint, "--rdzv-id", "two-agents",
             "--rdzv-conf", "last_call_timeout=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "plait.cli", "train", *args, *nodes], cwd=tmp, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _worlds(run: Path) -> list[tuple[int, int]]:
    """(step, world size) of every logged step, in the order written (metrics of undone steps are cut on resume)."""
    path = run / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        rec = json.loads(line)
        if rec.get("rank_step_s"):
            out.append((rec["step"], len(rec["rank_step_s"])))
    return out


def _listening(endpoint: str) -> bool:
    host, port = endpoint.rsplit(":", 1)
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) == 0


def _wait(what: str, check, procs: list[subprocess.Popen], timeout_s: float = 120) -> None:
    deadline = time.time() + timeout_s
    while not check():
        if time.time() > deadline or all(p.poll() is not None for p in procs):
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            outs = [p.communicate()[0] or "" for p in procs]
            logs = "\n".join(o[-2500:] for o in outs)
            raise AssertionError(f"timed out waiting for {what}\n{logs}")
        time.sleep(0.2)


def test_an_agent_leaving_keeps_the_run_going(tmp_path: Path) -> None:
    run = tmp_path / "run"
    endpoint = f"127.0.0.1:{free_port()}"
    first = _start(tmp_path, endpoint, *ARGS, f"--run.dir={run}")
    procs = [first]
    try:
        _wait("the first agent's rendezvous store", lambda: _listening(endpoint), procs)  # it hosts it, and stays
        second = _start(tmp_path, endpoint, *ARGS, f"--run.dir={run}")
        procs.append(second)
        _wait("steps at world 2", lambda: sum(w == 2 for _, w in _worlds(run)) >= 8, procs)
        os.killpg(second.pid, signal.SIGKILL)  # the machine is gone: agent and worker at once
        second.wait(timeout=30)
        _wait("steps at world 1 after it left", lambda: sum(w == 1 for s, w in _worlds(run)) >= 5, procs)
        out_first, _ = first.communicate(timeout=240)
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
    assert first.returncode == 0, out_first[-3000:]
    worlds = _worlds(run)
    phases = [w for i, (_, w) in enumerate(worlds) if i == 0 or w != worlds[i - 1][1]]
    assert phases == [2, 1], worlds
    steps = [s for s, _ in worlds]
    assert steps == sorted(set(steps)) and steps[-1] == 30  # every step once, in order, to the end
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["world_size"] == 1
    assert summary["failures"] >= 1  # the machine that died
