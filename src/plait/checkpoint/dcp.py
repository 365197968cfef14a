"""Sharded checkpoints on ``torch.distributed.checkpoint`` (DCP), saved so a crash never damages one.

``save_state(path, ...)`` writes one complete checkpoint directory::

    PATH/                  DCP shards of {"model", "optim"}
        rank<r>.pt         each rank's own state: RNG, compressor residuals
        state.pt           state every rank shares: scheduler, data position, loss scale, counters
        manifest.json      SHA-256 and size of every file above (``plait.checkpoint.integrity``)
        meta.json          what the caller saved in ``extra`` plus the world size; written last

Every rank writes into ``PATH.tmp``; after a barrier rank 0 writes the manifest and ``meta.json`` and
renames the directory to ``PATH``. A crash at any point leaves no ``PATH`` (or the previous one
untouched), and a file damaged later is caught by the manifest before anything is loaded. With
``async_`` the shards are written by DCP's background thread while training goes on; the returned
``PendingSave`` completes the checkpoint (manifest, meta, rename) when ``finish()`` is called, on every
rank at the same point. Model
and optimizer states come from the layout's state (``Layout.state.state_dicts``), keyed by the single-process
model's parameter names whatever the sharding, so DCP can load them at another world size, ZeRO stage
or layout (a layout with chunks of its own, a parameter server's, also gives DCP planners for them:
``save_planner()`` / ``load_planner()``). Nothing is ever unpickled: DCP reads tensors, ``*.pt`` files
are read with ``weights_only=True``, metadata is JSON.

A training run keeps several under ``RUN_DIR/checkpoints``: ``step_0000200/`` ... and ``latest``, a
file naming the newest complete one, replaced atomically after each save (``point_latest``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from plait.config import ConfigError


class StatefulLayout(Protocol):
    """What a checkpoint is written from and read into: a layout's state (``Layout.state``:
    ``plait.checkpoint.layout_state``), or a parameter server's shard (``plait.ps.checkpoint.ServerCheckpoint``).
    The planners may be None (DCP's)."""

    def state_dicts(self) -> tuple[dict, dict]: ...

    def load_state_dicts(self, model_sd: dict, optim_sd: dict) -> None: ...

    def save_planner(self) -> Any: ...

    def load_planner(self) -> Any: ...


class CheckpointError(ConfigError):
    """A checkpoint is missing or unusable; the message says what to do."""


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier(group: Any = None) -> None:
    if _distributed():
        dist.barrier(group=group)


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that it assumes one process when no process group exists: that is the intent here."""
    with warnings.catch_warnings():
        if not _distributed():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class PendingSave:
    """A checkpoint whose shards are being written; ``finish()`` (every rank, same point) completes it.

    Asynchronous (a DCP future): a background thread waits for this rank's shard writes, meets the other
    ranks on the checkpoint's own process group, and on rank 0 hashes every file into the manifest and
    writes meta.json, all while training goes on; ``finish()`` joins it (usually done by then), renames
    the directory and meets the ranks once more. The checkpoint is complete only after that rename."""

    def __init__(self, path: Path, tmp: Path, meta_text: str, rank: int, future: Any, group: Any) -> None:
        self.path, self.tmp, self.meta_text, self.rank = path, tmp, meta_text, rank
        self.future, self.group = future, group
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if future is not None:
            self._thread = threading.Thread(target=self._complete, name="plait-checkpoint", daemon=True)
            self._thread.start()

    def _complete(self) -> None:
        try:
            if self.future is not None:
                self.future.result()
            _barrier(self.group)
            if self.rank == 0:
                from plait.checkpoint.integrity import write_manifest

                write_manifest(self.tmp)
                (self.tmp / "meta.json").write_text(self.meta_text)
        except BaseException as e:  # raised again by finish() on the training thread
            self._error = e

    def finish(self) -> Path:
        """Wait for the shard writes and (rank 0) the manifest and meta.json, then the rename. Collective."""
        if self._thread is not None:
            self._thread.join()
        else:
            self._complete()
        if self._error is not None:
            if self.rank == 0:  # nothing half-written is left: the previous checkpoint stays the newest
                shutil.rmtree(self.tmp, ignore_errors=True)
            raise self._error
        if self.rank == 0:
            if self.path.exists():
                shutil.rmtree(self.path)
            os.replace(self.tmp, self.path)
        _barrier(self.group)
        return self.path


def _test_kill(path: Path, rank: int, where: str) -> None:
    """Testing aid: ``PLAIT_TEST_KILL_IN_SAVE="step_0000008:between:1"`` SIGKILLs rank 1 while it writes that
    checkpoint, before its shards, between shards and state files, or after both (before completion)."""
    spec = os.environ.get("PLAIT_TEST_KILL_IN_SAVE")
    if spec and spec == f"{path.name}:{where}:{rank}" and os.environ.get("PLAIT_ATTEMPT", "0") == "0":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def save_state(path: Path, layout: StatefulLayout, meta: dict[str, Any], rank: int,
               rank_state: dict[str, Any] | None = None, shared: dict[str, Any] | None = None, *,
               async_: bool = False, group: Any = None) -> PendingSave:
    """Write a checkpoint at ``path`` (see the module docstring); every rank calls it.

    ``meta`` must be JSON-serializable; ``rank_state`` (this rank's) and ``shared`` (rank 0's is written)
    may hold only tensors, numbers, strings, lists, tuples and dicts, as they are read back with
    ``weights_only=True``. Returns the save, complete unless ``async_`` (then call ``finish()``). ``group``:
    the process group for DCP and the barriers (an asynchronous save needs its own, so its background
    collectives never interleave with training's). Collective: barriers and DCP's own collectives.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        meta_text = json.dumps(meta, indent=1)
    except TypeError as e:
        raise CheckpointError(f"checkpoint metadata must be JSON-serializable (numbers, strings, lists, dicts): "
                              f"{e}") from None
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(group)
    _test_kill(path, rank, "before")
    future = None
    try:
        model_sd, optim_sd = layout.state_dicts()
        state = {"model": model_sd, "optim": optim_sd}
        planner = layout.save_planner()  # a layout's own chunks, or None for DCP's default
        with _quiet_single_process():
            if async_ and _distributed():
                future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=group, planner=planner)
            elif async_:
                future = dcp.async_save(state, checkpoint_id=str(tmp), no_dist=True, planner=planner)
            else:
                dcp.save(state, checkpoint_id=str(tmp), no_dist=not _distributed(), process_group=group,
                         planner=planner)
        _test_kill(path, rank, "between")
        torch.save({**rng_state(), "rank_state": rank_state}, tmp / f"rank{rank}.pt")
        if rank == 0:
            torch.save(shared or {}, tmp / "state.pt")
    except Exception:  # a save that fails leaves no directory behind: the previous checkpoint stays the newest
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _test_kill(path, rank, "after")
    pending = PendingSave(path, tmp, meta_text, rank, future, group)
    if not async_:
        pending.finish()
    return pending


def _verified_on_rank0(path: Path, group: Any = None) -> list[str]:
    """The manifest check, done once (rank 0 reads every file) and shared with every rank of ``group``."""
    from plait.checkpoint.integrity import verify

    problems = [verify(path)] if not _distributed() or dist.get_rank() == 0 else [None]
    if _distributed():
        dist.broadcast_object_list(problems, src=0, group=group)
    return problems[0]


def load_state(path: Path, layout: StatefulLayout, rank: int, restore_rank: bool = True,
               verify: bool = True, group: Any = None) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
    """Load model and optimizer state (resharded by DCP to this layout and world size) from ``path``.

    Returns ``(meta, rank_state, shared)``. With ``restore_rank`` this rank's RNG is restored and its
    ``rank_state`` returned when the checkpoint has a file for this rank (None otherwise). With ``verify``
    every file is checked against the manifest first (``CheckpointError`` naming the damaged file).
    ``group``: the ranks that load (None: all; a parameter server's workers).
    """
    path = Path(path)
    if verify:
        problems = _verified_on_rank0(path, group)
        if problems:
            raise CheckpointError(f"{path} is damaged: {problems[0]}" + (f" (and {len(problems) - 1} more problems)"
                                  if len(problems) > 1 else "") + "; load an earlier checkpoint, or pass verify=False "
                                  "to load it anyway")
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise CheckpointError(f"{path} is not a complete plait checkpoint (no meta.json); point at a directory "
                              "written by Plait.save")
    meta = json.loads(meta_file.read_text())
    model_sd, optim_sd = layout.state_dicts()
    state = {"model": model_sd, "optim": optim_sd}
    planner = layout.load_planner()
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=str(path), no_dist=not _distributed(), process_group=group, planner=planner)
    layout.load_state_dicts(state["model"], state["optim"])
    rank_state = None
    rank_file = path / f"rank{rank}.pt"
    if restore_rank and rank_file.is_file():
        saved = torch.load(rank_file, weights_only=True)
        set_rng_state(saved)
        rank_state = saved.get("rank_state")
    shared_file = path / "state.pt"
    shared = torch.load(shared_file, weights_only=True) if shared_file.is_file() else {}
    return meta, rank_state, shared


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(run_dir: Path, step: int) -> Path:
    return checkpoint_root(run_dir) / f"step_{step:07d}"


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


def point_latest(run_dir: Path, path: Path, keep: int) -> None:
    """Make ``path`` (a complete checkpoint under ``run_dir``) the latest, then keep only the newest
    ``keep`` and remove leftovers of crashed saves. Rank 0 only."""
    root = checkpoint_root(run_dir)
    pointer_tmp = root / "latest.tmp"
    pointer_tmp.write_text(Path(path).name)
    os.replace(pointer_tmp, root / "latest")
    done = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    for p in done[: max(0, len(done) - keep)]:
        if p.name != Path(path).name:
            shutil.rmtree(p)
    for p in root.glob("step_*.tmp"):
        shutil.rmtree(p, ignore_errors=True)
