"""Hang detection for collectives: a peer that never arrives becomes a named error, not a hang.

Before issuing collective number ``seq`` on a group, each rank records ``seq`` as its arrival; the
record lands under ``<prefix>/<group name>/<rank>`` in the rendezvous store (the key is overwritten,
so the store holds one key per rank and group however long the run). A store round trip costs more
than a small collective, so by default (``async_marks``) the caller only keeps the number in memory,
and a daemon thread, which looks every ``min(50 ms, timeout/20)``, writes the latest numbers once a
wait has lasted ``min(0.25 s, timeout/4)``: collectives that complete quickly cost no store traffic
at all, and every rank that has been waiting a while has its arrival in the store long before anyone
reads it at the timeout (a rank that never arrives never waits for it, so its record stays behind).
The collective is issued asynchronously and waited for with the timeout. If it does not complete in
time, the waiting rank reads every group member's last recorded ``seq`` from the store: those
below its own never reached this collective. It raises ``CollectiveTimeout`` naming the
collective, the group's ranks, the training step and the ranks that did not arrive.

After a timeout the process group has an unfinished operation and cannot be used again: the
caller must let the error end the process (non-zero exit), as the trainer does.

What covers what: this guard covers the collectives plait issues through ``Comm`` (data-parallel
reducer, ZeRO-1/2, loss and evaluation reductions) and names the exact collective. Collectives
PyTorch issues on plait's behalf (DTensor for tensor parallel, pipeline P2P, FSDP2, DCP checkpoint
save/load, direct ``dist.*`` calls in the model-parallel layouts) are covered by
``plait.comm.watchdog.StepWatchdog``, which names the step, the phase and the late ranks.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

Handle = Any  # dist.Work, torch.futures.Future or concurrent.futures.Future


@dataclass
class Started:
    """A guarded collective that has been issued and not yet waited for (see ``CollectiveGuard.start``)."""

    name: str
    tag: str
    members: list[int]
    step: int
    seq: int
    handle: Handle


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the timeout; the message names who did not arrive
    (``ranks``: those ranks, when they are known)."""

    def __init__(self, message: str, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.ranks = list(ranks or [])


class CollectiveGuard:
    """Issue collectives with a timeout and name the ranks that did not arrive.

    ``store`` is a c10d store every rank reaches (the default group's store from
    ``torch.distributed.distributed_c10d._get_default_store()``, or any TCPStore/FileStore),
    ``timeout_s`` the seconds a collective may wait for its peers, ``rank`` this process's global
    rank. Every rank of a group must issue the same guarded collectives on it in the same order
    (as c10d requires anyway), so the per-group sequence numbers agree. ``async_marks=False``
    writes each arrival synchronously instead of from the background thread. Call ``close()``
    when done (the thread is a daemon, so a process that exits without it does not hang).
    """

    def __init__(self, store: dist.Store, timeout_s: float, rank: int, prefix: str = "plait/arrive",
                 async_marks: bool = True):
        if timeout_s <= 0:
            raise ValueError(f"collective timeout must be positive seconds; got {timeout_s}")
        self.store = store
        self.timeout_s = float(timeout_s)
        self.rank = rank
        self.prefix = prefix
        self.async_marks = async_marks
        self._seq: dict[str, int] = {}
        self._members: dict[str, list[int]] = {}
        self._unsent: dict[str, int] = {}  # latest seq per group not yet written by the thread
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._poll_s = min(0.05, self.timeout_s / 20)
        self._flush_after_s = min(0.25, self.timeout_s / 4)
        self._wait_started: float | None = None  # monotonic start of the wait in progress
        self._closed = False
        self._thread: threading.Thread | None = None

    def close(self) -> None:
        """Write any pending arrival marks and stop the background thread."""
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._flush()

    def _mark(self, tag: str, seq: int) -> None:
        if not self.async_marks:
            self.store.set(f"{self.prefix}/{tag}/{self.rank}", str(seq))
            return
        with self._lock:
            self._unsent[tag] = seq
        if self._thread is None:
            self._thread = threading.Thread(target=self._push_marks, name="plait-guard", daemon=True)
            self._thread.start()

    def _push_marks(self) -> None:
        while not self._closed:
            self._wake.wait(self._poll_s)
            started = self._wait_started
            if started is not None and time.monotonic() - started >= self._flush_after_s:
                self._flush()

    def _flush(self) -> None:
        with self._lock:
            marks, self._unsent = self._unsent, {}
        for tag, seq in marks.items():
            self.store.set(f"{self.prefix}/{tag}/{self.rank}", str(seq))

    def run(self, name: str, group: dist.ProcessGroup | None, step: int,
            fn: Callable[[], Handle]) -> Handle:
        """Mark arrival, call ``fn()`` (which issues the collective with ``async_op=True`` and returns
        its Work or Future), wait up to ``timeout_s``, and return the handle once complete.

        Raises ``CollectiveTimeout`` if the collective does not complete in time or fails while
        waiting (a peer that crashed closes its connections).
        """
        return self.wait(self.start(name, group, step, fn))

    def start(self, name: str, group: dist.ProcessGroup | None, step: int,
              fn: Callable[[], Handle]) -> Started:
        """The first half of ``run``: mark arrival and issue the collective, without waiting.

        Lets a caller overlap the collective with computation (gradient buckets during backward);
        pass the result to ``wait``. Guarded collectives on one group must be started in the same
        order on every rank; they may be waited for in any order.
        """
        tag, members = self._group(group)
        seq = self._seq.get(tag, 0) + 1
        self._seq[tag] = seq
        self._mark(tag, seq)
        return Started(name, tag, members, step, seq, fn())

    def wait(self, started: Started) -> Handle:
        """The second half of ``run``: wait up to ``timeout_s`` (from now) for ``started``."""
        s = started
        begin = time.monotonic()
        outer = self._wait_started is None
        if outer:
            self._wait_started = begin
        try:
            done = self._wait(s.handle)
        except RuntimeError as e:  # gloo reports its own timeout, or a lost peer, as RuntimeError
            raise self._error(s.name, s.tag, s.members, s.step, s.seq, time.monotonic() - begin, e) from e
        finally:
            if outer:
                self._wait_started = None
        if not done:
            raise self._error(s.name, s.tag, s.members, s.step, s.seq, time.monotonic() - begin, None)
        return s.handle

    def _group(self, group: dist.ProcessGroup | None) -> tuple[str, list[int]]:
        pg = group if group is not None else dist.group.WORLD
        tag = pg.group_name
        if tag not in self._members:
            self._members[tag] = dist.get_process_group_ranks(pg)
        return tag, self._members[tag]

    def _wait(self, handle: Handle) -> bool:
        """True when ``handle`` completed within the timeout."""
        if isinstance(handle, dist.Work):
            return bool(handle.wait(timeout=timedelta(seconds=self.timeout_s)))
        if isinstance(handle, torch.futures.Future):
            deadline = time.monotonic() + self.timeout_s
            pause = 1e-4
            while not handle.done():
                if time.monotonic() > deadline:
                    return False
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
            handle.wait()  # re-raises the collective's own error, if any
            return True
        if isinstance(handle, concurrent.futures.Future):
            # Blocking algorithms run on a comm thread; its future wakes the waiter without polling.
            try:
                handle.result(timeout=self.timeout_s)  # re-raises the collective's own error, if any
            except concurrent.futures.TimeoutError:
                return False
            return True
        raise TypeError(
            f"a guarded collective must return its Work or Future (issue it with async_op=True); "
            f"got {type(handle).__name__}"
        )

    def missing_ranks(self, group: dist.ProcessGroup | None, seq: int | None = None) -> list[int]:
        """Global ranks of ``group`` whose last recorded collective on it is before ``seq``
        (default: this rank's latest)."""
        tag, members = self._group(group)
        return self._missing(tag, members, self._seq.get(tag, 0) if seq is None else seq)

    def _missing(self, tag: str, members: list[int], seq: int) -> list[int]:
        missing = []
        for r in members:
            key = f"{self.prefix}/{tag}/{r}"
            if not self.store.check([key]) or int(self.store.get(key)) < seq:
                missing.append(r)
        return missing

    def _error(self, name: str, tag: str, members: list[int], step: int, seq: int, waited: float,
               cause: Exception | None) -> CollectiveTimeout:
        missing: list[int] = []
        try:
            self._flush()  # this rank's own arrival, in case the thread has not written it yet
            missing = self._missing(tag, members, seq)
            who = (f"ranks {missing} did not arrive (they never issued it)" if missing else
                   "every rank issued it, so a peer died or the network stalled during the transfer")
        except Exception as e:  # the store itself may be gone with the rank that hosted it
            who = f"the rendezvous store could not be read to find the missing ranks ({e})"
        detail = f"; backend said: {str(cause).splitlines()[0]}" if cause is not None else ""
        return CollectiveTimeout(
            f"collective '{name}' (#{seq} on group {tag}, ranks {members}) at step {step} did not "
            f"complete after {waited:.1f}s (timeout {self.timeout_s:g}s) on rank {self.rank}: {who}"
            f"{detail}. Check those ranks' logs for an earlier error or a code path that skips this "
            f"collective; raise comm.timeout_s if they are only slow.", ranks=missing
        )
