"""The communication layer: every collective plait issues passes through a ``Comm``.

It counts the bytes each collective puts on the wire and the time spent waiting for it, so a step's
metrics can show communication next to compute.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


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


class Comm:
    """Collectives on explicit groups, counted. One per process, built by the trainer and passed down."""

    def __init__(self) -> None:
        self.stats = CommStats()

    def all_reduce_async(self, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> dist.Work:
        """Start a SUM all-reduce of ``tensor`` in place over ``group``; returns the work handle.

        Forward: one all-reduce. There is no backward: it is used on gradients outside autograd.
        """
        world = dist.get_world_size(group)
        self.stats.bytes_sent += ring_allreduce_bytes(tensor.numel() * tensor.element_size(), world)
        self.stats.calls += 1
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)

    def wait(self, work: dist.Work) -> None:
        """Wait for ``work``; the time spent here is communication the computation did not hide."""
        t0 = time.perf_counter()
        work.wait()
        self.stats.wait_s += time.perf_counter() - t0

    def broadcast(self, tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None) -> None:
        """Broadcast ``tensor`` in place from global rank ``src``. No backward."""
        self.stats.bytes_sent += tensor.numel() * tensor.element_size()
        self.stats.calls += 1
        dist.broadcast(tensor, src=src, group=group)

    def all_reduce_sum(self, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        """Blocking SUM all-reduce in place (for small metric tensors). No backward."""
        self.wait(self.all_reduce_async(tensor, group))
        return tensor


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (for a local rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
