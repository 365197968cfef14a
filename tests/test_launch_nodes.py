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

STEPS = 60
# Slow enough that each phase lasts a few steps while a launcher starts: rank 0 sleeps after its compute (a testing
# aid that changes no number; its sleep grows with the compute, so with the machine's load). The test waits for
# logged steps and checkpoints, never for a time; the steps after the return only give the returning launcher room.
ARGS = ["--model.n_layer=1", "--model.d_model=32", "--model.n_head=2", "--model.seq_len=16", f"--train.steps={STEPS}",
        "--train.global_batch_size=4", "--train.micro_batch_size=1", "--train.eval_every=0", "--train.log_every=1",
        "--train.eval_sequences=4", "--optim.warmup_steps=1", "--observe.progress=false", "--observe.trackers=[]",
        "--checkpoint.every=2", "--fault.max_restarts=3", "--fault.slow_rank=0", "--fault.slow_factor=100"]
# A dead node is noticed after 10 s without a heartbeat (torch's default: 15 s). A live agent's heartbeats come about
# a second apart, but later on a loaded machine, and an agent waiting in a rendezvous sends them from its polling
# loop: with 3 s (keep_alive_max_attempt=3) the loaded test machine saw live agents dropped, the joining one
# from each new round (the first restarted alone, again and again) or the running one (the joining agent then
# started a second world-1 group from the checkpoint while the first went on: two groups in one run directory).
# A joining agent has the last call (5 s) to enter the round the running agent opens for it; on the loaded machine
# it took over 3 s at times, and then the running agent formed the round alone and restarted once more for it.
NODES = ["--nnodes", "1:2", "--rdzv-id", "two-agents",
         "--rdzv-conf", "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=10"]


def _start(tmp: Path, endpoint: str, name: str, *args: str) -> subprocess.Popen:
    """One simulated machine: its launcher (agent and worker) in a process group of its own, its output in
    ``tmp/<name>.log`` (a pipe read only at the end could fill and stop it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(tmp / f"{name}.log", "w") as log:
        return subprocess.Popen([sys.executable, "-m", "plait.cli", "train", *args, "--parallel.nproc=1", *NODES,
                                 "--rdzv-endpoint", endpoint], cwd=tmp, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _output(tmp: Path, name: str, chars: int = 3000) -> str:
    return f"--- {name} ---\n" + (tmp / f"{name}.log").read_text(errors="replace")[-chars:]


def _worlds(run: Path) -> list[tuple[int, int]]:
    """(step, world size) of every logged step, in the order written (metrics of undone steps are cut on resume)."""
    path = run / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        rec = json.loads(line)
        if rec.get("rank_step_s"):
            out.append((rec["step"], len(rec["rank_step_s"])))
    return out


def _resumes(run: Path) -> list[tuple[int, int | None]]:
    """(step resumed from, step the workers saved at when stopped for it, or None after a failure) of each resume,
    from the run's goodput events."""
    out, stopped = [], None
    for line in (run / "goodput.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "preempted":
            stopped = event["step"]
        elif event["event"] == "resume":
            out.append((event["step"], stopped))
            stopped = None
    return out


def _latest_step(run: Path) -> int:
    pointer = run / "checkpoints" / "latest"  # names the newest complete checkpoint, step_0000015
    return int(pointer.read_text().strip().rpartition("_")[2]) if pointer.is_file() else 0


def _listening(endpoint: str) -> bool:
    host, port = endpoint.rsplit(":", 1)
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) == 0


def _wait(what: str, check, procs: dict[str, subprocess.Popen], run: Path, timeout_s: float = 120) -> None:
    """Until ``check()`` holds; fails at once when the first launcher (it hosts the rendezvous) has ended, the time
    limit only guards against a hang. The launchers' logs are in run's parent."""
    deadline = time.time() + timeout_s
    while not check():
        if time.time() > deadline or procs["first"].poll() is not None:
            for p in procs.values():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            logs = "\n".join(_output(run.parent, name, 2500) for name in procs)
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
    first = _start(tmp_path, endpoint, "first", *ARGS, f"--run.dir={run}")
    procs = {"first": first}
    try:
        _wait("the first agent's rendezvous store", lambda: _listening(endpoint), procs, run)  # it hosts it, and stays
        _wait("a checkpoint at world 1", lambda: (run / "checkpoints" / "latest").is_file(), procs, run)
        second = _start(tmp_path, endpoint, "second", "--resume", str(run))
        procs["second"] = second
        _wait("steps at world 2 after it joined", _new_steps_at(run, 2, 2), procs, run)
        joined_at = next(s for s, w in _worlds(run) if w == 2)
        # a checkpoint saved at world 2, so that steps there stay logged when the run resumes without it
        _wait("a checkpoint at world 2", lambda: _latest_step(run) >= joined_at, procs, run)
        saved_before_leaving = _latest_step(run)
        os.killpg(second.pid, signal.SIGKILL)  # the machine is gone: agent and worker at once
        second.wait(timeout=30)
        _wait("steps at world 1 after it left", _new_steps_at(run, 1, 2), procs, run)
        back = _start(tmp_path, endpoint, "back", "--resume", str(run))
        procs["back"] = back
        _wait("steps at world 2 after it returned", _new_steps_at(run, 2, 2), procs, run)
        first.wait(timeout=120)
        back.wait(timeout=60)
    finally:
        for p in procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
    assert first.returncode == 0, _output(tmp_path, "first")
    assert back.returncode == 0, _output(tmp_path, "back")
    worlds = _worlds(run)
    phases = [w for i, (_, w) in enumerate(worlds) if i == 0 or w != worlds[i - 1][1]]
    assert phases == [1, 2, 1, 2], worlds
    assert [s for s, _ in worlds] == list(range(1, STEPS + 1)), worlds  # every step once, in order, to the end
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["world_size"] == 2
    assert summary["failures"] >= 1  # the machine that died
    assert summary["preemptions"] >= 2  # the join and the return: the workers stopped and saved for each
    resumes = _resumes(run)
    # A join and the return stop the running workers, which save at the step boundary: the group goes on from there.
    assert [step for step, stopped in resumes if stopped is not None] == [
        stopped for _, stopped in resumes if stopped is not None], resumes
    assert sum(stopped is not None for _, stopped in resumes) >= 2, resumes
    # The machine that died saved nothing: the group goes on from the newest checkpoint saved before it died.
    after_leaving = [step for step, stopped in resumes if stopped is None]
    assert after_leaving and min(after_leaving) >= saved_before_leaving, (saved_before_leaving, resumes)
