"""The worker side: ``PsClient`` talks to every server (``ParameterServer`` in ``plait.ps.strategy`` is the
engine's view of a PS run).

A worker's step: forward and backward on its own micro-batches (plait's accumulation), then at
``Plait.step``: the gradient's norm over all parameters (for clipping on the servers and for the step
record), one PUSH per server of its slice of the flat gradient (every ``ps.push_every`` steps, the
mean of those steps) which, when a pull is due, the server answers with the shard's parameters (one
framed message each way). Pushes go to every server before any reply is awaited. The worker's own
optimizer object never steps and holds no state: it holds the parameter groups whose learning rate the
LR scheduler sets, sent with every push (checkpoints are written by the servers).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from plait.ps.protocol import FLAG_NONFINITE, FLAG_PULL, Channel, Header, Op, decode_json, encode_json
from plait.ps.shard import FlatLayout


class PsClient:
    """One worker's channels to the servers (global ranks ``server_ranks``), and its clock."""

    def __init__(self, flat: FlatLayout, worker: int, server_ranks: list[int], group: Any,
                 one_version: bool = False) -> None:
        self.flat, self.worker, self.one_version = flat, worker, one_version
        self.channels = [Channel(group, worker, r, "parameter server", slot=hi - lo)
                         for r, (lo, hi) in zip(server_ranks, map(flat.shard_range, range(len(server_ranks))),
                                                strict=True)]
        self.versions = [0] * len(server_ranks)  # the version of each shard the local parameters hold
        self.clock = 0  # pushes made
        self.reads: list[tuple[int, int, list[int]]] = []  # (clock, min clock seen by server 0, versions) per pull
        # the squared gradient norm of the update the parameters last pulled come from (sync: the mean gradient's
        # over every shard, before clipping; inf: that version advanced without a step)
        self.applied_norm_sq = 0.0
        self.pull_wait_s = self.push_s = 0.0
        self.done = False

    @property
    def bytes_sent(self) -> int:
        return sum(c.bytes_sent for c in self.channels)

    @property
    def bytes_received(self) -> int:
        return sum(c.bytes_received for c in self.channels)

    def init_servers(self) -> None:
        """Worker 0: send each server the initial parameters of its shard."""
        flat = self.flat.flatten_params()
        for s, ch in enumerate(self.channels):
            lo, hi = self.flat.shard_range(s)
            ch.send_framed(Header(Op.INIT, self.worker, s), flat[lo:hi])

    def push(self, grad: torch.Tensor | None, norm_sq: float, lrs: list[float], pull: bool = True,
             install: bool = False) -> torch.Tensor | None:
        """Send each server its slice of ``grad`` (None: non-finite, announced without a payload); with
        ``pull`` each server answers with its parameters (as a PULL right after), returned in the flat order,
        or with ``install`` copied from each reply straight into the model's parameters (returns None)."""
        t0 = time.perf_counter()
        self.clock += 1
        flags = (FLAG_NONFINITE if grad is None else 0) | (FLAG_PULL if pull else 0)
        for s, ch in enumerate(self.channels):
            lo, hi = self.flat.shard_range(s)
            h = Header(Op.PUSH, self.worker, s, self.push_version(s), clock=self.clock, norm_sq=norm_sq, lrs=lrs,
                       flags=flags)
            ch.send_framed(h, grad[lo:hi] if grad is not None else None)
        self.push_s += time.perf_counter() - t0
        return self._replies(time.perf_counter(), install) if pull else None

    def push_version(self, server: int) -> int:
        """The version a push to ``server`` says its gradient was computed on: that shard's version read, or
        with ``one_version`` (sync, backup) the oldest shard version the parameters hold, the same to every
        server. A read can mix versions (the replies of the servers come at different times); a gradient of
        such parameters is of the older version, for every shard alike. So every server drops or takes each
        push alike and applies each version exactly once with the others (their one all-reduce per version
        pairs up); judged shard by shard, one server could apply a version that no push still to come lets
        another apply, and wait in that all-reduce for ever."""
        return min(self.versions) if self.one_version else self.versions[server]

    def pull(self) -> torch.Tensor:
        """The parameters of every shard, in the flat order (waits where the consistency mode says)."""
        t0 = time.perf_counter()
        for s, ch in enumerate(self.channels):
            ch.send_framed(Header(Op.PULL, self.worker, s, self.versions[s], clock=self.clock))
        return self._replies(t0)

    def _replies(self, t0: float, install: bool = False) -> torch.Tensor | None:
        out = None if install else torch.empty(self.flat.numel, dtype=self.flat.dtype)
        min_clock = self.clock
        for s, ch in enumerate(self.channels):
            lo, hi = self.flat.shard_range(s)
            h, payload = ch.recv_framed(what="waiting for parameters")
            if out is None:
                self.flat.copy_range_into_params(payload, lo)
            else:
                out[lo:hi] = payload
            self.versions[s] = h.version
            self.applied_norm_sq = h.norm_sq  # the same from every server (summed over them)
            min_clock = min(min_clock, h.clock) if s else h.clock
        self.reads.append((self.clock, min_clock, list(self.versions)))
        self.pull_wait_s += time.perf_counter() - t0
        return out

    def stats(self) -> list[dict[str, Any]]:
        """Every server's statistics (one request each)."""
        out = []
        for s, ch in enumerate(self.channels):
            ch.send_framed(Header(Op.STATS, self.worker, s))
            h = ch.recv_header()
            out.append(decode_json(ch.recv_payload(h, dtype=torch.uint8)))
        return out

    def checkpoint(self, op: Op, args: dict[str, Any]) -> None:
        """Ask every server to join a checkpoint save or load (``Op.SAVE`` / ``Op.LOAD``, ``args`` with the
        path); the caller then runs ``save_state`` / ``load_state`` on the group of every rank."""
        for s, ch in enumerate(self.channels):
            ch.send_framed(Header(op, self.worker, s))
            ch.send(Header(op, self.worker, s), encode_json(args))

    def loaded(self) -> None:
        """After a checkpoint load: each server's answer holds its version and this worker's clock."""
        for s, ch in enumerate(self.channels):
            h = ch.recv_header()
            self.versions[s] = h.version
            self.clock = h.clock

    def park(self) -> None:
        """Tell every server this worker waits for the other workers (a collective among them): a backup
        version completes without it until its next message."""
        for s, ch in enumerate(self.channels):
            ch.send_framed(Header(Op.PARK, self.worker, s))

    def finish(self) -> None:
        """Tell every server this worker is done (once); the servers end when all workers have."""
        if self.done:
            return
        self.done = True
        for s, ch in enumerate(self.channels):
            ch.send_framed(Header(Op.DONE, self.worker, s))


def grad_norm_sq(flat_grad: torch.Tensor) -> float:
    """Squared L2 norm of the flat gradient, in float64 (NaN/inf when it holds any)."""
    return float(flat_grad.double().square().sum())
