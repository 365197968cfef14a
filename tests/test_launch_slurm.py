"""The sbatch script of ``plait launch slurm`` against a real single-node SLURM with two QoS levels and preemption.

* a plain job trains with 2 tasks;
* a low-QoS job preempted by a high-QoS one saves at a step boundary after SLURM's warning (USR1), requeues itself
  from its batch script, resumes, and ends with weights bit-identical to an uninterrupted run (deterministic mode);
  its summary counts one preemption and no failure;
* a job array of 2 tasks runs both, each with its own config changes and run directory.

The harness installs Debian's SLURM, slurmdbd, MariaDB and MUNGE (when missing), then starts a private cluster in a
temporary directory, every daemon in the foreground as a child of this test: munged on its own socket and key,
MariaDB on a free port of 127.0.0.1 (QoS live in SLURM's accounting database), slurmdbd, slurmctld and slurmd, with
``PreemptType=preempt/qos`` and ``PreemptMode=REQUEUE`` and a config that needs no cgroups (``SLURM_CONF`` points
the clients at it). Skipped, with the reason, where that cannot be done.
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
import torch
from sysdeps import ensure_debian, which

from plait.runtime.spawn import free_port

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "slurmdbd", "munge", "mariadb-server"]
BINARIES = ["slurmctld", "slurmd", "slurmdbd", "sbatch", "srun", "scontrol", "scancel", "sinfo", "sacctmgr", "munged",
            "mariadbd", "mariadb-install-db"]

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
GRACE_S = 60  # the low QoS's GraceTime: SLURM's warning to the kill at preemption


def _slurm_conf(d: Path, host: str, dbd_port: int) -> str:
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
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={dbd_port}
AccountingStoragePass={d}/munge/socket
AccountingStorageEnforce=associations,limits,qos
PriorityType=priority/multifactor
PriorityWeightQOS=10000
PreemptType=preempt/qos
PreemptMode=REQUEUE
JobRequeue=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
SchedulerParameters=preempt_send_user_signal,sched_interval=2
ReturnToService=2
MinJobAge=600
KillWait=5
SlurmctldDebug=debug
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _dbd_conf(d: Path, dbd_port: int, db_port: int) -> str:
    return f"""AuthType=auth/munge
AuthInfo=socket={d}/munge/socket
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={dbd_port}
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={db_port}
StorageUser=root
StorageLoc=slurm_acct_db
PidFile={d}/slurmdbd.pid
LogFile={d}/slurmdbd.log
"""


class Daemons:
    """The cluster's processes, started in order, each waited for; stopped in reverse, only these."""

    def __init__(self, d: Path, env: dict[str, str]) -> None:
        self.d, self.env, self.procs = d, env, []

    def start(self, *cmd: str) -> subprocess.Popen:
        proc = subprocess.Popen(list(cmd), env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def wait_for(self, what: str, ready, timeout_s: float = 60.0) -> None:
        deadline = time.time() + timeout_s
        while not ready():
            if time.time() > deadline or any(p.poll() is not None for p in self.procs):
                logs = "".join(f"{f.name}: {f.read_text()[-600:]}\n" for f in sorted(self.d.glob("*.log")))
                pytest.skip(f"the SLURM cluster did not come up: {what} not ready; logs: {logs}")
            time.sleep(0.3)

    def run(self, *cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=60)

    def stop(self) -> None:
        for p in reversed(self.procs):  # only the daemons this fixture started, by their own handles
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def _database(c: Daemons, d: Path, port: int) -> None:
    """MariaDB in ``d/db``, on 127.0.0.1:port only, without grant tables (root reaches it without a password)."""
    done = c.run(which("mariadb-install-db"), "--no-defaults", "--user=root", f"--datadir={d}/db",
                 "--auth-root-authentication-method=normal", "--skip-test-db")
    if done.returncode != 0:
        pytest.skip(f"mariadb-install-db failed: {(done.stderr or done.stdout).strip()[-400:]}")
    c.start(which("mariadbd"), "--no-defaults", "--user=root", f"--datadir={d}/db", f"--socket={d}/mysql.sock",
            f"--port={port}", "--bind-address=127.0.0.1", "--skip-grant-tables", f"--pid-file={d}/mysqld.pid",
            f"--log-error={d}/mysqld.log", "--innodb-buffer-pool-size=16M")

    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    c.wait_for("MariaDB", listening)


def _accounts(c: Daemons) -> None:
    """The cluster, and the QoS levels: ``high`` preempts ``low`` (requeued after GraceTime), ``normal`` is left
    alone; root may use all three."""
    steps = [["add", "cluster", "plaittest"],
             ["add", "qos", "low", "priority=0", "preemptmode=requeue", f"gracetime={GRACE_S}"],
             ["add", "qos", "high", "priority=1000", "preempt=low"],
             ["modify", "user", "where", "name=root", "set", "qos+=low,high"]]
    for args in steps:
        done = c.run(which("sacctmgr"), "-i", *args)
        if done.returncode != 0 and "Nothing new added" not in done.stdout + done.stderr:
            pytest.skip(f"sacctmgr {' '.join(args)} failed: {(done.stderr or done.stdout).strip()}")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A running single-node cluster with accounting and QoS preemption; yields the environment its clients need."""
    if sys.platform != "linux":
        pytest.skip("SLURM runs on Linux only")
    if os.geteuid() != 0:
        pytest.skip("starting slurmd, munged and MariaDB needs root")
    reason = ensure_debian(PACKAGES, BINARIES)
    if reason:
        pytest.skip(f"SLURM is not available: {reason}")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("munge", "state", "spool", "db"):
        (d / sub).mkdir()
    (d / "munge").chmod(0o755)  # munged checks that clients can reach its socket
    key = d / "munge" / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o400)
    host = socket.gethostname().split(".")[0]
    dbd_port, db_port = free_port(), free_port()
    conf = d / "slurm.conf"
    conf.write_text(_slurm_conf(d, host, dbd_port))
    dbd_conf = d / "slurmdbd.conf"  # slurmdbd reads it beside slurm.conf; it refuses one others can read
    dbd_conf.write_text(_dbd_conf(d, dbd_port, db_port))
    dbd_conf.chmod(0o600)
    c = Daemons(d, {**os.environ, "SLURM_CONF": str(conf)})
    try:
        c.start(which("munged"), "-F", "--force", f"--socket={d}/munge/socket", f"--key-file={key}",
                f"--log-file={d}/munge/log", f"--pid-file={d}/munge/pid", f"--seed-file={d}/munge/seed")
        c.wait_for("munged", lambda: (d / "munge" / "socket").exists())
        _database(c, d, db_port)
        c.start(which("slurmdbd"), "-D")
        c.wait_for("slurmdbd", lambda: c.run(which("sacctmgr"), "-n", "list", "cluster").returncode == 0)
        _accounts(c)
        for daemon in ("slurmctld", "slurmd"):
            c.start(which(daemon), "-D", "-f", str(conf))
        c.wait_for("the node", lambda: c.run(which("sinfo"), "-h", "-o", "%T").stdout.strip() in (
            "idle", "mixed", "allocated"))
        yield c.env
    finally:
        c.stop()


def _job_state(job: str, env: dict[str, str]) -> tuple[str, str]:
    out = subprocess.run([which("scontrol"), "show", "job", job], env=env, capture_output=True, text=True).stdout
    state = re.search(r"JobState=(\S+)", out)
    code = re.search(r"\bExitCode=(\S+)", out)
    if state and state.group(1) == "PENDING" and "Reason=BeginTime" in out:
        # SLURM holds a requeued job back for a couple of minutes (its BeginTime); the test does not wait them out
        subprocess.run([which("scontrol"), "update", f"JobId={job}", "StartTime=now"], env=env, capture_output=True)
    return (state.group(1) if state else "UNKNOWN"), (code.group(1) if code else "?")


def _launch(tmp: Path, env: dict[str, str], name: str, config: str, *args: str) -> Path:
    """``plait launch slurm`` as a user runs it; returns the script."""
    (tmp / f"{name}.toml").write_text(config)
    made = subprocess.run([sys.executable, "-m", "plait.cli", "launch", "slurm", str(tmp / f"{name}.toml"),
                           "--gpus-per-node", "0", "-o", str(tmp / f"{name}.sbatch"), *args],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    return tmp / f"{name}.sbatch"


def _sbatch(env: dict[str, str], cwd: Path, *args: str) -> str:
    submitted = subprocess.run([which("sbatch"), "--parsable", *args], cwd=cwd, env=env, capture_output=True,
                               text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    return submitted.stdout.strip().split(";")[0]


def _finish(job: str, env: dict[str, str], timeout_s: float = 240) -> tuple[str, str]:
    """Wait until the job is done (a requeued job passes through PENDING again)."""
    deadline = time.time() + timeout_s
    state, code = _job_state(job, env)
    while state in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "PREEMPTED",
                    "SUSPENDED") and time.time() < deadline:
        time.sleep(1)
        state, code = _job_state(job, env)
    return state, code


def _preempt_log(env: dict[str, str]) -> str:
    """slurmctld's lines about preemption and signals, for a failure's message."""
    log = Path(env["SLURM_CONF"]).parent / "slurmctld.log"
    lines = log.read_text().splitlines() if log.is_file() else []
    return "\n".join(x for x in lines if any(w in x.lower() for w in ("preempt", "signal", "requeu", "grace")))[-3000:]


def _output(tmp: Path, pattern: str) -> str:
    return "".join(f.read_text() for f in sorted(tmp.glob(pattern))) or "(no output file)"


def _env(slurm: dict[str, str], run_dir: Path | None, port: bool = True) -> dict[str, str]:
    env = {**slurm, "OMP_NUM_THREADS": "1"}
    if run_dir is not None:
        env["PLAIT_RUN_DIR"] = str(run_dir)
    if port:
        env["PLAIT_MASTER_PORT"] = str(free_port())
    return env


def test_sbatch_script_trains_with_two_tasks(slurm: dict[str, str], tmp_path: Path) -> None:
    env = _env(slurm, tmp_path / "run")
    job = _sbatch(env, tmp_path, str(_launch(tmp_path, env, "tiny", TINY, "--nodes", "1", "--procs-per-node", "2")))
    state, code = _finish(job, env)
    output = _output(tmp_path, f"*-{job}.out")
    assert state == "COMPLETED" and code == "0:0", f"{state} {code}\n{output[-3000:]}"
    assert "plait: trained 4 steps on 2 worker(s)" in output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    ranks = [json.loads(x).get("rank_step_s") for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [len(r) for r in ranks if r] == [2, 2, 2]  # steps 1, 2, 4: both SLURM tasks took part


# Slow enough to be preempted mid-run: rank 1 sleeps after its compute (plait's testing aid), which changes no number.
PREEMPTIBLE = TINY.replace("steps = 4", "steps = 60\ndeterministic = true").replace("log_every = 2", "log_every = 20") \
    + "[checkpoint]\nevery = 0\n[fault]\nslow_rank = 1\nslow_factor = 40.0\n"


def _steps_done(run: Path) -> int:
    ledger = run / "goodput.jsonl"
    steps = [json.loads(x).get("step", 0) for x in ledger.read_text().splitlines()] if ledger.is_file() else []
    return max(steps, default=0)


def _weights(run: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted((run / "model").glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_low_qos_job_preempted_requeues_itself_and_ends_bit_identical(slurm: dict[str, str], tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = _env(slurm, run)
    low = _sbatch(env, tmp_path, str(_launch(tmp_path, env, "low", PREEMPTIBLE, "--nodes", "1", "--procs-per-node",
                                             "2", "--qos", "low")))
    # The uninterrupted reference trains beside it, outside SLURM: the same two ranks, the same gloo reductions.
    ref = subprocess.Popen([sys.executable, "-m", "plait.cli", "train", str(tmp_path / "low.toml"),
                            "--parallel.nproc=2", "--fault.slow_rank=-1", f"--run.dir={tmp_path / 'ref'}"],
                           cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 180
    while _steps_done(run) < 5 and time.time() < deadline:
        time.sleep(0.2)
    assert 5 <= _steps_done(run) < 60, _output(tmp_path, f"*-{low}.out")[-3000:]
    high = _sbatch(env, tmp_path, "--qos=high", "--ntasks=2", "--output=high-%j.out", "--wrap", "sleep 2")
    state, code = _finish(low, env, 300)
    output = _output(tmp_path, f"*-{low}.out")
    assert state == "COMPLETED" and code == "0:0", f"{state} {code}\n{output[-3000:]}"
    assert "preempted at step" in output, f"{output[-2000:]}\nslurmctld:\n{_preempt_log(env)}"
    assert _finish(high, env, 60)[0] == "COMPLETED"
    assert "preempted at step" in output and f"requeueing job {low}" in output, output[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 60 and summary["preemptions"] == 1 and summary["failures"] == 0, summary
    assert summary["goodput"]["lost_s"]["preempted"] > 0
    assert ref.wait(timeout=300) == 0, ref.stdout.read()
    mine, reference = _weights(run), _weights(tmp_path / "ref")
    assert mine.keys() == reference.keys() and mine
    for name, tensor in reference.items():
        assert torch.equal(mine[name], tensor), name


def test_job_array_runs_every_task_and_a_warned_task_saves_requeues_and_resumes(slurm: dict[str, str],
                                                                                 tmp_path: Path) -> None:
    """Two array tasks with their own config changes; task 1 gets SLURM's warning as a time limit sends it (USR1
    to the batch shell alone, ``--signal=B:USR1``): its script passes it on, every rank saves, the job requeues."""
    env = _env(slurm, tmp_path / "sweep", port=False)  # each task's rendezvous port follows its own job id
    config = PREEMPTIBLE.replace("steps = 60", "steps = 30").replace("slow_rank = 1", "slow_rank = 0")
    script = _launch(tmp_path, env, "sweep", config, "--nodes", "1", "--array=--train.seed=11",
                     "--array=--train.seed=12 --optim.lr=1e-3")
    job = _sbatch(env, tmp_path, str(script))
    deadline = time.time() + 180
    while _steps_done(tmp_path / "sweep" / "task-1") < 3 and time.time() < deadline:
        time.sleep(0.2)
    warned = subprocess.run([which("scancel"), "--batch", "--signal=USR1", f"{job}_1"], env=env, capture_output=True,
                            text=True)
    assert warned.returncode == 0, warned.stderr
    for task, seed in ((0, 11), (1, 12)):
        state, code = _finish(f"{job}_{task}", env, 300)
        output = _output(tmp_path, f"*-{job}_{task}.out")
        assert state == "COMPLETED" and code == "0:0", f"task {task}: {state} {code}\n{output[-3000:]}"
        run = tmp_path / "sweep" / f"task-{task}"
        summary = json.loads((run / "summary.json").read_text())
        assert summary["steps"] == 30 and summary["preemptions"] == task and summary["failures"] == 0, summary
        assert f"seed = {seed}" in (run / "config.toml").read_text()
    assert "lr = 0.001" in (tmp_path / "sweep" / "task-1" / "config.toml").read_text()
    output = _output(tmp_path, f"*-{job}_1.out")
    assert "SIGUSR1 from SLURM" in output and "requeueing job" in output, output[-3000:]
