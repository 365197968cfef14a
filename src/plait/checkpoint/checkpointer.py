"""Checkpoints of one run: complete, reshardable saves (synchronous or asynchronous) and loads, through
the layout's state (``Layout.state``; ``plait.checkpoint.dcp`` writes and reads the files); a part of the layout
whose other ranks join a checkpoint (a parameter server's servers: ``plait.parallel.capabilities.CheckpointJoin``)
is asked first."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from plait.checkpoint.dcp import PendingSave, load_state, save_state
from plait.checkpoint.memory import Decoded, load, pack
from plait.observe.log import get_logger
from plait.parallel.capabilities import CheckpointJoin, checkpoint_group


class Checkpointer:
    """Saves and loads for one ``Plait``. An asynchronous save (``checkpoint.async``) runs DCP's collectives
    on a background thread, on a group of its own so they never interleave with training's on the same
    channels; it completes at the next ``finish`` (the next optimizer step, save or close)."""

    def __init__(self, async_save: bool, world_size: int, train_group: Any,
                 on_saved: Callable[[Path, int], None], host_copy: Any = None) -> None:
        self.async_save = async_save
        self.host_copy = host_copy  # plait.fault.holder.Holders: the in-memory copies at each save (None: off)
        self.last_copy_s: float | None = None  # seconds the last save's in-memory copy took (None: none made)
        self._copy_failed = False
        self.train_group = train_group
        self.own_group = dist.new_group(backend="gloo") if world_size > 1 and async_save else None
        self.on_saved = on_saved  # (path, step): the engine logs it and notes the saved step
        self._pending: tuple[PendingSave, Callable[[Path], None] | None, int] | None = None
        self.last_blocking_s = 0.0  # seconds the last save blocked training
        self.finish_blocking_s = 0.0  # seconds spent completing asynchronous saves (the Trainer records them)

    def save(self, path: Path, strategy: Any, meta: dict[str, Any], rank: int, rank_state: dict[str, Any],
             shared: dict[str, Any], step: int, on_complete: Callable[[Path], None] | None, is_main: bool) -> Path:
        """Write the checkpoint (see ``Plait.save``); returns its final path."""
        t0 = time.perf_counter()
        join = strategy.capability(CheckpointJoin)
        if join is not None:
            join.begin_save(path)
        default = self.own_group if self.own_group is not None else self.train_group
        pending = save_state(path, strategy.state, meta, rank, rank_state, shared, async_=self.async_save,
                             group=checkpoint_group(strategy, default))
        if self.host_copy is not None:  # only a save pays for it: serialise and send this rank's copies
            t1 = time.perf_counter()
            failed = self.host_copy.put(rank, step, int(meta["world_size"]),
                                        pack(strategy.state, meta, rank_state, shared))
            self.last_copy_s = time.perf_counter() - t1 if not failed else None
            if failed and not self._copy_failed:  # said once; the disk checkpoint is complete either way
                get_logger(rank).warning("the in-memory copy of %s failed (holder %s unreachable): a restart loads "
                                         "from the other copy or from disk", path.name, ", ".join(failed))
            self._copy_failed = bool(failed)
        self.last_blocking_s = time.perf_counter() - t0
        if self.async_save:
            self._pending = (pending, on_complete, step)
        else:
            self._completed(pending.path, on_complete, step, is_main)
        return pending.path

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def finish(self, is_main: bool) -> None:
        """Complete an asynchronous save still being written (collective; nothing when there is none)."""
        if self._pending is None:
            return
        pending, on_complete, step = self._pending
        self._pending = None
        t0 = time.perf_counter()
        self._completed(pending.finish(), on_complete, step, is_main)
        self.finish_blocking_s += time.perf_counter() - t0  # the wait for the background completion

    def _completed(self, path: Path, on_complete: Callable[[Path], None] | None, step: int, is_main: bool) -> None:
        self.on_saved(path, step)
        if on_complete is not None and is_main:
            on_complete(path)

    def load(self, path: Path, strategy: Any, rank: int, world_size: int, verify: bool,
             memory: Decoded | None = None) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any], bool]:
        """Read a checkpoint into ``strategy``: (meta, this rank's own state or None, the shared state,
        whether it was saved at this world size). ``memory``: this rank's in-memory copy of the same checkpoint
        (``plait.checkpoint.memory``), read instead of the disk."""
        if memory is not None:
            meta, rank_state, shared = load(memory, strategy.state)
            return meta, rank_state, shared, True
        meta_path = Path(path) / "meta.json"
        same_world = True
        if meta_path.is_file():
            same_world = json.loads(meta_path.read_text()).get("world_size") == world_size
        join = strategy.capability(CheckpointJoin)
        if join is not None:
            join.begin_load(Path(path), verify)
        meta, rank_state, shared = load_state(Path(path), strategy.state, rank, restore_rank=same_world,
                                              verify=verify, group=checkpoint_group(strategy, self.train_group))
        return meta, rank_state, shared, same_world
