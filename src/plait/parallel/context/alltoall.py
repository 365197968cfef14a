"""All-to-all (Ulysses) attention over the context-parallel group: sequence shards become head shards and back.

Each rank holds (B, H, S, D) for its ``S = T / cp`` tokens. One all-to-all gives it instead ``H / cp`` heads
for the whole sequence (every rank's shard of those heads), in global order; causal attention over the whole
sequence runs on those heads; a second all-to-all brings every head back to the ranks holding its tokens.
With packed documents that attention runs in ``2 cp`` query chunks, each against the earlier chunks and its own
with the pieces' document masks built from the whole sequence's ids when needed (``DocumentAttention``): no
(T, T) mask is kept. Heads (and key-value heads) must divide by cp. The
all-to-all is its own adjoint, so backward runs the same exchanges the other way.

Communication per attention layer and micro-batch: forward one all-to-all of q, k, v stacked
(``3 B H S D`` elements, ``(cp - 1) / cp`` of them leave the rank) and one of the output (``B H S D``);
backward the same volumes reversed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.parallel.context.allgather import DocumentAttention, _global_order
from plait.parallel.context.sharding import ContextError


class AllToAll(torch.autograd.Function):
    """``x`` (cp, ...) -> part j sent to rank j, part j received from rank j. Backward: the same on the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)  # of the contiguous input: the collective writes the parts in order
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def check_heads(num_heads: int, cp: int, what: str = "attention heads") -> None:
    """A clear error, naming ``ring``, unless ``num_heads`` divides by cp."""
    if num_heads % cp:
        raise ContextError(f"parallel.cp_impl=alltoall gives each of the cp={cp} ranks num_heads / cp heads, but the "
                           f"model has {num_heads} {what}, which do not divide by {cp}; use parallel.cp_impl=ring "
                           "(any head count), or a cp that divides the heads")


def alltoall_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, scale: float,
                       docs: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's load-balanced shard (q, k, v: (B, H, S, D)) over the whole sequence; with
    ``docs`` (the whole sequence's document ids, (B, T)) inside each document only."""
    cp = dist.get_world_size(group)
    B, H, S, D = q.shape
    check_heads(H, cp)
    perm = _global_order(cp, S // 2).to(q.device)
    qkv = torch.stack([q, k, v]).view(3, B, cp, H // cp, S, D).permute(2, 0, 1, 3, 4, 5)  # (cp, 3, B, H/cp, S, D)
    heads = AllToAll.apply(qkv, group)  # part j: rank j's tokens of this rank's heads
    whole = heads.permute(1, 2, 3, 0, 4, 5).reshape(3, B, H // cp, cp * S, D).index_select(3, perm)
    if docs is None:
        y = F.scaled_dot_product_attention(whole[0], whole[1], whole[2], is_causal=True, scale=scale)
    else:  # (B, H/cp, T, D), in 2 cp query chunks, each piece's document mask built when needed, none kept
        y = DocumentAttention.apply(whole[0], whole[1], whole[2], scale, docs, 2 * cp)
    ranked = torch.empty_like(y).index_copy(2, perm, y).view(B, H // cp, cp, S, D).permute(2, 0, 1, 3, 4)
    back = AllToAll.apply(ranked, group)  # part j: this rank's tokens of rank j's heads
    return back.permute(1, 0, 2, 3, 4).reshape(B, H, S, D)
