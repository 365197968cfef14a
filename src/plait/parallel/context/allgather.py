"""All-gather attention over the context-parallel group: the reference form (Megatron's simplest).

Every rank gathers the whole sequence's keys and values (its queries stay its own shard). Each of its two chunks
(global chunk ``j``) attends to the keys of chunks ``0..j-1`` without a mask and to its own chunk's causally, the
two merged by their log-sum-exps (the ring's block kernels): no (S, T) mask is built or saved. Backward gathers
the keys and values again instead of keeping the whole sequence's from forward, so activation memory per rank is
the shard's, as the ring's (at 4096 tokens, cp=2: 1.10x of 1/cp of one process's when they were kept). With packed
documents each piece's document mask is built from the whole sequence's document ids, in forward and again in
backward (never saved). Memory for keys and values is the whole sequence's, which is what ring attention avoids;
compute per rank is its shard's.

Communication per attention layer and micro-batch: forward one all-gather of keys and values stacked
(``2 B H_kv T D`` elements received: grouped-query keys and values move with their own heads); backward the
same all-gather again and their gradients reduced back to the ranks that own them (a reduce-scatter under NCCL;
gloo has none, so an all-reduce of the whole gradient and this rank's slice): the volume of the ring's
backward, which also moves keys and values and their gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from plait.parallel.context.ring import block_backward, block_forward, doc_mask, merge


def _global_order(cp: int, c: int) -> torch.Tensor:
    """Where each position of the rank-ordered gathered sequence goes: rank j's two chunks are ``j`` and
    ``2 cp - 1 - j``. Returns the permutation ``perm`` with ``whole = gathered[..., perm, :]``."""
    chunk_of = [0] * (2 * cp)  # chunk -> its slot in the gathered order
    for j in range(cp):
        chunk_of[j], chunk_of[2 * cp - 1 - j] = 2 * j, 2 * j + 1
    return torch.cat([torch.arange(chunk_of[i] * c, (chunk_of[i] + 1) * c) for i in range(2 * cp)])


def _gather(x: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., S, D) shards of every rank -> (..., T, D) in global order, and the permutation used."""
    cp = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x.contiguous(), group=group)
    perm = _global_order(cp, x.size(-2) // 2).to(x.device)
    return torch.cat(parts, dim=-2).index_select(-2, perm), perm


def _reduce_to_owners(grad: torch.Tensor, perm: torch.Tensor, group: Any) -> torch.Tensor:
    """The adjoint of ``_gather``: (..., T, D) gradients of every rank summed, this rank's (..., S, D) shard of
    them (reduce-scatter under NCCL; gloo has none: an all-reduce of the whole and this rank's slice)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    ranked = torch.empty_like(grad).index_copy_(-2, perm, grad).contiguous()  # back to rank order
    s = grad.size(-2) // cp
    if dist.get_backend(group) == dist.Backend.NCCL:
        chunks = list(ranked.split(s, dim=-2))
        mine = torch.empty_like(chunks[rank]).contiguous()
        dist.reduce_scatter(mine, [t.contiguous() for t in chunks], group=group)
        return mine
    dist.all_reduce(ranked, group=group)
    return ranked[..., rank * s:(rank + 1) * s, :].contiguous()


def _pieces(chunks: list[tuple[int, int]], c: int, docs: torch.Tensor | None) -> list[tuple[slice, slice, bool, Any]]:
    """What the queries compute against the whole sequence's keys: for each query chunk (``(a, j)``: local slice
    ``a``, global chunk ``j``, ``c`` tokens each) the keys of every earlier chunk, unmasked, and its own chunk's,
    causal; with the document mask of each piece when ``docs`` (the whole sequence's document ids, (B, T)) is
    given."""
    out = []
    for a, j in chunks:
        qs = slice(a * c, (a + 1) * c)
        q_docs = None if docs is None else docs[:, j * c:(j + 1) * c]
        for ks, causal in ((slice(0, j * c), False), (slice(j * c, (j + 1) * c), True)):
            if ks.stop == 0:
                continue
            out.append((qs, ks, causal, None if docs is None else doc_mask(q_docs, docs[:, ks])))
    return out


def _mine(rank: int, cp: int) -> list[tuple[int, int]]:
    """This rank's two chunks of the load-balanced split, as ``_pieces`` takes them."""
    return [(0, rank), (1, 2 * cp - 1 - rank)]


def pieces_forward(qf: torch.Tensor, kv: torch.Tensor, pieces: list, scale: float) -> tuple[torch.Tensor, ...]:
    """Attention output (float32) and log-sum-exp of ``qf`` (B, H, Sq, D) against keys and values ``kv``
    (2, B, H_kv, T, D), piece by piece (``_pieces``), the pieces of a query chunk merged by their log-sum-exps."""
    out = torch.empty_like(qf)
    lse = torch.empty(qf.shape[:-1], dtype=torch.float32, device=qf.device)
    started: set[int] = set()
    for qs, ks, causal, mask in pieces:
        bo, bl = block_forward(qf[:, :, qs], kv[0, :, :, ks], kv[1, :, :, ks], scale, causal, mask)
        if qs.start in started:
            merge(out[:, :, qs], lse[:, :, qs], bo, bl)
        else:
            out[:, :, qs], lse[:, :, qs] = bo, bl
            started.add(qs.start)
    return out, lse


def pieces_backward(qf: torch.Tensor, kv: torch.Tensor, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    pieces: list, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients (dq, dkv) of ``pieces_forward``, piece by piece from the final output and log-sum-exp."""
    delta = (dout * out).sum(-1)
    dq, dkv = torch.zeros_like(qf), torch.zeros_like(kv)
    for qs, ks, causal, mask in pieces:
        gq, gk, gv = block_backward(qf[:, :, qs], kv[0, :, :, ks], kv[1, :, :, ks], dout[:, :, qs], out[:, :, qs],
                                    lse[:, :, qs], delta[:, :, qs], scale, causal, mask)
        dq[:, :, qs] += gq
        dkv[0, :, :, ks] += gk
        dkv[1, :, :, ks] += gv
    return dq, dkv


class AllGatherAttention(torch.autograd.Function):
    """``allgather_attention`` (see the module docstring): one all-gather of keys and values, each local chunk's
    queries against the earlier chunks (no mask) and their own chunk (causal), merged by log-sum-exp: no
    (S, T) mask is built or kept. Backward: the same pieces, the keys' and values' gradients reduced back to
    their owners."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, scale: float,
                docs: torch.Tensor | None) -> torch.Tensor:
        cp, rank, c = dist.get_world_size(group), dist.get_rank(group), q.size(2) // 2
        kv, perm = _gather(torch.stack([k, v]), group)  # (2, B, H_kv, T, D)
        out, lse = pieces_forward(q.float(), kv.float(), _pieces(_mine(rank, cp), c, docs), scale)
        ctx.save_for_backward(q, k, v, out, lse, docs)  # the shard's keys and values: gathered again in backward
        ctx.group, ctx.perm, ctx.scale = group, perm, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, docs = ctx.saved_tensors
        group = ctx.group
        cp, rank, c = dist.get_world_size(group), dist.get_rank(group), q.size(2) // 2
        kv, _ = _gather(torch.stack([k, v]), group)  # (2, B, H_kv, T, D), not kept from forward
        dq, dkv = pieces_backward(q.float(), kv.float(), dout.float(), out, lse, _pieces(_mine(rank, cp), c, docs),
                                  ctx.scale)
        mine = _reduce_to_owners(dkv, ctx.perm, group)  # (2, B, H_kv, S, D)
        return dq.to(q.dtype), mine[0].to(q.dtype), mine[1].to(q.dtype), None, None, None


class DocumentAttention(torch.autograd.Function):
    """Causal attention inside packed documents over a whole sequence in global order (q, k, v: (B, H, T, D);
    ``docs``: (B, T)), in ``chunks`` query chunks, each against the earlier chunks and its own, every piece's
    document mask built from ``docs`` in forward and again in backward: no (T, T) mask is kept (``alltoall``'s
    attention on its heads)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, docs: torch.Tensor,
                chunks: int) -> torch.Tensor:
        c = q.size(2) // chunks
        out, lse = pieces_forward(q.float(), torch.stack([k, v]).float(),
                                  _pieces([(j, j) for j in range(chunks)], c, docs), scale)
        ctx.save_for_backward(q, k, v, out, lse, docs)
        ctx.scale, ctx.chunks = scale, chunks
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, docs = ctx.saved_tensors
        c = q.size(2) // ctx.chunks
        dq, dkv = pieces_backward(q.float(), torch.stack([k, v]).float(), dout.float(), out, lse,
                                  _pieces([(j, j) for j in range(ctx.chunks)], c, docs), ctx.scale)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, scale: float,
                        docs: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's load-balanced shard (q: (B, H, S, D); k, v: (B, H_kv, S, D), H_kv dividing
    H: only the key/value heads are gathered) over the whole sequence's keys and values, gathered; with ``docs``
    (the whole sequence's document ids, (B, T)) inside each document only."""
    return AllGatherAttention.apply(q, k, v, group, scale, docs)
