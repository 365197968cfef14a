"""Ring attention over the context-parallel group, on the load-balanced causal split (``sharding``).

Rank ``r`` of ``N`` holds queries, keys and values of chunks ``r`` and ``2N-1-r`` (``c`` tokens each; local
sequence ``S = 2c``). At ring step ``s`` it holds the key/value block of rank ``src = r - s (mod N)`` and
computes, by the causal mask between the chunks' global positions:

* ``s = 0``: its own block, causal over the local sequence (its positions increase);
* ``src < r``: every local query against the block's first chunk (earlier than both local chunks), unmasked;
* ``src > r``: the local second chunk's queries against the whole block (both chunks earlier), unmasked.

So every step after the first computes ``S x c`` scores on every rank: no rank idles. Each block runs PyTorch's
fused flash kernel on the CPU (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, which give and
take the log-sum-exp the merge needs; ~15x faster than the explicit block at 8K tokens, and never holding the block's
scores), and the explicit math (``_scores``) on other devices. Each block's output is
merged into the running one by their log-sum-exps (``merge``). The next block's transfer (one batched
send/recv of keys and values stacked) is issued before the block's compute and waited after it, so it overlaps.

Packed documents: every rank has the whole sequence's document ids (the batch's ``doc_ids``, a few integers per
token; they never travel), builds each block's mask from its queries' and the block's keys' ids (``_piece``) and
passes it to the block's kernel on top of the causal mask. A query row that sees no key of a block (the block
holds only other documents) gets output 0 and log-sum-exp -inf, weight 0 in the merge; the own block always
holds the query itself, so the merged log-sum-exp is finite and backward has no NaN. Documents of any length,
cut anywhere by the chunks.

Backward (flash-attention's, block by block, from the final output and log-sum-exp) passes keys, values and
their gradient accumulators round the same ring: after ``N`` hops each accumulator is back with its owner. The next
block's keys and values move while the current block computes; its accumulator must hold this rank's part before
it moves on, so that hop follows the block's compute.

Grouped-query attention: keys and values travel with their own ``H_kv`` heads and are repeated to the query heads
inside each block's compute (their gradients summed back), so the transfers carry ``H_kv``, not ``H``, heads.

Communication, per attention layer and micro-batch: forward ``N - 1`` sends and receives of ``2 B H_kv c D`` x2
elements (keys and values); backward ``N - 1`` of keys and values and ``N`` of their gradients.

Under ``torch.compile`` (``train.compile``, whole model or blocks) ``ring_attention`` is
``torch.compiler.disable``d: dynamo does not trace c10d's batched point-to-point (it refuses ``P2POp`` and
``batch_isend_irecv``), so the graphs end before each attention layer and resume after it (one graph break per
layer; each block two graphs), and the ring, whose kernels are PyTorch's fused attention already, runs eagerly
between them with its transfers overlapped as above. Left to dynamo, it broke the graph inside the ring's forward
instead (9 graphs for plait's 2-block GPT rather than 5).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from plait.parallel.context.sharding import shard_index


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool,
            mask: torch.Tensor | None = None) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, H, Sq, Sk)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def doc_mask(q_docs: torch.Tensor, k_docs: torch.Tensor) -> torch.Tensor:
    """(B, Sq) and (B, Sk) document ids -> (B, 1, Sq, Sk) boolean, True where query and key share a document."""
    return (q_docs[:, :, None] == k_docs[:, None, :])[:, None]


def _bias(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """The CPU kernel's additive mask (it takes the query's dtype, not booleans): 0 where seen, -inf where not."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill_(~mask, float("-inf"))


def _repeat(k: torch.Tensor, v: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention: key/value heads (B, H_kv, Sk, D) repeated to the ``heads`` query heads, here,
    after they travelled (only the H_kv heads move)."""
    repeat = heads // k.size(1)
    if repeat == 1:
        return k, v
    return k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)


def _fold(g: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The adjoint of ``_repeat``: (B, H, Sk, D) gradients summed over each key/value head's query heads."""
    B, H, Sk, D = g.shape
    return g if H == kv_heads else g.view(B, kv_heads, H // kv_heads, Sk, D).sum(2)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                  mask: torch.Tensor | None = None, fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention output (B, H, Sq, D) and log-sum-exp (B, H, Sq), float32. ``mask`` (B, 1, Sq, Sk),
    True where a query may see a key (packed documents), on top of ``causal``. A query row that sees no key of
    the block (another document's block) gets output 0 and log-sum-exp -inf, so ``merge`` gives it weight 0.
    k, v may have fewer (key/value) heads than q (grouped-query attention). ``fused``: PyTorch's CPU kernel
    (default on the CPU: the same math, no (Sq, Sk) scores held at once) or the explicit math (elsewhere)."""
    k, v = _repeat(k, v, q.size(1))
    if q.device.type == "cpu" if fused is None else fused:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                               attn_mask=_bias(mask, q), scale=scale)
        if mask is not None:  # the kernel gives a row with no key log-sum-exp 0 (and output 0): make it -inf
            seen = mask & torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril() if causal else mask
            lse = lse.masked_fill(~seen.any(-1), float("-inf"))
        return out, lse
    s = _scores(q, k, scale, causal, mask)
    lse = torch.logsumexp(s, dim=-1)
    finite = lse.masked_fill(torch.isinf(lse), 0.0)  # a row with no key: exp(-inf - 0) = 0, no NaN
    return torch.matmul(torch.exp(s - finite.unsqueeze(-1)), v), lse


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, delta: torch.Tensor, scale: float, causal: bool,
                   mask: torch.Tensor | None = None, fused: bool | None = None) -> tuple[torch.Tensor, ...]:
    """Gradients (dq, dk, dv) of one block given the final ``out``, ``lse`` and ``delta = rowsum(dout * out)``
    (the final log-sum-exp is finite: every query sees itself); dk, dv have k's and v's (key/value) heads."""
    kv_heads = k.size(1)
    k, v = _repeat(k, v, q.size(1))
    if q.device.type == "cpu" if fused is None else fused:  # the CPU kernel computes ``delta`` itself
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=_bias(mask, q), scale=scale)
        return dq, _fold(dk, kv_heads), _fold(dv, kv_heads)
    p = torch.exp(_scores(q, k, scale, causal, mask) - lse.unsqueeze(-1))  # (B, H, Sq, Sk): the final probabilities
    dv = torch.matmul(p.transpose(-2, -1), dout)
    ds = p * (torch.matmul(dout, v.transpose(-2, -1)) - delta.unsqueeze(-1))
    dk = torch.matmul(ds.transpose(-2, -1), q) * scale
    return torch.matmul(ds, k) * scale, _fold(dk, kv_heads), _fold(dv, kv_heads)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merge a block's (output, log-sum-exp) into the running ones, in place."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


class Ring:
    """The context-parallel group as a ring: this rank's index, its neighbours' global ranks."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, t: torch.Tensor, tag: int = 0) -> tuple[list, torch.Tensor]:
        """Start sending ``t`` to the next rank and receiving the previous rank's into a new tensor; returns
        the requests to wait on and that tensor. ``tag`` keeps two shifts in flight apart (gloo matches by it;
        NCCL keeps them in order on its stream)."""
        recv = torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return dist.batch_isend_irecv(ops), recv


def _wait(reqs: list) -> None:
    for r in reqs:
        r.wait()


def _piece(r: int, src: int, c: int, docs: torch.Tensor | None) -> tuple[slice, slice, bool, torch.Tensor | None]:
    """What rank ``r``'s queries compute against the block of rank ``src`` (see the module docstring): the query
    slice, the key slice, whether causal, and the document mask of that piece (``docs``: the whole sequence's
    document ids (B, T), or None)."""
    everything = slice(None)
    if src == r:
        qs, ks, causal = everything, everything, True
    elif src < r:
        qs, ks, causal = everything, slice(0, c), False
    else:
        qs, ks, causal = slice(c, None), everything, False
    if docs is None:
        return qs, ks, causal, None
    n, T = docs.size(1) // (2 * c), docs.size(1)
    q_docs = docs.index_select(1, shard_index(T, n, r, device=docs.device))[:, qs]
    k_docs = docs.index_select(1, shard_index(T, n, src, device=docs.device))[:, ks]
    return qs, ks, causal, doc_mask(q_docs, k_docs)


class RingAttention(torch.autograd.Function):
    """``ring_attention(q, k, v)`` (see the module docstring). Forward: ``N - 1`` ring shifts of keys and
    values; backward: ``N - 1`` of keys and values and ``N`` of their gradients. The document ids (packed
    documents) do not travel: every rank has the whole sequence's and builds each block's mask from them."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring,
                scale: float, docs: torch.Tensor | None) -> torch.Tensor:
        n, r, c = ring.size, ring.rank, q.size(2) // 2
        qf = q.float()
        kv = torch.stack([k, v]).float().contiguous()  # (2, B, H, S, D)
        out = lse = None
        for s in range(n):
            if s < n - 1:
                reqs, incoming = ring.shift(kv)
            qs, ks, causal, mask = _piece(r, (r - s) % n, c, docs)
            bo, bl = block_forward(qf[:, :, qs], kv[0, :, :, ks], kv[1, :, :, ks], scale, causal, mask)
            if s == 0:
                # merged into in place below: copies, since selective checkpointing keeps the kernel's outputs
                out, lse = bo.clone(), bl.clone()
            else:
                merge(out[:, :, qs], lse[:, :, qs], bo, bl)
            if s < n - 1:
                _wait(reqs)
                kv = incoming
        ctx.save_for_backward(q, k, v, out, lse, docs)
        ctx.ring, ctx.scale = ring, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, docs = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        n, r, c = ring.size, ring.rank, q.size(2) // 2
        qf, dout = q.float(), dout.float()
        delta = (dout * out).sum(-1)  # (B, H, S)
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v]).float().contiguous()  # (2, B, H, S, D): the block this rank holds now
        dkv = torch.zeros_like(kv)  # that block's gradient accumulator, travelling with it
        for s in range(n):
            if s < n - 1:  # the next block's keys and values move while this one computes
                reqs, incoming = ring.shift(kv)
            qs, ks, causal, mask = _piece(r, (r - s) % n, c, docs)
            gq, gk, gv = block_backward(qf[:, :, qs], kv[0, :, :, ks], kv[1, :, :, ks], dout[:, :, qs],
                                        out[:, :, qs], lse[:, :, qs], delta[:, :, qs], scale, causal, mask)
            dq[:, :, qs] += gq
            dkv[0, :, :, ks] += gk
            dkv[1, :, :, ks] += gv
            if n > 1:  # the accumulator follows its block once this rank's part is in (the last hop: home)
                grad_reqs, dkv = ring.shift(dkv, tag=1)
                _wait(grad_reqs)
            if s < n - 1:
                _wait(reqs)
                kv = incoming
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


@torch.compiler.disable  # dynamo does not trace c10d point-to-point: a compiled block runs the ring eagerly
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, scale: float,
                   docs: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's load-balanced shard (q: (B, H, S, D); k, v: (B, H_kv, S, D), H_kv dividing
    H: only the key/value heads travel, repeated to the query heads per block) over the whole sequence;
    with ``docs`` (the whole sequence's document ids, (B, T)) inside each query's document only. Under
    ``torch.compile`` it runs eagerly between the graphs (see the module docstring)."""
    return RingAttention.apply(q, k, v, ring, scale, docs)
