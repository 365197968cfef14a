"""One keep-your-loop script (examples/custom_loop.py) started four ways: a plain process, ``plait run``,
``torchrun`` and SLURM's environment (two processes with ``SLURM_PROCID``/``SLURM_NTASKS``, as ``srun``
starts them). The three 2-rank launches form the same world, so they end with identical weights; the
plain process trains the same global batches by accumulation instead (float32 rounding apart)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from helpers import run_all, run_weights

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "examples" / "custom_loop.py")
ARGS = ["--steps", "6", "--zero", "0"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_"))}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def test_script_runs_under_every_launcher(tmp_path: Path) -> None:
    from plait.runtime.spawn import free_port

    port = free_port()
    launches = {
        "single": [[sys.executable, SCRIPT, *ARGS, "--run-dir", str(tmp_path / "single")]],
        "plait-run": [[sys.executable, "-m", "plait.cli", "run", "--nproc", "2", SCRIPT, *ARGS,
                       "--run-dir", str(tmp_path / "plait-run")]],
        "torchrun": [[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", SCRIPT,
                      *ARGS, "--run-dir", str(tmp_path / "torchrun")]],
        "slurm": [[sys.executable, SCRIPT, *ARGS, "--run-dir", str(tmp_path / "slurm")] for _ in range(2)],
    }
    commands = {(name, i): cmd for name, cmds in launches.items() for i, cmd in enumerate(cmds)}
    slurm = {("slurm", i): _env(SLURM_PROCID=str(i), SLURM_NTASKS="2", SLURM_LOCALID=str(i), SLURM_JOB_ID="1234",
                                SLURM_JOB_NODELIST="127.0.0.1", MASTER_PORT=str(port)) for i in range(2)}
    procs = run_all(commands, cwd=tmp_path, env=_env(), envs=slurm, timeout=240)
    for (name, _), proc in procs.items():
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
    worlds = {name: next(line for line in procs[(name, 0)].stdout.splitlines() if line.startswith("done:"))
              for name in launches}
    assert "on 1 worker(s)" in worlds["single"]
    assert all("on 2 worker(s)" in worlds[n] for n in ("plait-run", "torchrun", "slurm")), worlds
    weights = {name: run_weights(tmp_path / name) for name in launches}
    for name in ("torchrun", "slurm"):
        assert all(torch.equal(weights[name][k], v) for k, v in weights["plait-run"].items()), name
    assert max((weights["single"][k] - v).abs().max().item() for k, v in weights["plait-run"].items()) < 3e-5
    assert (tmp_path / "plait-run" / "checkpoint" / "meta.json").is_file()  # saved half way by every launcher
