"""How plait groups gradients into communication buckets: the one grouping rule that the data-parallel
reducer, the ZeRO optimizer (``plait.parallel``) and the cost model (``plait.plan``) all use, written over
sizes so the cost model can apply it to a model it never builds."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

# plait's reducer caps its first bucket at 1 MiB: its gradients are ready earliest, and a small first bucket
# starts communication early in backward even when the whole model would fit in one bucket.
FIRST_BUCKET_BYTES = 2**20
# ZeRO-2 frees a full gradient buffer once its reduce-scatter is done; more than this many launched buckets
# holding one make the next launch wait (plait.parallel.zero.optimizer).
MAX_FULL_IN_FLIGHT = 1


def reducer_groups(sizes: Sequence[tuple[int, Hashable]], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``sizes`` ((bytes, dtype) per parameter, in gradient-ready order) in each data-parallel
    bucket: consecutive same-dtype parameters up to ``bucket_bytes``, the first bucket capped at
    ``FIRST_BUCKET_BYTES``."""
    groups: list[list[int]] = []
    size, dtype = 0, None
    for i, (nbytes, kind) in enumerate(sizes):
        cap = min(bucket_bytes, FIRST_BUCKET_BYTES) if len(groups) == 1 else bucket_bytes
        if groups and dtype == kind and size + nbytes <= cap:
            groups[-1].append(i)
            size += nbytes
        else:
            groups.append([i])
            size, dtype = nbytes, kind
    return groups


def zero_groups(numels: Sequence[int], owners: Sequence[int], limit: int) -> list[tuple[int, list[int]]]:
    """ZeRO-1/2 buckets in launch order as (param group index, indices): parameters are taken in reverse
    (backward produces gradients roughly in that order), each param group filling its own open bucket until it
    holds at least ``limit`` elements; the groups' last open buckets follow, by group index."""
    buckets: list[tuple[int, list[int]]] = []
    open_: dict[int, list[int]] = {}
    for i in reversed(range(len(numels))):
        g = owners[i]
        open_.setdefault(g, []).append(i)
        if sum(numels[j] for j in open_[g]) >= limit:
            buckets.append((g, open_.pop(g)))
    buckets += [(g, open_[g]) for g in sorted(open_)]
    return buckets


def padded(numel: int, world: int) -> int:
    """A ZeRO bucket's element count padded so ``world`` chunks are equal."""
    return math.ceil(numel / world) * world
