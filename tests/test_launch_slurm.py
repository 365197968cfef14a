"""The sbatch script of ``plait launch slurm`` against a real single-node SLURM: it trains with 2 tasks.

The harness installs Debian's SLURM and MUNGE (when missing), then starts a private cluster in a
temporary directory: munged on its own socket and key, slurmctld and slurmd on free ports, all in the
foreground as children of this test, with a config that needs no cgroups or accounting database
(``SLURM_CONF`` points the clients at it). Skipped, with the reason, where that cannot be done.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sysdeps import ensure_debian, which

from plait.runtime.spawn import free_port

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
BINARIES = ["slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "munged"]

TINY = """[model]
n_layer = 1
d_model = 32
n_head = 2
seq_len = 16
[train]
steps = 4
global_batch_size = 4
micro_batch_size = 2
eval_sequences = 4
eval_every = 0
log_every = 2
[optim]
warmup_steps = 1
[observe]
progress = false
trackers = []
"""


def _slurm_conf(d: Path, host: str) -> str:
    cpus = os.cpu_count() or 2
    return f"""ClusterName=plaittest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/socket
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=600
KillWait=5
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A running single-node cluster; yields the environment its clients need."""
    if sys.platform != "linux":
        pytest.skip("SLURM runs on Linux only")
    if os.geteuid() != 0:
        pytest.skip("starting slurmd and munged needs root")
    reason = ensure_debian(PACKAGES, BINARIES)
    if reason:
        pytest.skip(f"SLURM is not available: {reason}")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("munge", "state", "spool"):
        (d / sub).mkdir()
    (d / "munge").chmod(0o755)  # munged checks that clients can reach its socket
    key = d / "munge" / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o400)
    host = socket.gethostname().split(".")[0]
    conf = d / "slurm.conf"
    conf.write_text(_slurm_conf(d, host))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    procs: list[subprocess.Popen] = []
    try:
        procs.append(subprocess.Popen(
            [which("munged"), "-F", "--force", f"--socket={d}/munge/socket", f"--key-file={key}",
             f"--log-file={d}/munge/log", f"--pid-file={d}/munge/pid", f"--seed-file={d}/munge/seed"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(0.5)
        for daemon in ("slurmctld", "slurmd"):
            procs.append(subprocess.Popen([which(daemon), "-D", "-f", str(conf)], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.time() + 60
        while True:
            state = subprocess.run([which("sinfo"), "-h", "-o", "%T"], env=env, capture_output=True, text=True)
            if state.returncode == 0 and state.stdout.strip() in ("idle", "mixed", "allocated"):
                break
            if time.time() > deadline or any(p.poll() is not None for p in procs):
                logs = "".join(f.read_text()[-800:] for f in d.glob("slurm*.log") if f.is_file())
                pytest.skip(f"the SLURM daemons did not come up (sinfo: {state.stdout.strip()!r} "
                            f"{state.stderr.strip()!r}); logs: {logs}")
            time.sleep(0.5)
        yield env
    finally:
        for p in reversed(procs):  # only the daemons this fixture started, by their own handles
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def _job_state(job: str, env: dict[str, str]) -> tuple[str, str]:
    out = subprocess.run([which("scontrol"), "show", "job", job], env=env, capture_output=True, text=True).stdout
    state = re.search(r"JobState=(\S+)", out)
    code = re.search(r"\bExitCode=(\S+)", out)
    return (state.group(1) if state else "UNKNOWN"), (code.group(1) if code else "?")


def test_sbatch_script_trains_with_two_tasks(slurm: dict[str, str], tmp_path: Path) -> None:
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    env = {**slurm, "OMP_NUM_THREADS": "1", "PLAIT_RUN_DIR": str(tmp_path / "run"),
           "PLAIT_MASTER_PORT": str(free_port())}
    made = subprocess.run([sys.executable, "-m", "plait.cli", "launch", "slurm", str(config), "--nodes", "1",
                           "--gpus-per-node", "0", "--procs-per-node", "2", "-o", str(tmp_path / "job.sbatch")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    submitted = subprocess.run([which("sbatch"), "--parsable", str(tmp_path / "job.sbatch")], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    deadline = time.time() + 240
    state, code = _job_state(job, env)
    while state in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING") and time.time() < deadline:
        time.sleep(1)
        state, code = _job_state(job, env)
    log = next(tmp_path.glob(f"*-{job}.out"), None)
    output = log.read_text() if log else "(no output file)"
    assert state == "COMPLETED" and code == "0:0", f"{state} {code}\n{output[-3000:]}"
    assert "plait: trained 4 steps on 2 worker(s)" in output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    ranks = [json.loads(x).get("rank_step_s") for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [len(r) for r in ranks if r] == [2, 2, 2]  # steps 1, 2, 4: both SLURM tasks took part
