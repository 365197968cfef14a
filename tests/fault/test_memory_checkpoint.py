"""In-memory checkpoints (``fault.memory_checkpoint``) on the restart path of ``plait train`` (2 workers, gloo,
deterministic):

* the holder: loopback only, answers only the run's token, keeps the newest whole copy per rank and checks it;
* one process through the engine: the copy a save puts loads back exactly (weights, Adam moments); damaged bytes
  or another model's copy are refused, never loaded;
* a SIGKILLed worker: the launcher restarts both workers, and they load the newest checkpoint from the holder's
  memory (the log says so, with the time) instead of the disk;
* the holder SIGKILLed too: the restart says there is no whole copy and loads from disk;
* either way the run ends with the weights of a run that was never interrupted, bit for bit;
* several machines, without processes: a save's copies go to the own and the peer machine's holder, a load looks
  in the own, then the peer's, then any other machine's, and with none left reads the disk;
* two machines (network namespaces, one worker each): a lost machine's rank reloads from the copy in its peer's
  holder (the log says so, with the time); with both holders gone the restart reads the disk; the weights equal
  the uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import NetnsPair, run_ranks, run_weights

from plait.engine.host_copies import find_copies, holders_for
from plait.fault.holder import ADDRESS_ENV, TOKEN_ENV, Client, Holders, facing, open_server, start
from plait.fault.restart import read_progress, worker_pids

ARGS = ["--model.n_layer=2", "--model.d_model=32", "--model.n_head=2", "--model.seq_len=32",
        "--train.global_batch_size=8", "--train.micro_batch_size=2", "--train.eval_sequences=8", "--train.steps=24",
        "--optim.decay_steps=24", "--train.eval_every=0", "--train.log_every=5", "--train.deterministic=true",
        "--observe.progress=false", "--observe.trackers=[]", "--checkpoint.every=4", "--parallel.nproc=2",
        "--fault.max_restarts=3", "--fault.restart_backoff_s=0.2", "--comm.timeout_s=5"]


def test_holder_keeps_the_newest_whole_copy_for_its_token_only(tmp_path: Path) -> None:
    holder = start(tmp_path)
    try:
        host, port = holder.address.rsplit(":", 1)
        assert host == "127.0.0.1"
        assert int((tmp_path / "workers" / "holder.pid").read_text()) == holder.proc.pid
        client = Client(holder.address, holder.token)
        assert client.get(0) is None  # nothing held yet
        assert client.put(0, 4, 2, b"step four") and client.put(1, 4, 2, b"rank one")
        assert client.put(0, 8, 2, b"step eight")  # replaces rank 0's copy
        header, payload = client.get(0)
        assert (header["step"], header["world"], payload) == (8, 2, b"step eight")
        assert client.get(1)[1] == b"rank one"
        stranger = Client(holder.address, "0" * 32)
        assert not stranger.put(0, 9, 2, b"forged") and stranger.get(0) is None
        assert client.get(0)[1] == b"step eight"
    finally:
        holder.stop()
    assert Client(holder.address, holder.token).get(0) is None  # gone with its process: no error, no copy


def test_copies_go_to_the_own_and_the_peer_machine_and_a_load_looks_there_in_that_order() -> None:
    """Holders of three "machines" served in this process: the ring of machines (the last one's peer is the first),
    a save's two copies, and a load's search: its own machine's holder, then the peer's, then another machine's,
    each only with a whole copy of the step asked for; none left means the disk."""
    import logging

    servers = [open_server(f"{i:032x}") for i in range(3)]
    addresses = [f"127.0.0.1:{s.server_address[1]}" for s in servers]
    ends = [f"{a} {s.token}" for a, s in zip(addresses, servers, strict=True)]
    try:
        by_rank = [ends[0], ends[0], ends[1], ends[2]]  # ranks 0 and 1 on machine A, 2 on B, 3 on C
        a, c = Holders.of_ranks(by_rank, 1), Holders.of_ranks(by_rank, 3)
        assert (a.own.address, a.peer.address, [o.address for o in a.others]) == tuple([*addresses[:2], addresses[2:]])
        assert (c.own.address, c.peer.address, [o.address for o in c.others]) == (addresses[2], addresses[0],
                                                                                 [addresses[1]])
        alone = Holders.of_ranks([ends[0]] * 2, 1)
        assert alone.peer is None and alone.others == [] and alone.put(1, 4, 2, b"x") == []
        assert a.put(1, 8, 4, b"rank 1 at 8") == []
        assert servers[0].copies[1][1] == servers[1].copies[1][1] == b"rank 1 at 8" and 1 not in servers[2].copies

        def found(rank: int, step: int, world: int = 4) -> list[tuple[str, bytes]]:
            return [(where, bytes(payload)) for where, _, payload in a.find(rank, world, lambda s: s == step)]

        assert found(1, 8) == [("own", b"rank 1 at 8"), ("peer", b"rank 1 at 8")]
        assert found(1, 8, world=2) == [] and found(1, 4) == [] and found(0, 8) == []  # world, step, rank differ
        servers[0].shutdown()
        servers[0].server_close()  # machine A's holder is gone
        assert found(1, 8) == [("peer", b"rank 1 at 8")]
        assert a.put(1, 12, 4, b"rank 1 at 12") == [addresses[0]]  # said to the caller; the peer took it
        assert found(1, 12) == [("peer", b"rank 1 at 12")] and found(1, 8) == []  # the peer keeps only the newest
        assert Client(*ends[2].split()).put(1, 12, 4, b"rank 1 at 12, elsewhere")
        servers[1].shutdown()
        servers[1].server_close()  # the peer too: only another machine's holder has a copy
        assert found(1, 12) == [("other", b"rank 1 at 12, elsewhere")]
        held = find_copies(a, 1, 4, lambda s: s == 12, bytes, lambda t: t * 4, logging.getLogger("test"))
        assert held is not None and (held.step, held.where, held.decoded) == (12, "other", b"rank 1 at 12, elsewhere")
        assert held.ranks_from == {"own": 0, "peer": 0, "other": 4}  # the sum over "4 ranks" that all did the same
        servers[2].shutdown()
        servers[2].server_close()
        assert found(1, 12) == []
        assert find_copies(a, 1, 4, lambda s: s == 12, bytes, lambda t: t * 4, logging.getLogger("test")) is None
    finally:
        for server in servers:
            server.server_close()
    assert facing("127.0.0.1") == "127.0.0.1"


def _holders_of(rank: int, world: int) -> list[tuple[str, str | None, list[str]] | None]:
    """Ranks 0 and 1 on machine A, rank 2 on machine B, as their launchers and agents set the environment: the
    holders each rank learns, then again with rank 2's holder missing."""
    import logging

    os.environ.update({"GROUP_WORLD_SIZE": "2", ADDRESS_ENV: f"127.0.0.1:{4000 + rank // 2}",
                       TOKEN_ENV: f"{rank // 2:032x}"})
    out = []
    for _ in range(2):
        h = holders_for(rank, world, None, torch.device("cpu"), logging.getLogger("test"))
        out.append(None if h is None else (h.own.endpoint, h.peer.endpoint if h.peer else None,
                                           [o.endpoint for o in h.others]))
        if rank == 2:
            os.environ.pop(ADDRESS_ENV, None)
    return out


def test_workers_on_several_machines_learn_every_holder_in_one_exchange() -> None:
    a, b = f"127.0.0.1:4000 {0:032x}", f"127.0.0.1:4001 {1:032x}"
    r0, r1, r2 = run_ranks(_holders_of, 3)
    assert r0[0] == r1[0] == (a, b, []) and r2[0] == (b, a, [])  # A's peer is B, B's is A
    assert r0[1] is r1[1] is r2[1] is None  # no holder on B: no copies anywhere (a load needs every rank's)


def test_a_copy_loads_back_exactly_and_one_that_does_not_fit_is_refused(tmp_path: Path, monkeypatch) -> None:
    """One process through the engine's API: a save puts the copy, ``memory_copy`` decodes it and ``load`` restores
    the weights and optimizer state exactly; damaged bytes, or a copy of another model, are refused (None: read
    the disk), never loaded."""
    import plait

    holder = start(tmp_path)
    try:
        for k, v in holder.env().items():
            monkeypatch.setenv(k, v)
        p = plait.Plait(run={"dir": str(tmp_path / "run")}, fault={"memory_checkpoint": True},
                        observe={"progress": False, "trackers": []})
        torch.manual_seed(0)
        model, opt = p.setup(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)))
        for _ in range(2):
            p.backward(model(torch.randn(3, 4)).pow(2).mean())
            p.step()
        p.save(tmp_path / "run" / "step_2", model=model, optimizer=opt)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        moments = [s["exp_avg"].clone() for s in opt.state.values()]
        p.backward(model(torch.randn(3, 4)).pow(2).mean())
        p.step()  # the live state moves on
        held = p.memory_copy(lambda s: s == 2)
        assert (held.step, held.where, held.ranks_from) == (2, "own", {"own": 1, "peer": 0, "other": 0})
        assert p.memory_copy(lambda s: s == 3) is None  # not the step asked for
        p.load(tmp_path / "run" / "step_2", model=model, optimizer=opt, memory=held.decoded)
        assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
        assert all(torch.equal(s["exp_avg"], m) for s, m in zip(opt.state.values(), moments, strict=True))
        client = Client(holder.address, holder.token)
        assert client.put(0, 2, 1, b"not a checkpoint")
        assert p.memory_copy(lambda s: s == 2) is None
        other = plait.Plait(run={"dir": str(tmp_path / "other")}, fault={"memory_checkpoint": True},
                            observe={"progress": False, "trackers": []})
        wide, wide_opt = other.setup(torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(16, 1)))
        other.save(tmp_path / "other" / "step_0", model=wide, optimizer=wide_opt)
        assert p.memory_copy(lambda s: s == 0) is None  # the wider model's copy does not fit this one
        p.close()
        other.close()
    finally:
        holder.stop()


def _outward_address() -> str | None:
    """An IPv4 address of this machine other than loopback (None when it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outward interface
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_holder_listens_on_loopback_only(tmp_path: Path) -> None:
    outward = _outward_address()
    if outward is None:
        pytest.skip("this machine has no address besides loopback to try the holder on")
    holder = start(tmp_path)
    try:
        port = int(holder.address.rsplit(":", 1)[1])
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        with pytest.raises(OSError):
            socket.create_connection((outward, port), timeout=2).close()
    finally:
        holder.stop()


def _start(run: Path, memory: bool) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "plait.cli", "train", *ARGS, f"--fault.memory_checkpoint={memory}",
                             f"--run.dir={run}"], cwd=run.parent, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _run(run: Path, memory: bool = True, kills: tuple[tuple[int, bool], ...] = ()) -> str:
    """Train; for each (step, holder_too) SIGKILL worker 1 of a new attempt once the run passed that step (and the
    holder with it when holder_too)."""
    proc = _start(run, memory)
    killed: set[int] = set()
    for step, holder_too in kills:
        while proc.poll() is None:
            pid = worker_pids(run).get(1, (None, ""))[0]
            if pid is not None and pid not in killed and int(read_progress(run).get("steps") or 0) >= step:
                break
            time.sleep(0.02)
        if holder_too:
            os.kill(int((run / "workers" / "holder.pid").read_text()), signal.SIGKILL)
        os.kill(pid, signal.SIGKILL)
        killed.add(pid)
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    return err


def _same(a: Path, b: Path) -> bool:
    x, y = run_weights(a), run_weights(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    """The run without a failure (one machine, 2 workers, disk checkpoints only)."""
    run = tmp_path_factory.mktemp("clean") / "run"
    _run(run, memory=False)
    return run


def test_a_killed_worker_restarts_from_memory_and_from_disk_without_the_holder(tmp_path: Path, clean: Path) -> None:
    # first kill: the holder has the copies; second kill, of the restarted attempt, with the holder: disk
    log = _run(tmp_path / "killed", kills=((10, False), (18, True)))
    assert "restart 1 of 3" in log and "restart 2 of 3" in log
    first, second = log.split("restart 2 of 3")
    loaded = re.search(r"resumed at step (\d+) from host memory \(2 ranks from its own machine's holder; holder "
                       r"127\.0\.0\.1:\d+\) in ([\d.]+)s", first)
    assert loaded is not None and int(loaded.group(1)) in (8, 12), first[-3000:]
    assert "loading from disk" not in first
    assert "from host memory" not in second and re.search(r"no whole in-memory copy of step \d+ on every rank", second)
    assert re.search(r"resumed from \S+step_\d+ at step \d+ in [\d.]+s \(disk\)", second), second[-3000:]
    ledger = [json.loads(x) for x in (tmp_path / "killed" / "goodput.jsonl").read_text().splitlines()]
    assert [e["source"] for e in ledger if e.get("event") == "resume"] == ["memory", "disk"]
    assert _same(clean, tmp_path / "killed")


class TwoMachines(NetnsPair):
    """Hosts 10.205.0.1 and 10.205.0.2 in two network namespaces (tests/helpers.NetnsPair)."""

    def __init__(self) -> None:
        super().__init__(("plait-mca", "plait-mcb"), ("plmca", "plmcb"), ("10.205.0.1", "10.205.0.2"))

    def start(self, i: int, run: Path, log: Path, *extra: str) -> subprocess.Popen:
        """Machine ``i``'s ``plait train`` (agent, 1 worker, holder) in a session of its own, its output in ``log``."""
        env = ["env", f"GLOO_SOCKET_IFNAME={self.dev[i]}", "OMP_NUM_THREADS=1", "PYTHONUNBUFFERED=1",
               f"PYTHONPATH={os.environ.get('PYTHONPATH', '')}"]
        nodes = ["--nnodes", "2", "--rdzv-endpoint", f"{self.addr[0]}:29541", "--rdzv-id", "peer-copies",
                 "--local-addr", self.addr[i],
                 "--rdzv-conf", "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=10"]
        cmd = ["ip", "netns", "exec", self.ns[i], *env, sys.executable, "-m", "plait.cli", "train", *MACHINE_ARGS,
               *nodes, f"--run.dir={run}", *extra]
        with open(log, "a") as out:
            return subprocess.Popen(cmd, cwd=run.parent, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


# One worker per machine (world 2, as the one-machine runs); saves every 6 steps and the progress every 2, so that a
# kill two steps after a save comes well before the next.
MACHINE_ARGS = [*(a for a in ARGS if not a.startswith(("--parallel.nproc", "--checkpoint.every", "--train.log_every"))),
                "--parallel.nproc=1", "--checkpoint.every=6", "--train.log_every=2", "--fault.memory_checkpoint=true"]


def _wait_for(check, what: str, procs: list[subprocess.Popen], logs: list[Path], timeout_s: float = 180) -> None:
    deadline = time.time() + timeout_s
    while not check():
        if time.time() > deadline or procs[0].poll() is not None:
            text = "\n".join(f"--- {log.name} ---\n{log.read_text(errors='replace')[-2500:]}" for log in logs)
            progress = read_progress(logs[0].parent / "run")
            raise AssertionError(f"timed out waiting for {what}; progress {progress}\n{text}")
        time.sleep(0.05)


def _lose(machine: subprocess.Popen) -> None:
    """The machine is gone: its launcher, agent, worker and holder at once."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(machine.pid, signal.SIGKILL)
    machine.wait(timeout=30)


def test_a_lost_machine_reloads_from_its_peer_and_from_disk_when_both_copies_are_gone(tmp_path: Path,
                                                                                    clean: Path) -> None:
    """Two machines (network namespaces), one worker and one holder each, world 2. Machine B is lost (launcher,
    agent, worker and holder SIGKILLed) two steps after a save and replaced (the same command with ``--resume``):
    its rank's copy is gone with B's holder, and the restarted workers load the newest checkpoint from memory, B's
    rank's from the copy in A's holder (the log says so, with the time). Then both holders are SIGKILLed, and a
    worker: no copy is left, and the restart loads from disk. The run ends with the weights of a run that was never
    interrupted, bit for bit."""
    run, logs = tmp_path / "run", [tmp_path / "a.log", tmp_path / "b.log"]
    with TwoMachines() as machines:
        a, b = machines.start(0, run, logs[0]), machines.start(1, run, logs[1])
        procs = [a, b]
        try:
            def saved_and_past(saved: int, steps: int) -> bool:
                progress = read_progress(run)
                return int(progress.get("saved") or 0) >= saved and int(progress.get("steps") or 0) >= steps

            _wait_for(lambda: saved_and_past(6, 8), "step 8", procs, logs)
            _lose(b)
            procs[1] = b = machines.start(1, run, logs[1], "--resume", str(run))
            _wait_for(lambda: _resumes(run) == 1 and saved_and_past(12, 14), "step 14 after the reload", procs, logs)
            for launcher in (a, b):  # both holders, then a worker: no copy is left, and the agents restart both
                os.kill(int((run / "workers" / f"holder.{launcher.pid}.pid").read_text()), signal.SIGKILL)
            os.kill(worker_pids(run)[1][0], signal.SIGKILL)
            codes = [p.wait(timeout=240) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
    text = "\n".join(log.read_text(errors="replace") for log in logs)
    assert codes == [0, 0], text[-5000:]
    loaded = re.search(r"resumed at step 6 from host memory \(1 rank from its own machine's holder, 1 rank from the "
                       r"peer machine's holder; holder [\d.:]+, peer [\d.:]+\) in ([\d.]+)s", text)
    assert loaded is not None, text[-5000:]
    assert re.search(r"no whole in-memory copy of step 12 on every rank", text), text[-5000:]
    assert re.search(r"resumed from \S+step_0*12 at step 12 in [\d.]+s \(disk\)", text), text[-5000:]
    ledger = [json.loads(x) for x in (run / "goodput.jsonl").read_text().splitlines()]
    resumes = [e for e in ledger if e.get("event") == "resume"]
    assert [(e["step"], e["source"], e.get("ranks_from")) for e in resumes] == [
        (6, "memory", {"own": 1, "peer": 1, "other": 0}), (12, "disk", None)], resumes
    assert _same(clean, run)


def _resumes(run: Path) -> int:
    path = run / "goodput.jsonl"
    return sum('"resume"' in line for line in path.read_text().splitlines()) if path.is_file() else 0
