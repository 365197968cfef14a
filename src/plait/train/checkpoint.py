"""Sharded checkpoints on ``torch.distributed.checkpoint`` (DCP), saved so a crash never damages one.

Layout under ``RUN_DIR/checkpoints``::

    step_000200/            DCP shards of {"model", "optim"} + rank<r>.pt (RNG, comm state) + meta.json
    latest                  the name of the newest complete checkpoint

Every rank writes into ``step_N.tmp``; after a barrier rank 0 writes ``meta.json``, renames the
directory to ``step_N`` and then atomically replaces ``latest``. A crash at any point leaves
``latest`` naming the previous complete checkpoint; leftover ``.tmp`` directories are ignored and
cleaned up. Model and optimizer states come from the layout (``Layout.state_dicts``), keyed by the
single-process model's parameter names whatever the sharding, so DCP can load them at another world
size or ZeRO stage. Nothing is ever unpickled: DCP
reads tensors, per-rank state is read with ``weights_only=True``, metadata is JSON.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from plait.config import ConfigError


class StatefulLayout(Protocol):
    def state_dicts(self) -> tuple[dict, dict]: ...

    def load_state_dicts(self, model_sd: dict, optim_sd: dict) -> None: ...


class CheckpointError(ConfigError):
    """A checkpoint is missing or unusable; the message says what to do."""


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of ``run_dir``, or None when it holds none."""
    root = checkpoint_root(run_dir)
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if not (path / "meta.json").is_file():
        raise CheckpointError(
            f"{pointer} names {path.name}, which is incomplete or missing; delete {pointer} to start over, "
            "or restore the checkpoint directory"
        )
    return path


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(run_dir: Path, step: int, layout: StatefulLayout, meta: dict[str, Any], rank: int,
                    keep: int, rank_state: dict[str, Any] | None = None) -> Path:
    """Save a complete checkpoint for ``step``; every rank calls it. Returns the final directory.

    ``rank_state`` is this rank's own state beyond RNGs (the comm layer's compressor residuals,
    which differ per rank); it must hold only tensors, numbers, strings, lists and dicts, as it is
    read back with ``weights_only=True``."""
    root = checkpoint_root(run_dir)
    name = f"step_{step:07d}"
    tmp, final = root / f"{name}.tmp", root / name
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    model_sd, optim_sd = layout.state_dicts()
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp), no_dist=not _distributed())
    torch.save({**rng_state(), "rank_state": rank_state}, tmp / f"rank{rank}.pt")
    _barrier()
    if rank == 0:
        (tmp / "meta.json").write_text(json.dumps({**meta, "step": step}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer_tmp = root / "latest.tmp"
        pointer_tmp.write_text(name)
        os.replace(pointer_tmp, root / "latest")
        _prune(root, keep)
    _barrier()
    return final


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    latest = (root / "latest").read_text().strip()
    for p in done[: max(0, len(done) - keep)]:
        if p.name != latest:
            shutil.rmtree(p)
    for p in root.glob("step_*.tmp"):
        shutil.rmtree(p, ignore_errors=True)


def load_checkpoint(path: Path, layout: StatefulLayout, rank: int) -> dict[str, Any]:
    """Load model and optimizer state (resharded by DCP to this world size) and this rank's RNG.

    Returns the checkpoint's metadata (step, sampler position, scaler state, counters), with this
    rank's ``rank_state`` (see ``save_checkpoint``; None if absent) under ``"rank_state"``.
    """
    meta = json.loads((path / "meta.json").read_text())
    model_sd, optim_sd = layout.state_dicts()
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path), no_dist=not _distributed())
    layout.load_state_dicts(state["model"], state["optim"])
    rank_file = path / f"rank{rank}.pt"
    meta["rank_state"] = None
    if rank_file.is_file():
        saved = torch.load(rank_file, weights_only=True)
        set_rng_state(saved)
        meta["rank_state"] = saved.get("rank_state")
    return meta
