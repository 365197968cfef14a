"""FLOPs of a transformer step, and the utilisation figures built on them (MFU, HFU).

Conventions (a multiply-add is 2 FLOPs; norms, activations, softmax and embedding lookups count 0):

* forward FLOPs per token of one block: ``2 W + 4 T d`` where ``W`` is the block's matmul weights
  (``ModelShape.block_matmul_params``; for a mixture of experts the weights a token runs through, averaged
  over the blocks), ``T`` the sequence length and ``d`` the model width: the
  ``Q K^T`` and ``A V`` products over the whole ``T x T`` square (the Megatron and PaLM convention;
  causal kernels that skip the masked half still count it);
* the output head: ``2 V d`` per token;
* backward = 2 x forward.

``model_flops`` (MFU's numerator) is 3 x forward: ``6 N_mm + 12 L d T`` per token (PaLM, Chowdhery et
al. 2022, appendix B, with ``N_mm`` the matmul weights incl. the head). ``hardware_flops`` (HFU's) adds
what recomputation runs again: the blocks' forward for full recomputation, the attention core
(``4 T d`` per token and layer) for selective recomputation. ``megatron_flops`` is Narayanan et al.
2021, eq. (3): ``F = 96 B s l h^2 (1 + s/6h + V/16lh)``, which equals ``hardware_flops`` with full
recomputation for a GPT with a 4h MLP (``W = 12 h^2``).

``mfu = model_flops / (step_s x devices x peak)``, ``hfu = hardware_flops / (step_s x devices x peak)``,
with the profile's dense peak for the step's matmul dtype.
"""

from __future__ import annotations

from plait.plan.shapes import ModelShape


def block_forward_flops_per_token(shape: ModelShape) -> float:
    """``2 W + 4 T d``: one block's matmuls and attention core, forward, per token."""
    return 2.0 * shape.mean_active_block_matmul_params() + attention_core_flops_per_token(shape)


def attention_core_flops_per_token(shape: ModelShape) -> float:
    """``4 T d``: ``Q K^T`` and ``A V`` of one block, forward, per token (full square)."""
    return 4.0 * shape.seq_len * shape.n_head * shape.head_dim


def head_forward_flops_per_token(shape: ModelShape) -> float:
    """``2 V d``: the output projection to the vocabulary, per token."""
    return 2.0 * shape.vocab_size * shape.d_model


def forward_flops_per_token(shape: ModelShape) -> float:
    """All blocks and the head, forward, per token."""
    return shape.n_layer * block_forward_flops_per_token(shape) + head_forward_flops_per_token(shape)


def model_flops(shape: ModelShape, tokens: float) -> float:
    """MFU's numerator: 3 x forward (``6 N_mm + 12 L d T`` per token) for ``tokens`` tokens."""
    return 3.0 * forward_flops_per_token(shape) * tokens


def recompute_flops_per_token(shape: ModelShape, recompute: str, every_k: int = 1) -> float:
    """FLOPs that recomputation runs again per token: ``full`` every block's forward, ``every_k`` the
    forward of every k-th block, ``selective`` the attention core of every block, ``none`` nothing."""
    if recompute == "full":
        return shape.n_layer * block_forward_flops_per_token(shape)
    if recompute == "every_k":
        return len(range(0, shape.n_layer, max(every_k, 1))) * block_forward_flops_per_token(shape)
    if recompute == "selective":
        return shape.n_layer * attention_core_flops_per_token(shape)
    if recompute == "none":
        return 0.0
    raise ValueError(f"recompute must be none, full, every_k or selective; got {recompute!r}")


def hardware_flops(shape: ModelShape, tokens: float, recompute: str = "none", every_k: int = 1) -> float:
    """HFU's numerator: ``model_flops`` plus the recomputed forward FLOPs."""
    return model_flops(shape, tokens) + recompute_flops_per_token(shape, recompute, every_k) * tokens


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Narayanan et al. 2021 eq. (3): ``96 B s l h^2 (1 + s/6h + V/16lh)`` FLOPs per iteration (full
    recomputation included)."""
    b, s, ell, h, v = map(float, (batch, seq, layers, hidden, vocab))
    return 96.0 * b * s * ell * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * ell * h))


def utilisation(flops: float, step_s: float, devices: int, peak: float) -> float:
    """Achieved fraction of the devices' peak: ``flops / (step_s x devices x peak)``."""
    return flops / (step_s * devices * peak) if step_s > 0 else 0.0
