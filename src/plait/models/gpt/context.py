"""plait's GPT under context parallelism: its attention layers routed through the cp attention.

``route`` makes every ``CausalSelfAttention`` call the cp attention (``plait.parallel.context.attention``'s
``ContextAttention``) instead of ``scaled_dot_product_attention``: its projections and head split unchanged, the
model's code as it is. When the GPT masks by document (``document_mask``) its layers ask for the document mask
(``document_marker`` stands for it: the GPT builds no mask of the shard) and the cp attention builds each block's
from the whole sequence's ``doc_ids`` the context split gives ``active``. The GPT's pipeline stages (``GPTStage``)
take their shard's global positions from the cp attention (a stage's only input is the token ids).
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from plait.models.gpt.model import GPT, CausalSelfAttention
from plait.models.gpt.pipeline import GPTStage
from plait.parallel.context.alltoall import check_heads
from plait.parallel.context.attention import ContextAttention
from plait.parallel.context.sharding import ContextError


def _attention_forward(attention: ContextAttention) -> Any:
    def forward(self: nn.Module, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, S, _ = x.shape  # (B, S, C): this rank's shard
        q = self.q(x).view(B, S, -1, self.head_dim).transpose(1, 2)  # (B, H, S, D)
        k = self.k(x).view(B, S, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, S, -1, self.head_dim).transpose(1, 2)
        y = attention(q, k, v, documents=attn_mask is not None).transpose(1, 2).reshape(B, S, -1)  # (B, S, C)
        return self.proj(y)
    return forward


def document_marker(doc_ids: torch.Tensor) -> torch.Tensor:
    """What plait's GPT passes its routed layers for the document mask under cp: one element saying "mask by
    document" (the cp attention builds each block's mask from the whole sequence's ids), instead of the shard's
    (B, 1, S, S) mask, which the cp attention would not use."""
    return doc_ids.new_ones(1, dtype=torch.bool)


def route(module: nn.Module, attention: ContextAttention) -> int:
    """Route every attention layer of plait's GPT in ``module`` through ``attention``, and give its pipeline stages
    their shard's positions from it; returns how many layers and stages. Routing a layer again (the stages after the
    split hold the layers routed with the whole model) gives it the same forward. Raises ``ContextError`` for attention
    dropout, and under ``alltoall`` for heads that do not divide by cp."""
    for gpt in (m for m in module.modules() if isinstance(m, GPT)):
        gpt.document_mask_fn = document_marker
    stages = [m for m in module.modules() if isinstance(m, GPTStage)]
    for stage in stages:  # positional inputs only: the first stage reads its shard's positions here
        stage.positions = lambda: attention.positions
    layers = [m for m in module.modules() if isinstance(m, CausalSelfAttention)]
    for layer in layers:
        if layer.dropout > 0:
            raise ContextError(f"parallel.cp > 1 computes attention without dropout, but the model's attention "
                               f"dropout is {layer.dropout}; set model.dropout=0")
        if attention.impl == "alltoall":
            check_heads(layer.n_head, attention.ring.size)
        layer.forward = types.MethodType(_attention_forward(attention), layer)
    return len(layers) + len(stages)
