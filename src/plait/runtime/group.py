"""Ending a process group without racing the peers: meet on the store, then destroy the group.

A rank that exits while a peer is still inside its last collective closes the connections that peer is
using, and the peer fails (gloo raises ``Connection closed by peer``, or aborts the process when the
error reaches one of its own threads); a rank that leaves a live group to the interpreter's shutdown
has its gloo threads and sockets torn down in whatever order finalisation picks. So a rank that ends
cleanly first counts itself done on the group's store (not with a collective, which could race the
same way), waits until every rank has, and only then destroys its group and exits. Rank 0 goes last:
it may host the store (``env://`` rendezvous without an agent), so it waits until every other rank
has read the store's answer. A rank that fails does not wait: it should end at once, so its peers see
it gone rather than a hang.
"""

from __future__ import annotations

import itertools
from datetime import timedelta

import torch.distributed as dist

_leaves = itertools.count()  # one meeting per leave_process_group call; every rank makes the same calls


def _arrive(store: dist.Store, world: int, key: str) -> None:
    if store.add(f"{key}/arrived", 1) >= world:
        store.set(f"{key}/all", "1")


def _wait(store: dist.Store, key: str, timeout_s: float | None) -> None:
    if timeout_s is None:
        store.wait([f"{key}/all"])
    else:
        store.wait([f"{key}/all"], timedelta(seconds=timeout_s))


def meet(store: dist.Store, world: int, key: str, timeout_s: float | None = None) -> None:
    """Count this rank as arrived at ``key`` and wait until all ``world`` ranks have (at most ``timeout_s``,
    else the store's own timeout; the store raises when it runs out)."""
    _arrive(store, world, key)
    _wait(store, key, timeout_s)


def leave_process_group(timeout_s: float | None = None) -> None:
    """Meet every rank of the default process group on its store, then destroy the group (nothing when no
    group is initialised). Call it on a clean end, from every rank. Raises the store's error when the
    others did not arrive within ``timeout_s`` (default: the store's timeout); the group is then left as
    it was."""
    if not dist.is_initialized():
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    if world > 1:
        store = dist.distributed_c10d._get_default_store()
        key = f"plait/leave/{next(_leaves)}"
        meet(store, world, f"{key}/in", timeout_s)
        _arrive(store, world, f"{key}/out")
        if rank == 0:
            _wait(store, f"{key}/out", timeout_s)
    dist.destroy_process_group()
