"""``plait train --nnodes 1:2`` on two simulated machines: two launchers on this machine, one worker each, meeting at
the first one's c10d rendezvous. The first trains alone at world 1; the second joins (the same command with
``--resume``): the first's agent stops its worker, which saves at the step boundary, and the run continues at
world 2 from there. The second machine dies (its whole process group killed, as a node that loses power): the first
continues alone at world 1 from the newest checkpoint. The second comes back (``--resume`` again): world 2 again,
from the step the first saved, to the end.
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

STEPS = 40
# Slow enough that each phase lasts a few steps while a launcher starts: rank 0 sleeps after its compute (a testing
# aid that changes no number). A dead node is noticed after 3 missed heartbeats, one a second (torch's default: 15 s).
ARGS = ["--model.n_layer=1", "--model.d_model=32", "--model.n_head=2", "--model.seq_len=16", f"--train.steps={STEPS}",
        "--train.global_batch_size=4", "--train.micro_batch_size=1", "--train.eval_every=0", "--train.log_every=1",
        "--train.eval_sequences=4", "--optim.warmup_steps=1", "--observe.progress=false", "--observe.trackers=[]",
        "--checkpoint.every=2", "--fault.max_restarts=3", "--fault.slow_rank=0", "--fault.slow_factor=100"]
NODES = ["--nnodes", "1:2", "--rdzv-id", "two-agents",
         "--rdzv-conf", "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"]


def _start(tmp: Path, endpoint: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "plait.cli", "train", *args, "--parallel.nproc=1", *NODES,
                             "--rdzv-endpoint", endpoint], cwd=tmp, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _worlds(run: Path) -> list[tuple[int, int]]:
    """(step, world size) of every logged step, in the order written (metrics of undone steps are cut on resume)."""
    path = run / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        rec = json.loads(line)
        if rec.get("rank_step_s"):
            out.append((rec["step"], len(rec["rank_step_s"])))
    return out


def _latest_step(run: Path) -> int:
    pointer = run / "checkpoints" / "latest"  # names the newest complete checkpoint, step_0000015
    return int(pointer.read_text().strip().rpartition("_")[2]) if pointer.is_file() else 0


def _listening(endpoint: str) -> bool:
    host, port = endpoint.rsplit(":", 1)
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) == 0


def _wait(what: str, check, procs: list[subprocess.Popen], run: Path, timeout_s: float = 60) -> None:
    deadline = time.time() + timeout_s
    while not check():
        if time.time() > deadline or all(p.poll() is not None for p in procs):
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            outs = [p.communicate()[0] or "" for p in procs]
            logs = "\n".join(o[-2500:] for o in outs)
            raise AssertionError(f"timed out waiting for {what}; (step, world) logged: {_worlds(run)}\n{logs}")
        time.sleep(0.2)


def _new_steps_at(run: Path, world: int, n: int):
    """A check: ``n`` more steps logged since it was made, the newest ``n`` at ``world``."""
    since = len(_worlds(run))

    def check() -> bool:
        worlds = _worlds(run)
        return len(worlds) >= since + n and all(w == world for _, w in worlds[-n:])

    return check


def test_an_agent_joining_leaving_and_returning_keeps_the_run_going(tmp_path: Path) -> None:
    run = tmp_path / "run"
    endpoint = f"127.0.0.1:{free_port()}"
    first = _start(tmp_path, endpoint, *ARGS, f"--run.dir={run}")
    procs = [first]
    try:
        _wait("the first agent's rendezvous store", lambda: _listening(endpoint), procs, run)  # it hosts it, and stays
        _wait("a checkpoint at world 1", lambda: (run / "checkpoints" / "latest").is_file(), procs, run)
        second = _start(tmp_path, endpoint, "--resume", str(run))
        procs.append(second)
        _wait("steps at world 2 after it joined", _new_steps_at(run, 2, 2), procs, run)
        joined_at = next(s for s, w in _worlds(run) if w == 2)
        # a checkpoint saved at world 2, so that steps there stay logged when the run resumes without it
        _wait("a checkpoint at world 2", lambda: _latest_step(run) >= joined_at, procs, run)
        os.killpg(second.pid, signal.SIGKILL)  # the machine is gone: agent and worker at once
        second.wait(timeout=30)
        _wait("steps at world 1 after it left", _new_steps_at(run, 1, 2), procs, run)
        back = _start(tmp_path, endpoint, "--resume", str(run))
        procs.append(back)
        _wait("steps at world 2 after it returned", _new_steps_at(run, 2, 2), procs, run)
        out_first, _ = first.communicate(timeout=60)
        out_back, _ = back.communicate(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
    assert first.returncode == 0, out_first[-3000:]
    assert back.returncode == 0, out_back[-3000:]
    worlds = _worlds(run)
    phases = [w for i, (_, w) in enumerate(worlds) if i == 0 or w != worlds[i - 1][1]]
    assert phases == [1, 2, 1, 2], worlds
    assert [s for s, _ in worlds] == list(range(1, STEPS + 1)), worlds  # every step once, in order, to the end
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["world_size"] == 2
    assert summary["failures"] >= 1  # the machine that died
