"""torchtitan's own Llama 3, tiny, for the tests that train it through plait: ``Llama3Model`` built from
torchtitan's config classes as its registry builds ``debugmodel`` (fused ``wqkv``, complex RoPE cache,
depth-scaled init), with causal SDPA as the inner attention (torchtitan's flex and varlen backends need a GPU
or inductor) and dim 64, 2 layers, 4 heads, 2 kv heads."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

try:
    import torchtitan.models.llama3  # noqa: F401
except ImportError as e:  # not installed, or a package its import needs is missing
    pytest.skip(f"torchtitan's Llama 3 is not importable ({e}); `make .venv/.installed` installs torchtitan 0.3.0 and "
                "what its models import (see the Makefile)", allow_module_level=True)

from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config  # noqa: E402
from torchtitan.models.common.param_init import depth_scaled_std, skip_param_init  # noqa: E402
from torchtitan.models.llama3 import Llama3Model  # noqa: E402
from torchtitan.models.llama3.model import Llama3TransformerBlock  # noqa: E402

DIM, LAYERS, HEADS, KV_HEADS, VOCAB, MAX_SEQ = 64, 2, 4, 2, 128, 64


def _trunc(std: float) -> dict:
    return {"weight": partial(nn.init.trunc_normal_, std=std), "bias": nn.init.zeros_}


def llama3_config(tied: bool = False) -> Llama3Model.Config:
    """The tiny Llama 3's config; ``tied``: embedding and head share one weight (the embedding's init skipped, as
    torchtitan's tied configs do: the head initialises it)."""
    rope = ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=MAX_SEQ, theta=500000, scaling="llama")
    layers = []
    for i in range(LAYERS):
        norm = {"weight": nn.init.ones_}
        layers.append(Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=DIM, param_init=norm),
            ffn_norm=RMSNorm.Config(normalized_shape=DIM, param_init=norm),
            attention=make_gqa_config(dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, wqkv_param_init=_trunc(0.02),
                                      wo_param_init=_trunc(depth_scaled_std(0.02, i)),
                                      inner_attention=ScaledDotProductAttention.Config(), fuse_qkv=True, rope=rope),
            feed_forward=make_ffn_config(dim=DIM, hidden_dim=4 * DIM, w1_param_init=_trunc(0.02),
                                         w2w3_param_init=_trunc(depth_scaled_std(0.02, i)))))
    s = DIM ** -0.5
    return Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB, layers=layers, enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init={
            "weight": skip_param_init if tied else partial(nn.init.normal_, std=1.0)}),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init={"weight": nn.init.ones_}),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init={
            "weight": partial(nn.init.trunc_normal_, std=s, a=-3 * s, b=3 * s), "bias": nn.init.zeros_}))


def build(meta: bool = False, tied: bool = False, seed: int = 0) -> Llama3Model:
    """The tiny Llama 3: on the meta device, or on the CPU as torchtitan's trainer makes it (built on meta,
    ``to_empty``, ``init_weights``; seeded)."""
    with torch.device("meta"):
        model = llama3_config(tied).build()
    if not meta:
        torch.manual_seed(seed)
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cpu"))
    return model
