"""Starting workers: local ones through PyTorch's elastic agent, or joining a torchrun / SLURM job.

``launch_local(fn, args, nproc, error_dir)`` starts ``nproc`` local workers running a Python function
(``plait train``); ``launch_script(script, args, nproc, error_dir)`` runs a user's script in each
(``plait run``), both with ``elastic_launch`` (the agent behind ``torchrun``). When a process was
started by ``torchrun`` (``RANK``/``WORLD_SIZE`` set) or ``srun`` (``SLURM_PROCID`` set),
``init_distributed`` joins that job's process group instead. On several machines (``Nodes``: ``--nnodes MIN:MAX
--rdzv-endpoint HOST:PORT``) each machine's agent meets the others at a c10d rendezvous hosted by the agent on
HOST; a node that leaves (its workers fail, or save after a SIGTERM) or joins (the agents see it waiting) makes
every agent stop its workers and start them again at the new world size, up to ``fault.max_restarts`` failures
(joins are not counted), and the workers resume from the newest checkpoint. A failed worker leaves
``<error_dir>/rank<r>.txt``; the launcher turns the earliest one into one line naming the rank and its
error, and a non-zero exit. Workers find the error directory in ``$PLAIT_ERROR_DIR``.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import runpy
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from plait.observe.log import get_logger
from plait.runtime.dist import (
    ERROR_DIR_ENV,
    error_dir_from_env,
    error_file,
    init_distributed,
    noted_error_dir,
    write_error,
)
from plait.runtime.forked import exit_handlers, fresh_start_method
from plait.runtime.group import leave_process_group


class WorkerFailed(RuntimeError):
    """One or more workers failed; ``str()`` names the first failing rank and its error."""


# What the elastic agent sets in a worker's environment (torch's LocalElasticAgent): kept as the agent set them
# when a forked worker takes the launcher's environment (``_take_environment``).
AGENT_ENV = ("LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
             "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
             "OMP_NUM_THREADS", "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def _take_environment(launcher_env: dict[str, str] | None) -> None:
    """A worker forked from the fork server has the server's environment, as it was when the server started;
    give it the launcher's as it is at this launch (``PLAIT_ATTEMPT``, the error directory...), keeping what
    the agent set for this worker."""
    if launcher_env is None:
        return
    agent = {k: v for k, v in os.environ.items() if k in AGENT_ENV or k.startswith("TORCHELASTIC_")}
    os.environ.clear()
    os.environ.update({**launcher_env, **agent})


def run_worker(fn: Callable[..., Any], args: tuple, backend: str, timeout_s: float,
               launcher_env: dict[str, str] | None = None) -> Any:
    """Entry point of one worker of ``launch_local``: join the process group, run ``fn(*args)``, report
    any error to ``$PLAIT_ERROR_DIR``."""
    _take_environment(launcher_env)
    fresh_start_method()
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    with exit_handlers():
        try:
            init_distributed(backend, timeout_s)
            out = fn(*args)
        except BaseException as e:
            write_error(e, rank, error_dir_from_env())
            if dist.is_initialized():
                dist.destroy_process_group()
            if type(e).__name__ == "Preempted":
                raise SystemExit(75) from None  # plait.fault.preempt.PREEMPTED_EXIT
            raise
        leave_cleanly(rank)
        return out


# How long a worker that ended cleanly waits for the others before it leaves its process group anyway. A peer
# still finishing its last collective needs moments (seconds on a loaded machine); a peer that runs longer is
# doing work of its own (nothing this worker takes part in), or is stuck in a collective this worker will never
# join, which its own timeout, or this worker's exit, ends.
LEAVE_WAIT_S = 60.0


def leave_cleanly(rank: int) -> None:
    """A worker that ended cleanly leaves its process group once every rank has ended (``plait.runtime.group``)
    or after ``LEAVE_WAIT_S``: exiting at once could abort a peer still in its last collective."""
    try:
        leave_process_group(LEAVE_WAIT_S)
    except Exception as e:  # the others are still busy, or the store's host is gone: this worker's work is done
        get_logger(rank).info("rank %d ended; the other ranks had not within %g s (%s): leaving without them",
                              rank, LEAVE_WAIT_S, str(e).splitlines()[0] if str(e) else type(e).__name__)
        if dist.is_initialized():
            dist.destroy_process_group()


def _reports(error_dir: Path, nproc: int, since: float = 0.0) -> list[tuple[float, int, str, Path]]:
    """Every rank's report of this attempt, earliest first: in the launcher's error directory, and in the run
    directory's ``errors/`` a ``plait run`` script noted (a file there older than ``since`` is an earlier
    run's)."""
    reports = []
    dirs = [Path(error_dir)] + [d for d in [noted_error_dir(Path(error_dir))] if d is not None]
    for d in dirs:
        for r in range(nproc):
            f = error_file(d, r)
            if f.is_file() and f.stat().st_mtime >= since:
                reports.append((f.stat().st_mtime, r, f.read_text().strip(), f))
    return sorted(reports)


def failure_message(error_dir: Path, nproc: int, fallback: str, since: float = 0.0) -> str:
    reports = _reports(error_dir, nproc, since)
    if not reports:
        return f"a worker failed without reporting an error ({fallback.strip()})"
    _, rank, text, path = reports[0]  # the earliest report is the root cause; later ones are fallout
    first_line = text.splitlines()[0] if text else "(empty report)"
    others = sorted({r for _, r, _, _ in reports if r != rank})
    also = f"; ranks {others} failed after it" if others else ""
    return f"rank {rank} failed: {first_line}{also} (details: {path})"


def _quiet_elastic_logs() -> None:
    """The agent logs each worker's traceback; plait reports the failure itself in one line and keeps the
    traceback in the error directory, so the agent's own loggers only speak for critical problems."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name.startswith("torch.distributed.launcher"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


# After a worker fails, the rest of the group gets this long to exit before SIGKILL (torch's agent waits 30 s,
# which a stopped or hung worker always uses up); a preemption keeps torch's 30 s to save.
GRACE_AFTER_FAILURE_S = 5
# Seconds a SIGTERM'd launcher gives its workers to save before SIGKILL (torch's agent: 30), less 5 for the exit.
GRACE_ENV = "PLAIT_GRACE_S"


def _exit_codes(ctx: Any) -> list[int | None]:
    """Exit codes of an elastic process context's workers (None: still running)."""
    pc = getattr(ctx, "_pc", None)
    if pc is not None and hasattr(pc, "processes"):
        return [p.exitcode for p in pc.processes]
    return [h.proc.poll() for h in getattr(ctx, "subprocess_handlers", {}).values()]


def _shorten_grace_after_failure() -> None:
    """In plait's launcher process only: when a worker fails, the others get ``GRACE_AFTER_FAILURE_S`` to exit,
    then SIGTERM, then as long again before SIGKILL (torch.multiprocessing's join waits 30 s, which a stopped
    or hung worker always uses up); and an agent ending a failed group wakes stopped workers (SIGCONT) so
    they can take its SIGTERM. A preemption (SIGTERM to the launcher) keeps torch's 30 s to save, or
    ``$PLAIT_GRACE_S`` less 5 where that is longer."""
    import contextlib
    import signal as _signal
    from importlib import import_module

    from torch.distributed.elastic.multiprocessing.api import PContext

    spawn = import_module("torch.multiprocessing.spawn")
    if getattr(PContext.close, "_plait", False):
        return
    original_close, original_join = PContext.close, spawn.ProcessContext.join

    def close(self: Any, death_sig: Any = None, timeout: int = 30) -> None:
        if any(code not in (None, 0) for code in _exit_codes(self)):
            timeout = min(timeout, GRACE_AFTER_FAILURE_S)
        elif os.environ.get(GRACE_ENV):  # the scheduler's grace (a pod's terminationGracePeriodSeconds): time to save
            timeout = max(timeout, int(float(os.environ[GRACE_ENV])) - 5)
        for pid in self.pids().values():
            with contextlib.suppress(OSError):
                os.kill(pid, _signal.SIGCONT)
        original_close(self, death_sig, timeout)

    def join(self: Any, timeout: float | None = None, grace_period: float | None = None) -> Any:
        return original_join(self, timeout, GRACE_AFTER_FAILURE_S / 2 if grace_period is None else grace_period)

    close._plait = True  # type: ignore[attr-defined]
    PContext.close = close
    spawn.ProcessContext.join = join


@dataclass(frozen=True)
class Nodes:
    """Several machines under one elastic rendezvous (``--nnodes MIN:MAX --rdzv-endpoint HOST:PORT``): the agent on
    HOST hosts it (torch's c10d backend) and must stay; ``run_id`` names the job on every machine alike;
    ``last_call_s`` is how long a rendezvous waits for more nodes once MIN have arrived; a node whose agent missed
    ``keep_alive_attempts`` heartbeats, one every ``keep_alive_s``, is dead (the others' next round leaves it out)."""

    min_nodes: int = 1
    max_nodes: int = 1
    endpoint: str = ""
    run_id: str = ""
    last_call_s: int = 10
    keep_alive_s: int = 5
    keep_alive_attempts: int = 3
    local_addr: str = ""  # --local-addr: this machine's address for the others (default: its host name's)

    @property
    def multi(self) -> bool:
        return bool(self.endpoint)


# --rdzv-conf keys (torchrun's) and the Nodes field each sets: whole seconds or counts, as torch reads them.
RDZV_CONF = {"last_call_timeout": "last_call_s", "keep_alive_interval": "keep_alive_s",
             "keep_alive_max_attempt": "keep_alive_attempts"}


def parse_nodes(nnodes: str | None, endpoint: str | None, run_id: str | None, conf: str | None = None,
                local_addr: str | None = None) -> Nodes:
    """``Nodes`` from the command line's ``--nnodes N|MIN:MAX``, ``--rdzv-endpoint``, ``--rdzv-id``,
    ``--rdzv-conf KEY=N,...`` and ``--local-addr ADDRESS`` (torchrun's spellings; keys in ``RDZV_CONF``); one clear
    error for what cannot work."""
    from plait.config import ConfigError

    if nnodes is None and endpoint is None:
        return Nodes()
    lo, _, hi = (nnodes or "1").partition(":")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise ConfigError(f"--nnodes takes N or MIN:MAX, e.g. 2 or 1:4; got {nnodes!r}") from None
    if low < 1 or high < low:
        raise ConfigError(f"--nnodes needs 1 <= MIN <= MAX; got {nnodes!r}")
    if not endpoint or ":" not in endpoint:
        raise ConfigError("several nodes meet at a rendezvous: give --rdzv-endpoint HOST:PORT (HOST: the machine that "
                          "hosts it, the same on every node) and --rdzv-id NAME")
    settings = {}
    for item in filter(None, (conf or "").split(",")):
        key, _, value = item.partition("=")
        if key not in RDZV_CONF or not value.isdigit() or (key.startswith("keep_alive") and int(value) < 1):
            raise ConfigError(f"--rdzv-conf takes {', '.join(k + '=N' for k in RDZV_CONF)} (whole numbers, the "
                              f"keep-alive ones at least 1); got {item!r}")
        settings[RDZV_CONF[key]] = int(value)
    if local_addr is not None and (not local_addr or local_addr.count(":") == 1 or any(c in local_addr for c in " /,")):
        raise ConfigError(f"--local-addr takes this machine's address (a host name or IP, no port); got {local_addr!r}")
    return Nodes(low, high, endpoint, run_id or "plait", **settings, local_addr=local_addr or "")


def rdzv_configs(nodes: Nodes) -> dict[str, Any]:
    """The c10d rendezvous settings of ``nodes`` for torch's agent."""
    out: dict[str, Any] = {"last_call_timeout": nodes.last_call_s, "join_timeout": 600,
                           "keep_alive_interval": nodes.keep_alive_s,
                           "keep_alive_max_attempt": nodes.keep_alive_attempts}
    if nodes.local_addr and nodes.local_addr == nodes.endpoint.rsplit(":", 1)[0].strip("[]"):
        # this machine is the rendezvous host by its own word: torch's guess compares the host with the host name's
        # addresses, which miss an address given by hand (where the host name resolves to loopback, say)
        out["is_host"] = True
    return out


def _launch_config(nproc: int, error_dir: Path, nodes: Nodes | None = None, agent_restarts: int = 0) -> Any:
    from torch.distributed.launcher.api import LaunchConfig

    from plait.runtime.spawn import free_port

    _quiet_elastic_logs()
    _shorten_grace_after_failure()
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ[ERROR_DIR_ENV] = str(Path(error_dir).resolve())
    for stale in Path(error_dir).glob("rank*.txt"):  # reports of an earlier launch into the same directory
        stale.unlink()
    if nodes is not None and nodes.multi:
        # A machine that joins needs this. torch 2.13 shares a store with the workers (TORCHELASTIC_USE_AGENT_STORE),
        # and DynamicRendezvousHandler.next_rendezvous (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py)
        # publishes its address (RendezvousStoreInfo.build, rendezvous/api.py) only in the first round a node is
        # rank 0 of, while the keys are the round's own: when a node joins and the old rank 0 stays rank 0, the
        # new node waits for MASTER_ADDR of the new round (DistStoreError after 60 s, keys
        # /torch.rendezvous.<id>.<round>/MASTER_ADDR), its peer for it, and both agents fail. Without the sharing,
        # rank 0 publishes a fresh address every round and its worker hosts the workers' store.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        return LaunchConfig(
            min_nodes=nodes.min_nodes, max_nodes=nodes.max_nodes, nproc_per_node=nproc, run_id=nodes.run_id,
            rdzv_backend="c10d", rdzv_endpoint=nodes.endpoint, max_restarts=agent_restarts, monitor_interval=0.5,
            start_method=START_METHOD,
            rdzv_configs=rdzv_configs(nodes), local_addr=nodes.local_addr or None)
    return LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"plait-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0,
        monitor_interval=0.5, start_method=START_METHOD,
    )


# Workers are forked from multiprocessing's fork server, which imports torch and plait's training code once
# (``WORKER_IMPORTS``), instead of starting a fresh interpreter each (seconds of imports per worker, paid again at
# every restart); where the platform has no fork server they are spawned.
START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
WORKER_IMPORTS = ["torch", "torch.distributed", "plait.launch", "plait.engine", "plait.train.trainer",
                  "plait.recipes", "plait.parallel.compose"]


def _start_fork_server() -> None:
    if START_METHOD == "forkserver":
        from multiprocessing import forkserver

        multiprocessing.set_forkserver_preload([*WORKER_IMPORTS, "plait.runtime.gc_freeze"])  # last (its docstring)
        forkserver.ensure_running()


class RunPreempted(RuntimeError):
    """SIGTERM/SIGINT ended the job; ``str()`` says where it saved and how to resume."""


class NoProgress(WorkerFailed):
    """Restarts kept failing without progress; the launcher stopped instead of looping."""


@dataclass
class Restarts:
    """The restart policy of one launch (``[fault]``) and where the workers note their progress."""

    max_restarts: int = 0
    backoff_s: float = 1.0
    state_dir: Path | None = None


def _first_report(error_dir: Path, nproc: int, since: float = 0.0) -> str:
    reports = _reports(error_dir, nproc, since)
    return reports[0][2].splitlines()[0] if reports and reports[0][2] else ""


def _preempted_message(state_dir: Path | None) -> str | None:
    marker = Path(state_dir) / "preempted.json" if state_dir is not None else None
    if marker is None or not marker.is_file():
        return None
    import json

    info = json.loads(marker.read_text())
    return f"the run was preempted at step {info['step']}; every rank saved {info['checkpoint']}"


def _attempts(run: Callable[[int], Any], nproc: int, error_dir: Path, restarts: Restarts) -> Any:
    """Run ``run(attempt)`` until it succeeds, restarting per ``restarts`` (see plait.fault.restart)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from plait.fault import goodput
    from plait.fault.restart import clear_progress, decide, read_progress

    if restarts.state_dir is not None:
        clear_progress(restarts.state_dir)
        goodput.record(restarts.state_dir, "launch")
    previous: dict | None = None
    attempt, streak = 0, 0
    while True:
        started, started_wall = time.monotonic(), time.time() - 1.0  # mtimes may round down a second
        try:
            return run(attempt)
        except SignalException as e:
            raise RunPreempted(_preempted_message(restarts.state_dir) or f"the job was stopped by {e.sigval.name}") \
                from None
        except ChildFailedError as e:
            message = failure_message(Path(error_dir), nproc, str(e), started_wall)
            preempted = _preempted_message(restarts.state_dir)
            if preempted is not None:
                raise RunPreempted(preempted) from None
            progress = read_progress(restarts.state_dir) if restarts.state_dir is not None else {}
            if restarts.state_dir is not None:
                goodput.record(restarts.state_dir, "failed", attempt=attempt)
            # Backoff doubles over failures in quick succession; an attempt that ran a minute resets it.
            streak = 0 if time.monotonic() - started > 60 else streak + 1
            first = _first_report(Path(error_dir), nproc, started_wall)
            d = decide(first, attempt, restarts.max_restarts, progress, previous, restarts.backoff_s, streak)
            if not d.restart:
                suffix = f" (not restarted: {d.reason})" if restarts.max_restarts else ""
                raise (NoProgress if d.no_progress else WorkerFailed)(message + suffix) from None
            print(f"plait: {message}; restart {attempt + 1} of {restarts.max_restarts} in {d.wait_s:g}s, from the "
                  "newest good checkpoint", file=sys.stderr, flush=True)
            time.sleep(d.wait_s)
            previous, attempt = progress, attempt + 1


def launch_local(fn: Callable[..., Any], args: Callable[[int], tuple] | tuple, nproc: int, error_dir: Path,
                 backend: str = "auto", timeout_s: float = 300.0, restarts: Restarts | None = None,
                 nodes: Nodes | None = None) -> Any:
    """Run ``fn(*args)`` in ``nproc`` local workers under the elastic agent; returns local rank 0's result.

    ``args`` may be a function of the attempt number (0 first, 1 after the first restart...), so a
    restarted attempt can resume. On several nodes (``nodes``) the agent restarts the workers itself, with the
    same ``args``: ``fn`` must resume whenever the run holds a checkpoint (``TORCHELASTIC_RESTART_COUNT`` counts
    only failures, each agent its own, so a join leaves it as it was). Raises ``WorkerFailed``
    (``NoProgress``) or ``RunPreempted``."""
    from torch.distributed.launcher.api import elastic_launch

    restarts, agent_restarts = _split_restarts(restarts or Restarts(), nodes)

    def run(attempt: int) -> Any:
        lc = _launch_config(nproc, error_dir, nodes, agent_restarts)
        os.environ["PLAIT_ATTEMPT"] = str(attempt)
        _start_fork_server()
        call_args = args(attempt) if callable(args) else args
        results = elastic_launch(lc, run_worker)(fn, call_args, backend, timeout_s, dict(os.environ))
        return results[min(results)]

    return _attempts(run, nproc, error_dir, restarts)


def _split_restarts(restarts: Restarts, nodes: Nodes | None) -> tuple[Restarts, int]:
    """On several nodes the agents restart the group together (one rendezvous: a launcher starting its own would
    leave the others); on one, plait's launcher does (its restart decisions, backoff and progress checks)."""
    if nodes is None or not nodes.multi:
        return restarts, 0
    return Restarts(0, restarts.backoff_s, restarts.state_dir), restarts.max_restarts


def launch_script(script: str, script_args: list[str], nproc: int, error_dir: Path,
                  restarts: Restarts | None = None, nodes: Nodes | None = None) -> None:
    """Run ``python script args`` in ``nproc`` local workers (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` set
    as torchrun sets them, ``PLAIT_ATTEMPT`` counting restarts, ``TORCHELASTIC_RESTART_COUNT`` the agents' restarts
    on several nodes); raises ``WorkerFailed`` naming the first rank that failed, or ``RunPreempted``."""
    from torch.distributed.launcher.api import elastic_launch

    restarts, agent_restarts = _split_restarts(restarts or Restarts(state_dir=Path(error_dir).parent), nodes)

    def run(attempt: int) -> None:
        lc = _launch_config(nproc, error_dir, nodes, agent_restarts)
        os.environ["PLAIT_ATTEMPT"] = str(attempt)
        elastic_launch(lc, sys.executable)("-m", "plait.launch", script, *script_args)

    _attempts(run, nproc, error_dir, restarts)


def _script_error_dir() -> Path | None:
    """Where a ``plait run`` script's uncaught error goes: its run directory's ``errors/`` once plait.Plait
    noted it, else the launcher's directory."""
    launcher_dir = error_dir_from_env()
    return noted_error_dir(launcher_dir) or launcher_dir


def _script_main(argv: list[str]) -> int:
    """A worker of ``launch_script``: run the user's script as ``__main__`` and report its error."""
    script, rest = argv[0], argv[1:]
    sys.argv = [script, *rest]
    sys.path.insert(0, str(Path(script).resolve().parent))
    rank = int(os.environ.get("RANK", "0"))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            write_error(RuntimeError(f"the script exited with status {e.code}"), rank, _script_error_dir())
            raise
    except BaseException as e:
        write_error(e, rank, _script_error_dir())
        raise SystemExit(1) from None
    leave_cleanly(rank)  # the script may have left its group open (plait.Plait keeps it for the user)
    return 0


if __name__ == "__main__":
    sys.exit(_script_main(sys.argv[1:]))
