"""The bytes one rank puts on the wire for a collective (ring algorithms): the rule plait's comm accounting counts
by and the planner prices with."""

from __future__ import annotations


def wire_bytes(kind: str, nbytes: int, world: int) -> int:
    """Bytes one rank sends for a collective of ``kind`` on an input of ``nbytes`` over ``world`` ranks."""
    if world <= 1 or kind == "recv":
        return 0
    if kind == "allreduce":
        return 2 * (world - 1) * nbytes // world
    if kind in ("reduce_scatter", "alltoall", "scatter"):
        return (world - 1) * nbytes // world
    if kind == "allgather":
        return (world - 1) * nbytes
    return nbytes  # send, broadcast, reduce, gather: the tensor once
