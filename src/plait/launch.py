"""Starting workers: local ones through PyTorch's elastic agent, or adopting torchrun / SLURM.

``plait train`` with ``parallel.nproc=N`` starts N local workers with ``elastic_launch`` (the agent
behind ``torchrun``). When plait itself is started by ``torchrun`` (``RANK``/``WORLD_SIZE`` set) or
by ``srun`` (``SLURM_PROCID`` set), the same entry point runs as one worker of that job. A failed
worker leaves ``RUN_DIR/errors/rank<r>.txt``; the launcher turns it into one line naming the rank
and its error, and a non-zero exit.
"""

from __future__ import annotations

import logging
import os
import re
import traceback
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait.config import Config, ConfigError


class WorkerFailed(RuntimeError):
    """One or more workers failed; ``str()`` names the first failing rank and its error."""


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


def pick_backend(cfg: Config) -> str:
    if cfg.comm.backend != "auto":
        if cfg.comm.backend == "nccl" and not torch.cuda.is_available():
            raise ConfigError("comm.backend=nccl needs CUDA GPUs; use comm.backend=gloo (or auto) on CPU")
        return cfg.comm.backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def error_file(run_dir: Path, rank: int) -> Path:
    """Where worker ``rank`` reports the error that ended it (its first line is what the launcher prints)."""
    return run_dir / "errors" / f"rank{rank}.txt"


def worker_main(cfg: Config, run_dir: str, resume: bool) -> dict[str, Any]:
    """Entry point of one worker: join the process group, train, report any error to the run dir."""
    from plait.train.trainer import train

    adopt_slurm_env()
    rank = int(os.environ.get("RANK", "0"))
    try:
        dist.init_process_group(pick_backend(cfg), timeout=timedelta(seconds=cfg.comm.timeout_s))
        return train(cfg, Path(run_dir), resume)
    except BaseException as e:
        path = error_file(Path(run_dir), rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        detail = "" if isinstance(e, ConfigError) else "\n" + traceback.format_exc()
        path.write_text(f"{type(e).__name__}: {e}{detail}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _failure_message(run_dir: Path, nproc: int, fallback: str) -> str:
    reports = []
    for r in range(nproc):
        f = error_file(run_dir, r)
        if f.is_file():
            reports.append((f.stat().st_mtime, r, f.read_text().strip()))
    if not reports:
        return f"a worker failed without reporting an error ({fallback.strip()})"
    _, rank, text = min(reports)  # the earliest report is the root cause; later ones are fallout
    first_line = text.splitlines()[0]
    others = sorted(r for _, r, _ in reports if r != rank)
    also = f"; ranks {others} failed after it" if others else ""
    return f"rank {rank} failed: {first_line}{also} (details: {error_file(run_dir, rank)})"


def _quiet_elastic_logs() -> None:
    """The agent logs each worker's traceback; plait reports the failure itself in one line and keeps the
    traceback in RUN_DIR/errors, so the agent's own loggers only speak for critical problems."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name.startswith("torch.distributed.launcher"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def launch_local(cfg: Config, run_dir: Path, resume: bool) -> dict[str, Any]:
    """Run ``cfg.parallel.nproc`` local workers under the elastic agent; returns rank 0's summary."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from plait.comm.collectives import free_port

    _quiet_elastic_logs()
    nproc = cfg.parallel.nproc
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    lc = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"plait-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0,
        monitor_interval=0.5, start_method="spawn",
    )
    try:
        results = elastic_launch(lc, worker_main)(cfg, str(run_dir), resume)
    except ChildFailedError as e:
        raise WorkerFailed(_failure_message(run_dir, nproc, str(e))) from None
    return results[0]
