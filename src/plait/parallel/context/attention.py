"""The context-parallel attention a model's attention layers are routed through, and the routing for plait's GPT.

``ContextAttention`` holds the group, the implementation (``ring``, ``alltoall`` or ``allgather``) and this step's shard
positions; ``route_gpt`` makes every ``CausalSelfAttention`` of plait's GPT call it instead of
``scaled_dot_product_attention`` (its projections and head split unchanged: the model's code stays as it is).
Outside a step the strategy runs (``active``), calling the routed model raises: a whole sequence given to a
rank that holds a shard would be attended as if it were one.
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from plait.parallel.context.allgather import allgather_attention
from plait.parallel.context.alltoall import alltoall_attention, check_heads
from plait.parallel.context.ring import Ring, ring_attention
from plait.parallel.context.sharding import ContextError


class ContextAttention:
    """Causal attention of this rank's shard over the whole sequence (see the module docstring)."""

    def __init__(self, group: Any, impl: str) -> None:
        self.group, self.impl = group, impl
        self.ring = Ring(group)
        self.positions: torch.Tensor | None = None  # this step's shard positions (S,), set by ``active``

    @contextlib.contextmanager
    def active(self, positions: torch.Tensor) -> Iterator[None]:
        """Inside: the routed layers attend over the shard at ``positions`` (global, (S,))."""
        self.positions = positions
        try:
            yield
        finally:
            self.positions = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v: (B, H, S, D) of this rank's shard -> (B, H, S, D)."""
        if self.positions is None:
            raise ContextError("under parallel.cp > 1 the model runs on sequence shards that plait makes: run each "
                               "micro-step with p.forward_backward(model, batch) and evaluate with p.evaluate(model, "
                               "batch), not model(...) on a whole sequence")
        scale = 1.0 / math.sqrt(q.size(-1))
        if self.impl == "ring":
            return ring_attention(q, k, v, self.ring, scale)
        if self.impl == "alltoall":
            return alltoall_attention(q, k, v, self.group, scale)
        return allgather_attention(q, k, v, self.group, self.positions, scale)


def _gpt_attention_forward(attention: ContextAttention) -> Any:
    def forward(self: nn.Module, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attn_mask is not None:
            raise ContextError("parallel.cp > 1 does not take the document mask yet (data.document_mask); set "
                               "data.document_mask=false or parallel.cp=1")
        B, S, _ = x.shape  # (B, S, C): this rank's shard
        q = self.q(x).view(B, S, -1, self.head_dim).transpose(1, 2)  # (B, H, S, D)
        k = self.k(x).view(B, S, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, S, -1, self.head_dim).transpose(1, 2)
        y = attention(q, k, v).transpose(1, 2).reshape(B, S, -1)  # (B, S, C)
        return self.proj(y)
    return forward


def route_gpt(model: nn.Module, attention: ContextAttention) -> int:
    """Route every attention layer of plait's GPT in ``model`` through ``attention``; returns how many."""
    from plait.models.gpt import CausalSelfAttention

    layers = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
    for layer in layers:
        if layer.dropout > 0:
            raise ContextError(f"parallel.cp > 1 computes attention without dropout, but the model's attention "
                               f"dropout is {layer.dropout}; set model.dropout=0")
        if attention.impl == "alltoall":
            check_heads(layer.n_head, attention.ring.size)
        layer.forward = types.MethodType(_gpt_attention_forward(attention), layer)
    return len(layers)
