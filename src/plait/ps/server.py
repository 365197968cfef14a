"""A server rank: one receiving thread per worker, one lock around the shard, waits on a condition.

Each worker's thread blocks in ``recv`` from that worker, handles the request under the shard's lock
and answers on the same pair, so a worker's messages are handled in the order it sent them and a
reply goes only to a worker that is waiting for it. A pull that may not be answered yet (``sync``,
``backup``, ``ssp``: until the version the worker may read is applied; in ``ssp``, for a worker at clock
``c``, version ``c - s``: the mean of every worker's gradient of clock ``c - s - 1``) waits on the
condition, which every push and every finished worker notifies; only that worker's thread waits, the
others go on. With several servers, applying a version meets the other servers (one all-reduce of the
clipping norm); the thread releases the lock meanwhile, so this server's other workers' messages go on
(pushes of that version are dropped, pulls that wait for it wait; see ``ShardState.applying``): a version
another server applies may need one of them. ``serve`` returns once every worker has sent
``DONE``; a worker whose connection breaks first ends the server with a ``PsError`` naming it.

Checkpoints: each worker sends ``SAVE`` (or ``LOAD``) with the checkpoint's path after its last push, so
its thread has applied every gradient of that worker before it; the thread then waits. Once every
active worker's request is in, the main thread (in ``serve``) takes part in the DCP save or load with
the workers (``checkpoint(op, args)``, see ``plait.ps.checkpoint``) while no thread touches the shard;
then the threads go on (after a load each answers its worker with the version and that worker's clock).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from plait.ps.protocol import FLAG_NONFINITE, FLAG_PULL, Channel, Header, Op, PsError, decode_json, encode_json
from plait.ps.state import ShardState


class Server:
    """Serve shard ``index`` (global rank ``rank``) to ``num_workers`` workers (global ranks 0..N-1);
    ``checkpoint(op, args)`` runs this server's part of a checkpoint save or load (collective)."""

    def __init__(self, state: ShardState, index: int, rank: int, num_workers: int, group: dist.ProcessGroup,
                 num_groups: int, checkpoint: Callable[[Op, dict[str, Any]], None] | None = None) -> None:
        self.state, self.index, self.rank, self.num_groups = state, index, rank, num_groups
        self.checkpoint = checkpoint
        self.requests: dict[int, tuple[Op, dict[str, Any]]] = {}  # worker -> its checkpoint request
        self.checkpoints = 0  # checkpoint operations completed
        self.channels = [Channel(group, rank, k, "worker", slot=state.w.numel()) for k in range(num_workers)]
        self.cond = threading.Condition()
        norm_sum = state.norm_sum

        def unlocked_norm_sum(x: float) -> float:
            # the servers meet (one all-reduce per version) without this server's lock, so the other workers'
            # messages go on meanwhile (``ShardState.applying`` says what they may do); every caller holds the
            # lock once (a ``with self.cond`` block)
            self.cond.release()
            try:
                return norm_sum(x)
            finally:
                self.cond.acquire()

        state.norm_sum = unlocked_norm_sum
        self.errors: list[BaseException] = []
        self.finished = 0
        self.initialized = threading.Event()
        self.t_start = time.perf_counter()
        self.wall_s = 0.0

    def serve(self) -> dict[str, Any]:
        """Answer the workers until every one has sent DONE; returns the statistics."""
        threads = [threading.Thread(target=self._loop, args=(k,), name=f"plait-ps-worker{k}", daemon=True)
                   for k in range(len(self.channels))]
        self.t_start = time.perf_counter()
        for t in threads:
            t.start()
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.errors or self.finished == len(self.channels) or self._requested())
                if self.errors:
                    raise self.errors[0]
                if not self.requests:
                    break
                op, args = self.requests[min(self.requests)]
            try:
                self.checkpoint(op, args)  # every worker thread waits: nothing touches the shard
            except BaseException as e:
                with self.cond:
                    self.errors.append(e)
                    self.cond.notify_all()
                raise
            with self.cond:
                self.requests.clear()
                self.checkpoints += 1
                self.cond.notify_all()
        for t in threads:
            t.join()
        self.wall_s = time.perf_counter() - self.t_start
        return self.stats()

    def _requested(self) -> bool:
        """Every worker still training has asked for the checkpoint operation (under the lock)."""
        return (bool(self.requests) and len(self.requests) == len(self.channels) - self.finished
                and not self.state.applying)

    def _loop(self, worker: int) -> None:
        ch = self.channels[worker]
        try:
            while True:
                h, payload = ch.recv_framed(self.num_groups)
                if h.op == Op.DONE:
                    with self.cond:
                        self.state.finish(worker)
                        self.finished += 1
                        self.cond.notify_all()
                    return
                self._handle(worker, ch, h, payload)
        except BaseException as e:  # noqa: BLE001 - every failure ends the server, named
            err = e if isinstance(e, PsError) else PsError(f"parameter server rank {self.rank}: handling worker rank "
                                                           f"{worker} failed: {type(e).__name__}: {e}")
            with self.cond:
                self.errors.append(err)
                self.cond.notify_all()

    def _handle(self, worker: int, ch: Channel, h: Header, payload: torch.Tensor) -> None:
        s = self.state
        if h.op != Op.PARK:
            with self.cond:
                s.parked.discard(worker)
        if h.op == Op.INIT:
            with self.cond:
                s.w.copy_(payload)
                self.initialized.set()
                self.cond.notify_all()
        elif h.op == Op.PUSH:
            # Modes that keep a gradient for later (sync, backup, ssp) copy it out of the receive frame; the
            # others apply it from the frame at once (under the lock, before this thread receives again).
            keep = s.cfg.mode in ("sync", "backup", "ssp")
            grad = None if h.flags & FLAG_NONFINITE else (payload.clone() if keep else payload)
            with self.cond:
                s.push(worker, h.version, grad, h.norm_sq, h.lrs)
                self.cond.notify_all()
            if h.flags & FLAG_PULL:
                self._answer_pull(worker, ch)
        elif h.op == Op.PULL:
            self._answer_pull(worker, ch)
        elif h.op in (Op.SAVE, Op.LOAD):
            args = decode_json(ch.recv_payload(ch.recv_header(), dtype=torch.uint8))
            with self.cond:
                done = self.checkpoints
                self.requests[worker] = (h.op, args)
                self.cond.notify_all()
                self.cond.wait_for(lambda: self.errors or self.checkpoints > done)
                if self.errors:
                    return
                if h.op == Op.LOAD:
                    self.initialized.set()
            if h.op == Op.LOAD:
                ch.send(Header(Op.REPLY, worker, self.index, s.version, clock=s.clocks[worker]))
        elif h.op == Op.PARK:
            with self.cond:
                s.park(worker)
                self.cond.notify_all()
        elif h.op == Op.STATS:
            with self.cond:
                stats = self.stats()
            ch.send(Header(Op.REPLY, worker, self.index, s.version), encode_json(stats))
        else:
            raise PsError(f"parameter server rank {self.rank}: unexpected {h.op.name} from worker rank {worker}")

    def _answer_pull(self, worker: int, ch: Channel) -> None:
        """Wait until the mode lets ``worker`` read, then send it the shard (one framed message)."""
        s = self.state
        t0 = time.perf_counter()
        with self.cond:
            self.cond.wait_for(lambda: self.errors or (self.initialized.is_set() and s.may_pull(worker)))
            if self.errors:
                return
            s.pull_wait_s += time.perf_counter() - t0
            s.pulled(worker)
            reply = Header(Op.REPLY, worker, self.index, s.version,
                           clock=min([s.clocks[k] for k in s.active()] or [s.clocks[worker]]),
                           norm_sq=s.applied_norm_sq)
            ch.out_slot()[:s.w.numel()].copy_(s.w)  # the shard as of this version, straight into the frame
        ch.send_framed(reply, filled=s.w.numel())

    def stats(self) -> dict[str, Any]:
        """The shard's statistics with this server's traffic and utilisation (busy time / time served)."""
        wall = self.wall_s or (time.perf_counter() - self.t_start)
        out = self.state.stats()
        out.update({"server": self.index, "rank": self.rank, "wall_s": round(wall, 6),
                    "utilisation": round(self.state.busy_s / wall, 6) if wall > 0 else 0.0,
                    "bytes_received": sum(c.bytes_received for c in self.channels),
                    "bytes_sent": sum(c.bytes_sent for c in self.channels),
                    "numel": self.state.w.numel()})
        return out
