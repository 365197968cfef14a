"""The cp attention's block kernels, in one process, against dense attention differentiated by autograd.

Both paths of ``ring.block_forward`` / ``block_backward``: PyTorch's fused CPU kernel (what the CPU runs) and the
explicit math (what other devices run, forced here with ``fused=False``), on blocks with packed-document masks
whose rows see no key at all (another document's block), causal and not, with grouped-query keys and values
(4 query heads, 2 key/value heads) travelling unrepeated. A block is split in two key blocks, each computed
separately and merged by ``merge``, as the ring does: the merged output and the gradients (from the final output
and log-sum-exp) must equal one dense masked softmax attention over both. float32; observed differences up to 9.5e-7,
allowed 1e-5 (outputs) and 1e-5 (gradients); no NaN anywhere.
"""

from __future__ import annotations

import pytest
import torch

from plait.parallel.context.ring import block_backward, block_forward, doc_mask, merge

B, H, HKV, SQ, D = 2, 4, 2, 12, 8
ATOL = 1e-5


def _dense(q, k, v, allowed, scale):
    kr, vr = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
    s = (q @ kr.transpose(-2, -1) * scale).masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1) @ vr


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_blocks_merge_to_dense_attention(fused: bool, causal: bool) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, SQ, D, generator=g)
    k, v = torch.randn(B, HKV, 2 * SQ, D, generator=g), torch.randn(B, HKV, 2 * SQ, D, generator=g)
    # keys: an earlier block (0..SQ-1) and the queries' own (SQ..2SQ-1); documents of 5, 9, 3 and 7 tokens (row 0)
    q_pos = torch.arange(SQ) + SQ
    docs = torch.stack([torch.repeat_interleave(torch.arange(4), torch.tensor([5, 9, 3, 7])),
                        torch.repeat_interleave(torch.arange(2), torch.tensor([14, 10]))])  # (B, 2 SQ)
    early, own = slice(0, SQ), slice(SQ, 2 * SQ)
    first_mask, second_mask = doc_mask(docs[:, own], docs[:, early]), doc_mask(docs[:, own], docs[:, own])
    assert not first_mask[0, 0, -1].any()  # row 0's last queries see no key of the earlier block
    scale = D ** -0.5
    out, lse = block_forward(q, k[:, :, early], v[:, :, early], scale, False, first_mask, fused=fused)
    assert torch.isneginf(lse[0, :, -1]).all() and not out.isnan().any()
    second_causal = causal  # the own block: causal (the ring's first step) or not (a later block's whole rows)
    bo, bl = block_forward(q, k[:, :, own], v[:, :, own], scale, second_causal, second_mask, fused=fused)
    merge(out, lse, bo, bl)
    allowed = doc_mask(docs[:, own], docs)  # (B, 1, SQ, 2 SQ)
    if second_causal:
        allowed = allowed & (torch.arange(2 * SQ)[None, :] <= q_pos[:, None])
    assert allowed.any(-1).all()
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _dense(qr, kr, vr, allowed, scale)
    assert (out - ref).abs().max().item() < ATOL
    dout = torch.randn(B, H, SQ, D, generator=g)
    ref.backward(dout)
    delta = (dout * out).sum(-1)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for ks, c, m in ((early, False, first_mask), (own, second_causal, second_mask)):
        gq, gk, gv = block_backward(q, k[:, :, ks], v[:, :, ks], dout, out, lse, delta, scale, c, m, fused=fused)
        dq += gq
        dk[:, :, ks] += gk
        dv[:, :, ks] += gv
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert not got.isnan().any()
        assert (got - want).abs().max().item() < ATOL
