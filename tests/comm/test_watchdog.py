"""Step watchdog: a rank stuck in a collective that ``Comm`` does not issue still ends with a named error.

Two paths: the watchdog thread itself (a wait the backend does not bound in time, so the thread must
end the process and write the launcher's error file), and the backend's own timeout raised in the
main thread, which ``explain`` names (tensor-parallel and pipeline runs through the CLI).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import cli_argv, run_all

from plait.comm.guard import CollectiveTimeout
from plait.comm.watchdog import StepWatchdog, is_comm_failure
from plait.runtime.spawn import RankGroup

TIMEOUT_S = 2.0
STALL_S = 30.0


def _stall_in_own_code() -> None:
    time.sleep(STALL_S)


def _rank(rank: int, world: int, run_dir: str) -> None:
    wd = StepWatchdog(dist.distributed_c10d._get_default_store(), TIMEOUT_S, rank, world,
                      Path(run_dir) / "errors" / f"rank{rank}.txt", "tensor-parallel", interval_s=0.2,
                      margin_s=1.0)
    wd.enter(1, "forward/backward")
    dist.all_reduce(torch.ones(1))  # everyone completes step 1
    if rank == world - 1:
        _stall_in_own_code()  # never reaches step 1's optimizer phase
    else:
        wd.enter(1, "optimizer")
        (Path(run_dir) / f"blocked{rank}").write_text(str(time.time()))
        dist.all_reduce(torch.ones(1))  # a blocking collective with no plait guard around it
    wd.close()


def test_watchdog_ends_a_rank_blocked_in_an_unguarded_collective(tmp_path) -> None:
    # The process group waits far longer than the watchdog: only the watchdog can end this wait.
    with RankGroup(_rank, 2, (str(tmp_path),), pg_timeout_s=120, name="watchdog") as group:
        rank0 = group.wait(timeout_s=90)[0]  # start-up included, on a loaded machine
    assert rank0.exitcode == 1, rank0  # not a hang, and a non-zero exit
    error = tmp_path / "errors" / "rank0.txt"
    waited = error.stat().st_mtime - float((tmp_path / "blocked0").read_text())
    assert waited < TIMEOUT_S + 5, waited
    text = error.read_text()
    first = text.splitlines()[0]
    assert first.startswith("CollectiveTimeout: step 1 phase 'optimizer' (tensor-parallel collectives)"), first
    assert "rank 0 waited" in first and "torch/distributed" in first, first
    assert "ranks [1] did not arrive (rank 1 last seen at step 1 'forward/backward'" in first, first
    assert "_stall_in_own_code" in first, first
    assert "main thread of rank 0 (seen by the watchdog)" in text  # the blocked stack, for the details


def test_explain_names_backend_failures_only_and_close_leaves_no_thread() -> None:
    store = dist.HashStore()
    wd = StepWatchdog(store, 5.0, 0, 2, None, "pipeline", interval_s=0.1)
    bug = ValueError("shapes do not match")
    assert wd.explain(bug) is bug  # a genuine error stays what it is
    wd.enter(2, "optimizer")
    wd.enter(3, "forward/backward")
    store.set(f"{wd.prefix}/1", "1|2|optimizer|busy|model.py:7 in forward")  # one phase behind
    gloo = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv")
    assert is_comm_failure(gloo) and not is_comm_failure(CollectiveTimeout("x"))
    named = wd.explain(gloo)
    assert isinstance(named, CollectiveTimeout)
    msg = str(named)
    assert msg.startswith("step 3 phase 'forward/backward' (pipeline collectives) did not complete within 5s"), msg
    assert "ranks [1] did not arrive (rank 1 last seen at step 2 'optimizer' in model.py:7" in msg, msg
    assert msg.endswith("backend said: [gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv")
    wd.close()
    assert not [t for t in threading.enumerate() if t.name == "plait-watchdog"]
    with pytest.raises(ValueError, match="positive seconds"):
        StepWatchdog(store, 0, 0, 2)


# Loaded into every Python process of the CLI runs below (via PYTHONPATH): rank 1 stalls inside the
# forward of its first transformer block in step 2, as a rank stuck in its own code would.
_STALL_HOOK = """
import os
import time

from plait.models import gpt
from plait.train import trainer

_step = trainer.Trainer.train_step
_block = gpt.Block.forward


def _train_step(self):
    gpt.TEST_STEP = self.state.step + 1
    return _step(self)


def _stalling_block(self, x):
    if os.environ.get("RANK") == "1" and getattr(gpt, "TEST_STEP", 0) == 2 and self.training:
        time.sleep(120)
    return _block(self, x)


trainer.Trainer.train_step = _train_step
gpt.Block.forward = _stalling_block
"""

CLI_TIMEOUT_S = 5
SMALL = ["--model.n_layer=2", "--model.d_model=32", "--model.n_head=2", "--model.seq_len=32",
         "--train.global_batch_size=16", "--train.micro_batch_size=8", "--train.eval_every=0",
         "--observe.progress=false", "--observe.trackers=[]", "--checkpoint.every=0",
         "--parallel.nproc=2", "--train.steps=4", f"--comm.timeout_s={CLI_TIMEOUT_S}", "--fault.max_restarts=0"]


LAYOUTS = {
    "tensor-parallel": ["--parallel.tp=2"],
    "pipeline": ["--parallel.pp=2", "--parallel.microbatches=2", "--parallel.pp_balance=count"],
}


def test_cli_runs_with_a_rank_stalled_in_forward_exit_with_one_named_error(tmp_path) -> None:
    """Tensor-parallel (DTensor collectives) and pipeline (P2P) runs, started side by side to share
    the start-up time: each exits 1 with one line naming the step, the phase and rank 1."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_STALL_HOOK)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])}
    runs = run_all({kinds: cli_argv("train", *SMALL, *layout, f"--run.dir={tmp_path}/{kinds}")
                    for kinds, layout in LAYOUTS.items()}, env=env)
    for kinds, p in runs.items():
        err = p.stderr
        assert p.returncode == 1, err[-2000:]
        line = [x for x in err.splitlines() if x.startswith("plait: error:")]
        assert len(line) == 1 and "Traceback" not in err, err[-2000:]
        assert f"CollectiveTimeout: step 2 phase 'forward/backward' ({kinds} collectives)" in line[0], line[0]
        assert "ranks [1] did not arrive (rank 1 busy at step 2 'forward/backward'" in line[0], line[0]
        assert "_stalling_block" in line[0], line[0]
        # Time from the end of step 1 (its metrics line) to the error, excluding start-up on a loaded machine.
        run = tmp_path / kinds
        waited = max(f.stat().st_mtime for f in (run / "errors").iterdir()) - (run / "metrics.jsonl").stat().st_mtime
        assert waited < CLI_TIMEOUT_S + 10, waited
