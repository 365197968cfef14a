"""The communication layer: every collective plait's reducers issue passes through a ``Comm``.

It counts the bytes each collective puts on the wire and the time spent waiting for it, so a step's
metrics can show communication next to compute. It also

- chooses the all-reduce algorithm (``allreduce``): the backend's asynchronous ``all_reduce``, or
  one of ``plait.comm.algorithms``. Those are blocking point-to-point programs, so they run on one
  background comm thread per ``Comm``; the thread takes work first-in first-out, so every rank
  issues its collectives in the same order, which c10d's matching by issue order requires;
- runs gradient compression (``set_compression``) on the same thread, so a compressed bucket's
  exchange overlaps the rest of backward exactly like an uncompressed one;
- guards every collective with a ``CollectiveGuard`` when one is given: a peer that never arrives
  becomes a ``CollectiveTimeout`` naming the collective, group, step and missing ranks. Collectives
  that do not pass through ``Comm`` (DTensor, pipeline P2P, FSDP2, DCP) are bounded by the
  trainer's ``plait.comm.watchdog.StepWatchdog`` instead, and counted in ``comm_bytes`` by
  ``plait.comm.accounting.TorchCollectiveCounter``.

Handles returned by the ``*_async`` methods must be passed to ``wait``; the time spent there is the
communication that computation did not hide.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from plait.comm.accounting import plait_issuing
from plait.comm.algorithms import ALGORITHMS, AllReduce, AllReduceConfigError, get_allreduce, node_ids_for_ranks
from plait.comm.compress import Compressor
from plait.comm.compressors import build_compressor
from plait.comm.guard import CollectiveGuard, Started
from plait.config import CommConfig


@dataclass
class CommStats:
    """Cumulative counters; the trainer reads and resets them once per step."""

    bytes_sent: int = 0
    wait_s: float = 0.0
    calls: int = 0

    def reset(self) -> None:
        self.bytes_sent, self.wait_s, self.calls = 0, 0.0, 0


def ring_allreduce_bytes(numel_bytes: int, world: int) -> int:
    """Bytes one rank sends in a bandwidth-optimal all-reduce: 2 (n - 1) / n of the buffer."""
    return 0 if world <= 1 else 2 * (world - 1) * numel_bytes // world


def ring_half_bytes(numel_bytes: int, world: int) -> int:
    """Bytes one rank sends in a ring reduce-scatter or all-gather of the whole buffer: (n - 1) / n."""
    return 0 if world <= 1 else (world - 1) * numel_bytes // world


class _CommThread:
    """One daemon thread running blocking collectives in submission order.

    A daemon, so a process whose peer vanished (the thread stuck in a receive) can still exit once
    the waiter has raised its ``CollectiveTimeout``.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="plait-comm", daemon=True)
            self._thread.start()
        self._queue.put((fn, fut))
        return fut

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # handed to the waiter, which raises it
                    fut.set_exception(e)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=1.0)
            self._thread = None


# comm.compress=auto's compressor (plait.comm.auto explains the choice)
AUTO_COMPRESSOR = "powersgd"
# A flat all-gather into one tensor (torch's newer name where it has it)
all_gather_flat = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


@dataclass
class CommWork:
    """A started collective: a c10d ``Work`` or a comm-thread future, and its guard record."""

    handle: Any
    started: Started | None
    bytes_on_wait: bool = False  # the future's result is the bytes it sent (known only when done)


class Comm:
    """Collectives on explicit groups, counted and guarded. One per process, built by the trainer.

    ``allreduce`` is one of ``plait.comm.algorithms.ALGORITHMS``; ``ranks_per_node`` is the node
    size for ``hierarchical`` (None: ``LOCAL_WORLD_SIZE`` from the launcher); ``guard`` enforces a
    timeout on every collective (None: unguarded, for unit tests). ``step`` is set by the trainer
    so a timeout names the step it happened in.
    """

    def __init__(self, allreduce: str = "backend", *, ranks_per_node: int | None = None,
                 guard: CollectiveGuard | None = None) -> None:
        if allreduce not in ALGORITHMS:
            raise AllReduceConfigError(f"unknown all-reduce algorithm {allreduce!r}; choose one of {ALGORITHMS}")
        self.stats = CommStats()
        self.algorithm = allreduce
        self.ranks_per_node = ranks_per_node
        self.guard = guard
        self.step = 0
        self.compression: dict[str, Any] | None = None
        self.compress_active = False
        self.compressors: list[Compressor] = []
        self._algos: dict[str, AllReduce] = {}
        self._thread = _CommThread()

    # -- issuing ---------------------------------------------------------------------------------
    def _issue(self, name: str, group: dist.ProcessGroup | None, fn: Callable[[], Any],
               bytes_on_wait: bool = False) -> CommWork:
        self.stats.calls += 1
        inner = fn

        def fn() -> Any:  # counted here, so a TorchCollectiveCounter around the step skips it
            with plait_issuing():
                return inner()

        if self.guard is None:
            return CommWork(fn(), None, bytes_on_wait)
        started = self.guard.start(name, group, self.step, fn)
        return CommWork(started.handle, started, bytes_on_wait)

    def issue_async(self, name: str, group: dist.ProcessGroup | None, fn: Callable[[], dist.Work],
                    nbytes: int) -> CommWork:
        """Guard and count a c10d collective that ``fn`` issues with ``async_op=True``.

        For collectives other than all-reduce (ZeRO's reduce-scatter and all-gather); ``nbytes``
        is what this rank puts on the wire. Forward/backward: whatever ``fn`` issues; no backward.
        """
        self.stats.bytes_sent += nbytes
        return self._issue(name, group, fn)

    def all_reduce_async(self, tensor: torch.Tensor, group: dist.ProcessGroup | None,
                         name: str = "all_reduce") -> CommWork:
        """Start a SUM all-reduce of ``tensor`` in place over ``group`` with the chosen algorithm.

        Forward: one all-reduce (backend: c10d async; otherwise the algorithm runs on the comm
        thread, so ``tensor`` must not be touched until ``wait``). There is no backward: it is used
        on gradients outside autograd.
        """
        world = dist.get_world_size(group)
        self.stats.bytes_sent += ring_allreduce_bytes(tensor.numel() * tensor.element_size(), world)
        if self.algorithm == "backend":
            return self._issue(name, group, lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM,
                                                                      group=group, async_op=True))
        algo = self._allreduce_fn(group)
        return self._issue(name, group, lambda: self._thread.submit(lambda: algo(tensor, group)))

    def run_async(self, name: str, group: dist.ProcessGroup | None, fn: Callable[[], int]) -> CommWork:
        """Run ``fn`` (blocking collectives on ``group``, e.g. a compressor's exchange) on the comm
        thread, guarded as one collective; ``fn`` returns the bytes it put on the wire, counted at
        ``wait``. Forward: whatever ``fn`` issues, in submission order. No backward."""
        return self._issue(name, group, lambda: self._thread.submit(fn), bytes_on_wait=True)

    def wait(self, work: CommWork) -> None:
        """Wait for ``work``; the time spent here is communication the computation did not hide.

        Raises ``CollectiveTimeout`` (guarded) when a peer does not arrive within the timeout.
        """
        t0 = time.perf_counter()
        try:
            if work.started is not None:
                self.guard.wait(work.started)
            elif isinstance(work.handle, concurrent.futures.Future):
                work.handle.result()
            else:
                work.handle.wait()
        finally:
            self.stats.wait_s += time.perf_counter() - t0
        if work.bytes_on_wait:
            self.stats.bytes_sent += int(work.handle.result())

    # -- blocking helpers ------------------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None,
                  name: str = "broadcast") -> None:
        """Broadcast ``tensor`` in place from global rank ``src`` (c10d). No backward."""
        self.stats.bytes_sent += tensor.numel() * tensor.element_size()
        self.wait(self._issue(name, group, lambda: dist.broadcast(tensor, src=src, group=group, async_op=True)))

    def all_reduce_sum(self, tensor: torch.Tensor, group: dist.ProcessGroup | None,
                       name: str = "all_reduce") -> torch.Tensor:
        """Blocking SUM all-reduce in place (for small metric tensors). No backward."""
        self.wait(self.all_reduce_async(tensor, group, name))
        return tensor

    # -- algorithms and compression --------------------------------------------------------------
    def _allreduce_fn(self, group: dist.ProcessGroup | None) -> AllReduce:
        pg = group if group is not None else dist.group.WORLD
        key = pg.group_name
        if key not in self._algos:
            if self.algorithm == "hierarchical":
                ranks = dist.get_process_group_ranks(pg)
                per_node = self.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", len(ranks)))
                self._algos[key] = get_allreduce("hierarchical", node_ids=node_ids_for_ranks(ranks, per_node))
            else:
                self._algos[key] = get_allreduce(self.algorithm)
        return self._algos[key]

    def set_compression(self, name: str, *, active: bool = True, **options: Any) -> None:
        """Compress gradient reductions with compressor ``name`` (``build_compressor``'s options).

        Reducers built afterwards get their own compressor from ``make_compressor``; they compress
        only while ``compress_active`` is true (``comm.compress=auto`` turns it on after measuring).
        """
        build_compressor(name, **options)  # validate now, with a clear error, before any worker trains
        self.compression = {"name": name, **options}
        self.compress_active = active

    def make_compressor(self) -> Compressor | None:
        """A new compressor for one reducer (None without compression); its state is checkpointed
        through ``state_dict``. fp32 payloads go through this Comm's all-reduce algorithm."""
        if self.compression is None:
            return None
        c = dict(self.compression)
        allreduce = None if self.algorithm == "backend" else (lambda t, g: self._allreduce_fn(g)(t, g))
        comp = build_compressor(c.pop("name"), allreduce=allreduce, **c)
        self.compressors.append(comp)
        return comp

    def state_dict(self) -> dict[str, Any]:
        """Per-rank state (every compressor's residuals, factors and RNGs) for ``rank<r>.pt``."""
        return {"active": self.compress_active, "compressors": [c.state_dict() for c in self.compressors]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        saved = sd.get("compressors", [])
        if len(saved) != len(self.compressors):
            raise ValueError(
                f"the checkpoint holds {len(saved)} compressor states but this run built "
                f"{len(self.compressors)}: resume with the original comm.compress and parallel settings"
            )
        for c, s in zip(self.compressors, saved, strict=True):
            c.load_state_dict(s)
        self.compress_active = bool(sd.get("active", self.compress_active))

    def close(self) -> None:
        """Stop the comm thread and flush the guard's arrival marks."""
        self._thread.close()
        if self.guard is not None:
            self.guard.close()


def comm_from_config(c: CommConfig, seed: int, rank: int, world_size: int) -> Comm:
    """The comm layer from ``comm.*``: algorithm, compression, and (with several ranks) the hang guard
    on the default process group's store, so every rank's arrivals are visible to the others."""
    guard = None
    if world_size > 1 and dist.is_initialized():
        guard = CollectiveGuard(dist.distributed_c10d._get_default_store(), c.timeout_s, rank)
    comm = Comm(c.allreduce, ranks_per_node=c.ranks_per_node or None, guard=guard)
    if c.compress != "none":
        name = AUTO_COMPRESSOR if c.compress == "auto" else c.compress
        comm.set_compression(name, active=c.compress != "auto", ratio=c.compress_ratio,
                             powersgd_rank=c.powersgd_rank, error_feedback=c.error_feedback,
                             stochastic_rounding=c.stochastic_rounding and name in ("int8", "int4"),
                             seed=seed)
    return comm
