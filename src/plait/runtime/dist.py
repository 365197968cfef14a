"""Joining a job's process group and reporting a worker's error: what every layer that runs on a worker
needs of the launcher (``plait.launch`` starts workers; this module runs inside them).

When a process was started by ``torchrun`` (``RANK``/``WORLD_SIZE`` set) or ``srun`` (``SLURM_PROCID`` set),
``init_distributed`` joins that job's process group. A failed worker leaves ``<error_dir>/rank<r>.txt``,
which the launcher turns into one line naming the rank and its error; workers find the error directory in
``$PLAIT_ERROR_DIR``.
"""

from __future__ import annotations

import os
import re
import secrets
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from plait.config import ConfigError

ERROR_DIR_ENV = "PLAIT_ERROR_DIR"
# Set by `plait run`: a worker's errors go to its run directory's errors/ once plait.Plait knows it, and rank 0
# notes that directory in RUN_DIR_NOTE beside the launcher's error directory, where the launcher looks too.
FOLLOW_RUN_DIR_ENV = "PLAIT_ERRORS_IN_RUN_DIR"
RUN_DIR_NOTE = "run_dir"


def launched_externally() -> bool:
    """True when torchrun or SLURM started this process as one worker of a job."""
    return ("RANK" in os.environ and "WORLD_SIZE" in os.environ) or "SLURM_PROCID" in os.environ


def external_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS", "1"))


def _first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM nodelist such as ``node[03-05,07],gpu1`` -> ``node03``."""
    m = re.match(r"([^\[,]+)(?:\[([^\]]+)\])?", nodelist)
    if not m:
        return nodelist
    prefix, ranges = m.group(1), m.group(2)
    return prefix + ranges.split(",")[0].split("-")[0] if ranges else prefix


def adopt_slurm_env() -> None:
    """Map SLURM's variables onto the ones ``init_process_group(init_method='env://')`` reads."""
    if "SLURM_PROCID" not in os.environ or "RANK" in os.environ:
        return
    env = os.environ
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env.get("SLURM_NTASKS", "1")
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env.setdefault("MASTER_ADDR", _first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1")))
    env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))


def pick_backend(backend: str) -> str:
    """``comm.backend``: auto picks NCCL with CUDA, gloo otherwise."""
    if backend != "auto":
        if backend == "nccl" and not torch.cuda.is_available():
            raise ConfigError("comm.backend=nccl needs CUDA GPUs; use comm.backend=gloo (or auto) on CPU")
        return backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def agent_restarts() -> int:
    """How many times torchrun's agent started this worker's group again after a failure it counted
    (``TORCHELASTIC_RESTART_COUNT``; an agent whose workers were stopped for another machine's restart does not count
    it); 0 outside an agent."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def restarted_by_agent() -> bool:
    """Whether torchrun's agent started this worker again after a failure it counted (``agent_restarts``)."""
    return agent_restarts() > 0


def attempt_key(store: dist.Store, rank: int, world: int, timeout_s: float, poll_s: float = 0.02) -> str:
    """A key that the ``world`` ranks of this attempt agree on, in a store where earlier attempts left theirs.

    Rank 0 publishes a fresh random key under ``plait/leader``; every other rank answers under ``plait/join/<rank>``
    with the key it read and a fresh random key of its own; when every answer names rank 0's key, rank 0 lists the
    ranks' own keys under ``plait/go/<key>``. A rank that read an earlier attempt's leader finds that attempt's list
    without its own fresh key in it, reads the leader again and answers again: only fresh keys confirm anything, so
    the stale values of a dead attempt are never taken for this one's. Store traffic: a few keys per rank, once per
    attempt."""
    mine = secrets.token_hex(8)
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        store.set("plait/leader", mine)
        waiting = [f"plait/join/{r}" for r in range(1, world)]
        joined: dict[str, str] = {}
        while waiting:
            if store.check(waiting):
                for k, v in zip(waiting, store.multi_get(waiting), strict=True):
                    leader, _, theirs = v.decode().partition(":")
                    if leader == mine:
                        joined[k] = theirs
                waiting = [k for k in waiting if k not in joined]
            if waiting:
                if time.monotonic() > deadline:  # name the ranks that have not answered this attempt's leader
                    late = [k for k in waiting if not store.check([k]) or not store.get(k).decode().startswith(mine)]
                    raise TimeoutError(f"ranks {sorted(int(k.rsplit('/', 1)[1]) for k in late)} did not join "
                                       f"this attempt's process group within {timeout_s:g} s")
                time.sleep(poll_s)
        store.set(f"plait/go/{mine}", ",".join(joined.values()))
        return mine
    answered = ""
    while True:
        leader = store.get("plait/leader").decode()  # waits for the key (the store's timeout)
        if leader != answered:
            store.set(f"plait/join/{rank}", f"{leader}:{mine}")
            answered = leader
        go = f"plait/go/{leader}"
        if store.check([go]) and mine in store.get(go).decode().split(","):
            return leader
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 did not admit rank {rank} to this attempt's process group within "
                               f"{timeout_s:g} s")
        time.sleep(poll_s)


def init_distributed(backend: str, timeout_s: float) -> bool:
    """Join the job's process group when a launcher started this process and none exists yet; returns
    whether a process group is initialised afterwards (False: a plain single process)."""
    if dist.is_available() and dist.is_initialized():
        return True
    adopt_slurm_env()
    if not launched_externally():
        return False
    timeout = timedelta(seconds=timeout_s)
    env = os.environ
    shared = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if "TORCHELASTIC_RESTART_COUNT" in env and "MASTER_ADDR" in env and shared:
        # The agents' shared store outlives an attempt: env:// rendezvous would find the dead attempt's gloo
        # addresses there (torch 2.13: "connectFullMesh failed ... Connection refused"), so each attempt's keys go
        # under a prefix its ranks agree on (``attempt_key``). Not the restart count: each agent keeps its own, and
        # an agent whose workers were stopped for another machine's restart does not count it.
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False, timeout=timeout)
        key = attempt_key(store, rank, world, timeout_s)
        dist.init_process_group(pick_backend(backend), store=dist.PrefixStore(f"plait/attempt_{key}", store),
                                rank=rank, world_size=world, timeout=timeout)
        return True
    dist.init_process_group(pick_backend(backend), timeout=timeout)
    return True


def error_file(error_dir: Path, rank: int) -> Path:
    """Where worker ``rank`` reports the error that ended it (its first line is what the launcher prints)."""
    return Path(error_dir) / f"rank{rank}.txt"


def error_dir_from_env(default: Path | None = None) -> Path | None:
    value = os.environ.get(ERROR_DIR_ENV)
    return Path(value) if value else default


def noted_error_dir(launcher_dir: Path | None) -> Path | None:
    """The run directory's ``errors/`` that a worker of ``plait run`` noted beside the launcher's error
    directory (None before the script created ``plait.Plait``, or under another launcher)."""
    note = Path(launcher_dir).parent / RUN_DIR_NOTE if launcher_dir is not None else None
    if note is None or not note.is_file():
        return None
    return Path(note.read_text().strip()) / "errors"


def write_error(exc: BaseException, rank: int, error_dir: Path | None) -> None:
    """Record ``exc`` for the launcher: ``Type: message`` first, then the traceback (left out for a
    configuration error the user caused, unless it wraps another error: a user's factory that raised)."""
    if error_dir is None:
        return
    path = error_file(error_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    plain = isinstance(exc, ConfigError) and exc.__cause__ is None
    detail = "" if plain else "\n" + "".join(traceback.format_exception(exc))
    if not path.exists():  # the watchdog may have written a better one already
        path.write_text(f"{type(exc).__name__}: {exc}{detail}")
