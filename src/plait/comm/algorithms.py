"""All-reduce algorithms built on c10d point-to-point, each a drop-in for ``dist.all_reduce``.

Every function here has the contract of ``dist.all_reduce(tensor, op=SUM, group=group)``: every
rank of ``group`` calls it with a tensor of the same shape and dtype, and on return each rank's
``tensor`` holds the elementwise sum over the group (in place). They exist so plait can choose the
algorithm that fits the link instead of the one the backend picked, and so the algorithms are
readable and verified (tests/comm/test_algorithms.py compares each with the backend).

Precision: fp16 and bf16 tensors are carried and summed in fp32 and rounded to their dtype once at
the end, so the result is within 0.5 ulp (of the input dtype) of the fp32 sum; this doubles the
bytes on the wire for those dtypes. fp32/fp64 sum in their own dtype in an order that differs from
the backend's, so float results agree with ``dist.all_reduce`` to rounding (bitwise for
integer-valued inputs). Integer dtypes sum exactly (with the dtype's wrap-around).

Non-contiguous tensors are handled: the algorithm works on a contiguous copy and copies the result
back into ``tensor``. Point-to-point messages carry distinct tags per (phase, step, chunk), so
several may be in flight between the same pair of ranks without ambiguity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

AllReduce = Callable[[torch.Tensor, "dist.ProcessGroup | None"], None]

ALGORITHMS = ("backend", "ring", "halving_doubling", "hierarchical")

# Target bytes per pipelined ring chunk and the most chunks a segment is cut into: small enough
# that reducing one chunk overlaps the transfer of the next, large enough that the per-message
# cost stays small.
_RING_CHUNK_BYTES = 1 << 20
_RING_MAX_CHUNKS = 8


class AllReduceConfigError(ValueError):
    """An all-reduce algorithm was asked for with a name or node layout it cannot use."""


def _global(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """Global rank of ``group_rank`` in ``group`` (c10d point-to-point addresses global ranks)."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def _work_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """Flat contiguous buffer to reduce in: fp32 for half types, else ``tensor``'s own storage."""
    if tensor.dtype in (torch.float16, torch.bfloat16):
        return tensor.reshape(-1).to(torch.float32)
    if tensor.is_contiguous():
        return tensor.view(-1)
    return tensor.reshape(-1).clone()


def _write_back(tensor: torch.Tensor, flat: torch.Tensor) -> None:
    if flat.data_ptr() != tensor.data_ptr() or flat.dtype != tensor.dtype:
        tensor.copy_(flat.view(tensor.shape))


def _split_sizes(total: int, parts: int) -> list[int]:
    """``parts`` sizes summing to ``total``; the first ``total % parts`` get one extra element."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _offsets(sizes: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def backend_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """The backend's own all-reduce (SUM, in place): the reference the other algorithms match.

    Communication (forward): whatever the backend chose (gloo: ring or halving-doubling; NCCL:
    ring or tree). Backward: none (it reduces gradients, outside autograd).
    """
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)


# ----------------------------------------------------------------------------------------- ring


class _RingGeometry:
    """A ring all-reduce's layout: ``n`` segments of the flat buffer, each cut into ``num_chunks``."""

    def __init__(self, numel: int, n: int, elem_bytes: int):
        self.seg_sizes = _split_sizes(numel, n)
        self.seg_offsets = _offsets(self.seg_sizes)
        largest_bytes = max(self.seg_sizes) * elem_bytes
        self.num_chunks = max(1, min(_RING_MAX_CHUNKS, -(-largest_bytes // _RING_CHUNK_BYTES)))

    def chunk(self, seg: int, c: int) -> tuple[int, int]:
        """(offset in the flat buffer, length) of chunk ``c`` of segment ``seg``."""
        sizes = _split_sizes(self.seg_sizes[seg], self.num_chunks)
        return self.seg_offsets[seg] + sum(sizes[:c]), sizes[c]


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Ring all-reduce (SUM, in place): chunked, pipelined reduce-scatter then all-gather.

    Communication (forward): each rank sends ``2 (n-1)/n`` of the tensor to its right neighbour and
    receives as much from its left one, in ``2 (n-1)`` steps. Each segment is cut into up to 8
    chunks, and chunk ``c`` of step ``s+1`` is sent as soon as chunk ``c`` of step ``s`` is reduced,
    so transfers overlap reductions. Backward: none (it reduces gradients, outside autograd).
    """
    n = dist.get_world_size(group)
    if n == 1 or tensor.numel() == 0:
        return
    flat = _work_buffer(tensor)
    _ring(flat, [_global(group, r) for r in range(n)], dist.get_rank(group), tag0=0)
    _write_back(tensor, flat)


def _ring(flat: torch.Tensor, ring: list[int], me: int, tag0: int) -> None:
    """Ring all-reduce of ``flat`` among global ranks ``ring``; this rank is ``ring[me]``."""
    n = len(ring)
    geo = _RingGeometry(flat.numel(), n, flat.element_size())
    right, left = ring[(me + 1) % n], ring[(me - 1) % n]
    _ring_reduce_scatter(flat, geo, me, n, right, left, tag0)
    _ring_all_gather(flat, geo, me, n, right, left, tag0 + n * geo.num_chunks)


def _ring_reduce_scatter(flat: torch.Tensor, geo: _RingGeometry, me: int, n: int, right: int,
                         left: int, tag0: int) -> None:
    """Step ``s`` sends segment ``me - s`` and adds the received ``me - s - 1``; ends owning ``me + 1``."""
    # Two receive buffers alternate by step parity: step s+1's receive of chunk c is posted only
    # after step s consumed chunk c, and all of step s-1 (same buffer) was consumed before that.
    bufs = [torch.empty(max(geo.seg_sizes), dtype=flat.dtype) for _ in range(2)]
    sends: list[dist.Work] = []
    recvs: dict[tuple[int, int], dist.Work] = {}

    def post(step: int, c: int) -> None:
        tag = tag0 + step * geo.num_chunks + c
        off, length = geo.chunk((me - step) % n, c)
        if length:
            sends.append(dist.isend(flat[off:off + length], right, tag=tag))
        seg = (me - step - 1) % n
        r_off, r_len = geo.chunk(seg, c)
        if r_len:
            base = r_off - geo.seg_offsets[seg]
            recvs[(step, c)] = dist.irecv(bufs[step % 2][base:base + r_len], left, tag=tag)

    for c in range(geo.num_chunks):
        post(0, c)
    for step in range(n - 1):
        seg = (me - step - 1) % n
        for c in range(geo.num_chunks):
            if (step, c) in recvs:
                recvs.pop((step, c)).wait()
                off, length = geo.chunk(seg, c)
                base = off - geo.seg_offsets[seg]
                flat[off:off + length] += bufs[step % 2][base:base + length]
            if step + 1 < n - 1:
                post(step + 1, c)  # forward the chunk just reduced while later chunks still arrive
    for w in sends:  # the all-gather overwrites segments these sends read from
        w.wait()


def _ring_all_gather(flat: torch.Tensor, geo: _RingGeometry, me: int, n: int, right: int,
                     left: int, tag0: int) -> None:
    """Step ``s`` sends segment ``me + 1 - s`` and receives ``me - s`` in place."""
    sends: list[dist.Work] = []
    recvs: dict[tuple[int, int], dist.Work] = {}

    def post(step: int, c: int) -> None:
        tag = tag0 + step * geo.num_chunks + c
        off, length = geo.chunk((me + 1 - step) % n, c)
        if length:
            sends.append(dist.isend(flat[off:off + length], right, tag=tag))
        r_off, r_len = geo.chunk((me - step) % n, c)
        if r_len:
            recvs[(step, c)] = dist.irecv(flat[r_off:r_off + r_len], left, tag=tag)

    for c in range(geo.num_chunks):
        post(0, c)
    for step in range(n - 1):
        for c in range(geo.num_chunks):
            if (step, c) in recvs:
                recvs.pop((step, c)).wait()
            if step + 1 < n - 1:
                post(step + 1, c)
    for w in sends:
        w.wait()


# ----------------------------------------------------------------------------- halving-doubling


def halving_doubling_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Recursive halving reduce-scatter + recursive doubling all-gather (SUM, in place).

    With ``p`` the largest power of two <= n, each of the ``n - p`` extra ranks first sends its
    tensor to rank ``r - p``, which adds it; the ``p`` ranks then run ``log2 p`` halving steps
    (exchange half of the current range with the partner at distance ``p/2, p/4, ..., 1`` and add)
    and ``log2 p`` doubling steps (exchange the owned ranges back); finally each extra rank
    receives the result from its partner.
    Communication (forward): ``2 (p-1)/p`` of the tensor per power-of-two rank in ``2 log2 p``
    latency steps, plus one full tensor each way per extra rank. Backward: none.
    """
    n = dist.get_world_size(group)
    if n == 1 or tensor.numel() == 0:
        return
    flat = _work_buffer(tensor)
    me = dist.get_rank(group)
    p = 1 << (n.bit_length() - 1)
    fold_tag, hd_tag = 0, 2
    if me >= p:  # an extra rank: hand its data to its partner, then get the sum back
        dist.send(flat, _global(group, me - p), tag=fold_tag)
        dist.recv(flat, _global(group, me - p), tag=fold_tag + 1)
        _write_back(tensor, flat)
        return
    if me + p < n:
        buf = torch.empty_like(flat)
        dist.recv(buf, _global(group, me + p), tag=fold_tag)
        flat += buf
    _halving_doubling(flat, me, p, group, hd_tag)
    if me + p < n:
        dist.send(flat, _global(group, me + p), tag=fold_tag + 1)
    _write_back(tensor, flat)


def _exchange(send: torch.Tensor, recv: torch.Tensor, peer: int, tag: int) -> None:
    """Send ``send`` to and receive ``recv`` from ``peer`` concurrently (empty parts skipped)."""
    works = []
    if send.numel():
        works.append(dist.isend(send, peer, tag=tag))
    if recv.numel():
        works.append(dist.irecv(recv, peer, tag=tag))
    for w in works:
        w.wait()


def _halving_doubling(flat: torch.Tensor, me: int, p: int, group: dist.ProcessGroup | None,
                      tag: int) -> None:
    """Halving-doubling among group ranks ``0..p-1`` (``p`` a power of two)."""
    lo, hi = 0, flat.numel()
    held: list[tuple[int, int]] = []  # the range held before each halving step, to undo them
    span = p // 2
    while span >= 1:
        peer = _global(group, me ^ span)
        mid = lo + (hi - lo) // 2
        held.append((lo, hi))
        # Both partners hold the same range here, so they agree on ``mid``; the lower rank keeps
        # the lower half.
        keep, give = ((lo, mid), (mid, hi)) if me & span == 0 else ((mid, hi), (lo, mid))
        buf = torch.empty(keep[1] - keep[0], dtype=flat.dtype)
        _exchange(flat[give[0]:give[1]], buf, peer, tag)
        flat[keep[0]:keep[1]] += buf
        lo, hi = keep
        tag += 1
        span //= 2
    span = 1
    while span < p:
        peer = _global(group, me ^ span)
        plo, phi = held.pop()
        other = (hi, phi) if lo == plo else (plo, lo)  # the part of the split range the peer owns
        _exchange(flat[lo:hi], flat[other[0]:other[1]], peer, tag)
        lo, hi = plo, phi
        tag += 1
        span *= 2


# --------------------------------------------------------------------------------- hierarchical


def node_ids_from(num_ranks: int, ranks_per_node: int | None = None,
                  node_ids: Sequence[int] | None = None) -> list[int]:
    """One node id per group rank, from exactly one of ``ranks_per_node`` or ``node_ids``."""
    if (ranks_per_node is None) == (node_ids is None):
        raise AllReduceConfigError("hierarchical all-reduce needs exactly one of ranks_per_node or node_ids")
    if node_ids is not None:
        return list(node_ids)
    if ranks_per_node < 1 or num_ranks % ranks_per_node:
        raise AllReduceConfigError(
            f"ranks_per_node={ranks_per_node} does not divide the group size {num_ranks}; "
            f"pass a divisor of {num_ranks}, or list node_ids per rank for uneven nodes"
        )
    return [r // ranks_per_node for r in range(num_ranks)]


def node_ids_for_ranks(global_ranks: Sequence[int], ranks_per_host: int) -> list[int]:
    """Node id of each member of a group, given its global ranks and the ranks per host.

    Launchers place consecutive global ranks on a host (``LOCAL_WORLD_SIZE`` of them), so the
    node of global rank ``g`` is ``g // ranks_per_host``. Pass the result as ``node_ids`` for a
    group such as ``dist.get_process_group_ranks(dp_group)``.
    """
    if ranks_per_host < 1:
        raise AllReduceConfigError(f"ranks per host must be at least 1; got {ranks_per_host}")
    return [g // ranks_per_host for g in global_ranks]


def hierarchical_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                            ranks_per_node: int | None = None,
                            node_ids: Sequence[int] | None = None) -> None:
    """Reduce within each node, ring all-reduce across node leaders, broadcast within each node (SUM).

    Nodes are declared explicitly: ``ranks_per_node`` (consecutive group ranks share a node) or
    ``node_ids`` (one node id per group rank, any layout); every rank must pass the same layout.
    A node's leader is its lowest group rank. All three phases are point-to-point on ``group``
    itself, so no sub-group is created: group creation is collective over the whole job (or, with
    local synchronization, hangs on gloo when ranks have created different numbers of groups), and
    avoiding it lets any subset of ranks call this at any time.
    Communication (forward): each non-leader sends its tensor to its leader, which adds them
    (fan-in, one full tensor per non-leader); the ``m`` leaders run the pipelined ring
    (``2 (m-1)/m`` of the tensor each); each leader sends the result to its node's ranks (fan-out).
    Backward: none.
    """
    n = dist.get_world_size(group)
    if n == 1 or tensor.numel() == 0:
        return
    ids = node_ids_from(n, ranks_per_node, node_ids)
    me = dist.get_rank(group)
    node = [r for r in range(n) if ids[r] == ids[me]]
    leaders = sorted({min(r for r in range(n) if ids[r] == nid) for nid in ids})
    flat = _work_buffer(tensor)
    up_tag, down_tag, ring_tag = 0, 1, 2
    if me != node[0]:
        dist.send(flat, _global(group, node[0]), tag=up_tag)
        dist.recv(flat, _global(group, node[0]), tag=down_tag)
        _write_back(tensor, flat)
        return
    bufs = [torch.empty_like(flat) for _ in node[1:]]
    works = [dist.irecv(b, _global(group, r), tag=up_tag) for b, r in zip(bufs, node[1:], strict=True)]
    for w, b in zip(works, bufs, strict=True):  # add in rank order so every node sums alike
        w.wait()
        flat += b
    if len(leaders) > 1:
        _ring(flat, [_global(group, r) for r in leaders], leaders.index(me), tag0=ring_tag)
    for w in [dist.isend(flat, _global(group, r), tag=down_tag) for r in node[1:]]:
        w.wait()
    _write_back(tensor, flat)


def get_allreduce(name: str, *, ranks_per_node: int | None = None,
                  node_ids: Sequence[int] | None = None) -> AllReduce:
    """The all-reduce called ``name`` as ``fn(tensor, group)`` (SUM, in place).

    ``name`` is one of ``backend | ring | halving_doubling | hierarchical``; ``hierarchical`` also
    needs the node layout (``ranks_per_node`` or ``node_ids``, see ``hierarchical_all_reduce``).
    """
    if name == "backend":
        return backend_all_reduce
    if name == "ring":
        return ring_all_reduce
    if name == "halving_doubling":
        return halving_doubling_all_reduce
    if name == "hierarchical":
        if (ranks_per_node is None) == (node_ids is None):
            raise AllReduceConfigError(
                "the hierarchical all-reduce needs the node layout: pass ranks_per_node (ranks per "
                "node, e.g. GPUs per host) or node_ids (one node id per group rank)"
            )
        ids = None if node_ids is None else list(node_ids)

        def hierarchical(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
            hierarchical_all_reduce(tensor, group, ranks_per_node=ranks_per_node, node_ids=ids)

        return hierarchical
    raise AllReduceConfigError(
        f"unknown all-reduce algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}"
    )
