"""Counting the collectives that torch issues on plait's behalf.

plait's own reducers issue their collectives through ``plait.comm.collectives.Comm``, which counts
them. Tensor parallelism (DTensor), ZeRO-3 (FSDP2) and pipeline parallelism
(``torch.distributed.pipelining``) issue theirs inside torch. ``TorchCollectiveCounter`` sees those
too: it is a ``TorchDispatchMode`` the trainer enters around a training step, and every c10d
collective and functional collective passes through the dispatcher on the thread that issues it
(forward, and backward, whose thread inherits the mode). For each one it adds to ``CommStats`` the
bytes this rank puts on the wire, with the same ring model as ``Comm`` (all-reduce ``2(n-1)/n`` of
the buffer, reduce-scatter and all-to-all ``(n-1)/n`` of the input, all-gather ``(n-1)`` times the
input, send and broadcast the tensor once), and one call. Collectives that ``Comm`` issues are
skipped (``plait_issuing``), so nothing is counted twice.

It counts bytes and calls, not time: FSDP2 and the pipeline schedules wait for their collectives on
c10d ``Work`` objects, which do not pass through the dispatcher. Their exposed time is part of the
step's forward and backward time.

Cost: every operator of the step passes through one Python call while the mode is on, so the
trainer enters it only for the layouts whose collectives torch issues.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from plait.plan.wire import wire_bytes  # noqa: F401  (re-exported: comm counts by the plan's rule)

_local = threading.local()


@contextlib.contextmanager
def plait_issuing() -> Iterator[None]:
    """Marks collectives issued inside as already counted by ``Comm``."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def _tensor_bytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(t) for t in x)
    return 0


# op name -> (kind, index of the argument holding the input tensors, index of the group argument)
_C10D = {
    "allreduce_": ("allreduce", 0, 1), "allreduce_coalesced_": ("allreduce", 0, 1),
    "_allgather_base_": ("allgather", 1, 2), "allgather_": ("allgather", 1, 2),
    "allgather_coalesced_": ("allgather", 1, 2), "allgather_into_tensor_coalesced_": ("allgather", 1, 2),
    "_reduce_scatter_base_": ("reduce_scatter", 1, 2), "reduce_scatter_": ("reduce_scatter", 1, 2),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, 2),
    "alltoall_": ("alltoall", 1, 2), "alltoall_base_": ("alltoall", 1, 2),
    "broadcast_": ("once", 0, 1), "send": ("once", 0, 1), "reduce_": ("once", 0, 1),
    "gather_": ("once", 1, 2), "scatter_": ("scatter", 1, 2),
    "recv_": ("recv", 0, 1), "recv_any_source_": ("recv", 0, 1),
}
_FUNCTIONAL = {
    "all_reduce": ("allreduce", 0, 2), "all_reduce_": ("allreduce", 0, 2),
    "all_reduce_coalesced": ("allreduce", 0, 2), "all_reduce_coalesced_": ("allreduce", 0, 2),
    "all_gather_into_tensor": ("allgather", 0, 2), "all_gather_into_tensor_out": ("allgather", 0, 2),
    "all_gather_into_tensor_coalesced": ("allgather", 0, 2),
    "reduce_scatter_tensor": ("reduce_scatter", 0, 3), "reduce_scatter_tensor_out": ("reduce_scatter", 0, 3),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0, 3),
    "all_to_all_single": ("alltoall", 0, 3), "broadcast": ("once", 0, 2), "broadcast_": ("once", 0, 2),
    "isend": ("once", 0, 3), "irecv": ("recv", 0, 3),
}


class TorchCollectiveCounter(TorchDispatchMode):
    """Adds the wire bytes and count of every collective torch issues inside it to ``stats``
    (a ``CommStats``). Forward: counts and runs the operator unchanged; no effect on autograd."""

    def __init__(self, stats: Any) -> None:
        super().__init__()
        self.stats = stats
        self._sizes: dict[str, int] = {}  # group name -> ranks

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let ``torch.compile`` trace while counting (``train.compile``): otherwise dynamo skips every frame
        that starts under this mode and never compiles that code afterwards. The cost: a collective inside a
        compiled region (tensor parallelism's, traced into the graph) is not counted; the reducers', DDP's,
        FSDP's and the pipeline's collectives run outside the compiled blocks and are."""
        return True

    def _group_size(self, group: Any) -> int:
        if isinstance(group, torch.ScriptObject):  # how c10d operators receive their group
            group = dist.ProcessGroup.unbox(group)
        name = group if isinstance(group, str) else group.group_name
        if name not in self._sizes:
            pg = dist.distributed_c10d._resolve_process_group(name) if isinstance(group, str) else group
            self._sizes[name] = pg.size()
        return self._sizes[name]

    def _count(self, func: Any, args: tuple) -> None:
        ns = func.namespace
        name = func._overloadpacket.__name__
        if ns == "c10d":
            spec = _C10D.get(name)
        elif ns == "_c10d_functional":
            if name == "batch_p2p_ops":  # (op_list, peer_list, tag_list, tensors, group_name)
                sent = sum(_tensor_bytes(t) for op, t in zip(args[0], args[3], strict=True) if "send" in op)
                self.stats.bytes_sent += sent
                self.stats.calls += 1
                return
            spec = _FUNCTIONAL.get(name)
        else:
            return
        if spec is None:
            return
        kind, arg, group = spec
        self.stats.bytes_sent += wire_bytes(kind, _tensor_bytes(args[arg]), self._group_size(args[group]))
        self.stats.calls += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(issubclass(t, torch.distributed.tensor.DTensor) for t in types):
            return NotImplemented  # let DTensor turn the operator into local ops and collectives first
        if getattr(_local, "depth", 0) == 0 and func.namespace in ("c10d", "_c10d_functional"):
            self._count(func, args)
        return func(*args, **(kwargs or {}))
