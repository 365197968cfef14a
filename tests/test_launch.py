"""The same `plait train` entry point runs under torchrun and under SLURM's environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import TINY_CLI, plait_cli, succeeded

from plait.runtime.dist import _first_slurm_host
from plait.runtime.spawn import free_port


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def test_under_torchrun(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "-m", "plait.cli", "train", *TINY_CLI, "--train.steps=2",
           "--parallel.nproc=1", f"--run.dir={tmp_path}/r"]
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads((tmp_path / "r/summary.json").read_text())
    assert summary["world_size"] == 2 and summary["dp"] == 2  # nproc is ignored: torchrun owns the world


def test_under_slurm_environment(tmp_path: Path) -> None:
    port = free_port()
    procs = []
    for rank in range(2):
        env = {k: v for k, v in _env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank), SLURM_JOB_ID="77",
                   SLURM_JOB_NODELIST="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "plait.cli", "train", *TINY_CLI, "--train.steps=2", f"--run.dir={tmp_path}/s"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][1][-2000:] + outs[1][1][-2000:]
    assert json.loads((tmp_path / "s/summary.json").read_text())["world_size"] == 2


def test_slurm_nodelist_parsing() -> None:
    assert _first_slurm_host("node[03-05,07],gpu1") == "node03"
    assert _first_slurm_host("gpu7") == "gpu7"


ENDS_FIRST = """
import atexit, os, sys, time
from pathlib import Path
import torch, plait
p = plait.Plait(observe={"progress": False, "trackers": []}, run={"dir": "run"})
model, _ = p.setup(torch.nn.Linear(4, 2))
p.backward(model(torch.randn(3, 4)).sum())
p.step()
p.close()
if p.rank == 1:  # ends at once; its exit is stamped when the interpreter shuts down
    atexit.register(lambda: Path("rank1_exited").write_text(str(time.time())))
else:  # still in its script, as a rank still in its last collective would be
    time.sleep(3)
    if Path("rank1_exited").exists():
        sys.exit("rank 1 exited while rank 0 was still running its script")
"""


def test_a_rank_that_ends_first_waits_for_the_others(tmp_path: Path) -> None:
    """Under ``plait run`` a rank whose script ends first keeps its connections until every rank's script has
    ended, so it cannot abort a peer still in its last collective (plait.runtime.group)."""
    (tmp_path / "ends_first.py").write_text(ENDS_FIRST)
    succeeded(plait_cli("run", "--nproc", "2", "ends_first.py", cwd=tmp_path))
    assert (tmp_path / "rank1_exited").is_file()  # it did exit, after rank 0's script ended


def test_local_addr_names_this_machine_and_the_rendezvous_host() -> None:
    """``--local-addr`` (the address the other machines reach this one at) given as the rendezvous endpoint's host
    makes this machine the rendezvous host, where a host name that resolves to loopback would hide it; a value
    with a port or a space is one clear error."""
    import pytest

    from plait.config import ConfigError
    from plait.launch import parse_nodes, rdzv_configs

    host = parse_nodes("2", "10.9.0.1:29400", "job", None, "10.9.0.1")
    other = parse_nodes("2", "10.9.0.1:29400", "job", None, "10.9.0.2")
    plain = parse_nodes("2", "10.9.0.1:29400", "job")
    assert [n.local_addr for n in (host, other, plain)] == ["10.9.0.1", "10.9.0.2", ""]
    assert [rdzv_configs(n).get("is_host") for n in (host, other, plain)] == [True, None, None]
    for bad in ("10.9.0.1:29400", "a b", ""):
        with pytest.raises(ConfigError, match="--local-addr takes this machine's address"):
            parse_nodes("2", "10.9.0.1:29400", "job", None, bad)
