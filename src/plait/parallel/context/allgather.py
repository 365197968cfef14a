"""All-gather attention over the context-parallel group: the reference form (Megatron's simplest).

Every rank gathers the whole sequence's keys and values (its queries stay its own shard) and attends with the
causal mask between global positions. Memory for keys and values is the whole sequence's, which is what ring
attention avoids; compute per rank is its shard's.

Communication per attention layer and micro-batch: forward one all-gather of keys and values stacked
(``2 B H T D`` elements received); backward their gradients reduced back to the ranks that own them (a
reduce-scatter under NCCL; gloo has none, so an all-reduce of the whole gradient and this rank's slice).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _global_order(cp: int, c: int) -> torch.Tensor:
    """Where each position of the rank-ordered gathered sequence goes: rank j's two chunks are ``j`` and
    ``2 cp - 1 - j``. Returns the permutation ``perm`` with ``whole = gathered[..., perm, :]``."""
    chunk_of = [0] * (2 * cp)  # chunk -> its slot in the gathered order
    for j in range(cp):
        chunk_of[j], chunk_of[2 * cp - 1 - j] = 2 * j, 2 * j + 1
    return torch.cat([torch.arange(chunk_of[i] * c, (chunk_of[i] + 1) * c) for i in range(2 * cp)])


class GatherSequence(torch.autograd.Function):
    """(B, H, S, D) shards of every rank -> (..., T, D) in global order. Forward: one all-gather; backward: the
    gradient summed over the ranks (reduce-scatter, or all-reduce and slice on gloo), this rank's chunks."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        perm = _global_order(cp, x.size(-2) // 2).to(x.device)
        ctx.group, ctx.perm, ctx.rank, ctx.cp = group, perm, rank, cp
        return torch.cat(parts, dim=-2).index_select(-2, perm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        ranked = torch.empty_like(grad).index_copy_(-2, ctx.perm, grad).contiguous()  # back to rank order
        s = grad.size(-2) // ctx.cp
        if dist.get_backend(ctx.group) == dist.Backend.NCCL:
            chunks = list(ranked.split(s, dim=-2))
            mine = torch.empty_like(chunks[ctx.rank]).contiguous()
            dist.reduce_scatter(mine, [t.contiguous() for t in chunks], group=ctx.group)
            return mine, None
        dist.all_reduce(ranked, group=ctx.group)
        return ranked[..., ctx.rank * s:(ctx.rank + 1) * s, :].contiguous(), None


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, positions: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """Causal attention of this rank's shard (q, k, v: (B, H, S, D); ``positions``: the shard's global positions,
    (S,)) over the whole sequence's keys and values, gathered."""
    k_all, v_all = GatherSequence.apply(torch.stack([k, v]), group).unbind(0)  # (B, H, T, D) each
    keys = torch.arange(k_all.size(-2), device=q.device)
    mask = positions.to(q.device)[:, None] >= keys[None, :]  # (S, T): True where a query sees a key
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale)
