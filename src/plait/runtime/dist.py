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
    restart = env.get("TORCHELASTIC_RESTART_COUNT")
    if restart is not None and "MASTER_ADDR" in env and env.get("TORCHELASTIC_USE_AGENT_STORE", "") == "True":
        # After torchrun restarts a worker group, env:// rendezvous finds the dead attempt's gloo addresses
        # in the agent's store, which outlives the attempt (torch 2.13: "connectFullMesh failed ... Connection
        # refused"); a prefix per attempt keeps each attempt's keys apart. Only there: without the agent's store
        # rank 0 hosts a new one each attempt, and the restart count, which each agent keeps for itself, differs
        # between an agent that restarted and one that just joined, so ranks would wait under different prefixes.
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False, timeout=timeout)
        dist.init_process_group(pick_backend(backend), store=dist.PrefixStore(f"plait/attempt_{restart}", store),
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
