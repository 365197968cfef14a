"""What the tests share: ``run_ranks`` (spawned gloo ranks, ``plait.runtime.spawn``), the command line in a
subprocess (``plait_cli``, ``TINY_CLI``) and checks on finished runs.

``run_ranks(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks
(one thread each) and returns the results by rank; a rank that raises or dies makes it raise
``SpawnError`` with that rank's traceback; a group that hangs fails after ``timeout`` seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from plait.models.tiny import model_flags, tiny_config
from plait.runtime.spawn import spawn_ranks

# A 2-worker ``plait train`` of the tiny GPT: seconds per step, no evaluation, no progress bar.
TINY_CLI = [
    *model_flags(tiny_config(seq_len=32)), "--train.global_batch_size=8", "--train.micro_batch_size=2",
    "--train.eval_sequences=8", "--train.eval_every=0", "--train.log_every=1", "--optim.warmup_steps=2",
    "--observe.progress=false", "--observe.trackers=[]", "--parallel.nproc=2",
]


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0,
              pg_timeout_s: float = 60.0) -> list[Any]:
    """``spawn_ranks`` under the name and keywords the tests use; the group is named after ``fn``."""
    return spawn_ranks(fn, world_size, *args, timeout_s=timeout, pg_timeout_s=pg_timeout_s, name=fn.__name__)


def cli_env(**extra: str) -> dict[str, str]:
    """The environment the command-line tests run ``plait`` in: one thread per process, unbuffered output."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def cli_argv(*args: str) -> list[str]:
    """The command line of ``plait ARGS`` run by this interpreter."""
    return [sys.executable, "-m", "plait.cli", *args]


def jsonl_records(path: Path) -> list[dict]:
    """The JSON lines of ``path`` (none when it does not exist yet)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def launch_replicas(out: Path, *args: str, kill: tuple[str, int] | None = None, timeout: float = 400) -> dict:
    """``plait run ARGS`` (a replica-group launch) in ``out``; with ``kill`` (records file, step), SIGKILL the process
    writing that file (its records carry ``pid`` and ``step``) once it recorded the step. Returns the exit code, the
    (pid, step) killed and the launcher's log."""
    log = open(out / "launcher.log", "w")
    proc = subprocess.Popen(cli_argv("run", *args), env=cli_env(), stdout=log, stderr=subprocess.STDOUT, cwd=out,
                            start_new_session=True)
    killed = None
    try:
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            if kill is not None and killed is None:
                recs = [r for r in jsonl_records(out / kill[0]) if "step" in r]
                if recs and recs[-1]["step"] >= kill[1]:
                    killed = recs[-1]["pid"], recs[-1]["step"]
                    os.kill(killed[0], signal.SIGKILL)
            time.sleep(0.2)
        rc = proc.poll()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    return {"out": out, "rc": rc, "killed": killed, "log": (out / "launcher.log").read_text()}


def plait_cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """``plait ARGS`` in ``cwd`` as a user runs it (``cli_env``), output captured."""
    return subprocess.run(cli_argv(*args), cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=timeout)


def run_all(commands: dict[Any, list[str]], *, cwd: Path | None = None, env: dict | None = None,
            envs: dict[Any, dict] | None = None, timeout: float = 180) -> dict[Any, subprocess.CompletedProcess]:
    """Start every command at once (they share the start-up time), wait for each (``timeout`` seconds at the
    most), kill whatever is still running; the finished processes by the commands' keys. ``envs`` gives a
    command its own environment instead of ``env``."""
    procs = {key: subprocess.Popen(argv, cwd=cwd, env=(envs or {}).get(key, env), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
             for key, argv in commands.items()}
    done = {}
    try:
        for key, proc in procs.items():
            out, err = proc.communicate(timeout=timeout)
            done[key] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return done


def succeeded(p: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """``p``, after checking it exited 0 (else the end of its stderr is the failure message)."""
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def logged_losses(run_dir: str) -> list[float]:
    """The training losses a run logged in metrics.jsonl, in step order."""
    import json
    from pathlib import Path

    lines = [json.loads(x) for x in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines if "loss" in r]


def run_weights(run_dir: Any) -> dict:
    """The weights a run exported at its end (``RUN_DIR/model/``, a Hugging Face directory), whole."""
    from plait.checkpoint.hf import read_weights

    return read_weights(run_dir)


def assert_same_training(ref_dir: str, got_dir: str, *, atol: float, loss_tol: float, steps: int) -> None:
    """Two runs ended with the same exported weights (within ``atol``) after logging the same
    ``steps`` losses (within ``loss_tol``), and training did move the weights."""
    import torch
    ref, got = run_weights(ref_dir), run_weights(got_dir)
    assert ref.keys() == got.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=atol, rtol=0, msg=f"{got_dir}: {k}")
    a, b = logged_losses(ref_dir), logged_losses(got_dir)
    assert len(a) == len(b) == steps
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < loss_tol
    assert a[-1] < a[0]


class CollectiveCounter(TorchDispatchMode):
    """Counts every c10d operator issued inside (plait's own, DDP's, torch's, functional ones included)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if getattr(func, "namespace", "") in ("c10d", "_c10d_functional"):
            self.calls += 1
        return func(*args, **(kwargs or {}))


class NetnsPair:
    """Two network namespaces joined by a veth pair, one address each (made on ``__enter__``, removed on
    ``close``/``__exit__``, which kills every process in them); the names carry this process's id, so two test runs on
    one machine each make their own. Skips the test with the reason where namespaces cannot be made."""

    def __init__(self, ns: tuple[str, str], dev: tuple[str, str], addr: tuple[str, str]) -> None:
        tag = os.getpid() % 100000
        self.ns = (f"{ns[0]}{tag}", f"{ns[1]}{tag}")
        self.dev = (f"{dev[0]}{tag}", f"{dev[1]}{tag}")  # device names: at most 15 characters
        self.addr = addr

    def __enter__(self) -> NetnsPair:
        import pytest

        if os.geteuid() != 0:
            pytest.skip("network namespaces need root")
        self.close()
        steps = [["ip", "netns", "add", self.ns[0]], ["ip", "netns", "add", self.ns[1]],
                 ["ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1]]]
        for ns, dev, addr in zip(self.ns, self.dev, self.addr, strict=True):
            steps += [["ip", "-n", ns, "link", "set", "lo", "up"], ["ip", "link", "set", dev, "netns", ns],
                      ["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev],
                      ["ip", "-n", ns, "link", "set", dev, "up"]]
        for cmd in steps:
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                self.close()
                pytest.skip(f"network namespaces are not available here ({' '.join(cmd)}: {out.stderr.strip()})")
        return self

    def close(self, *exc: object) -> None:
        import contextlib
        import signal

        for ns in self.ns:
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    __exit__ = close
