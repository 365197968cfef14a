"""The context-parallel attention a model's attention layers are routed through, and the routing for Hugging Face
decoders.

``ContextAttention`` holds the group, the implementation (``ring``, ``alltoall`` or ``allgather``) and this step's shard
positions; a model class with a registered spec routes its own layers to it (plait's GPT: ``plait.models.gpt.context``
makes every ``CausalSelfAttention`` call it instead of ``scaled_dot_product_attention``).
``route_hf`` does the same for Hugging Face decoders (``HF_ATTENTION``: Llama, Qwen2, Mistral, and the attention of the
Mixtral and Qwen3-MoE mixtures of experts, Qwen3-MoE's with per-head q/k norms applied before the call, so unchanged
under cp): their attention layers pick their attention function by name from ``config._attn_implementation``, so each
recognised layer gets its own copy of the config naming plait's (``plait_context``, registered with transformers'
``AttentionInterface``), which calls this layer's ``ContextAttention``. The model's own config (its mask construction,
``save_pretrained``) is untouched; the causal mask it builds for the shard's local positions is not used (the cp
attention masks by global position), and a padding ``attention_mask`` is taken out of the model's call and given to
``active`` as document ids (``sharding.padding_docs``) by which every routed layer masks. Keys and values of
grouped-query attention travel with their own heads under ``ring`` and ``allgather`` (repeated to the query heads per
block, after the transfer); ``alltoall`` splits heads, so it repeats them first (its transfers carry ``H / H_kv`` times
the model's keys and values).
Outside ``active`` (the context split's micro-steps, and the forward of the model ``setup`` returns:
``user_forward``) a routed layer raises: a whole sequence given to a rank that holds a shard would be attended as
if it were one.
"""

from __future__ import annotations

import contextlib
import math
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
        self.docs: torch.Tensor | None = None  # this step's whole-sequence document ids (B, T), when the batch has them
        self.padded = False  # ``docs`` stand for a padding mask: every routed layer masks by them

    @contextlib.contextmanager
    def active(self, positions: torch.Tensor, docs: torch.Tensor | None = None, padded: bool = False
               ) -> Iterator[None]:
        """Inside: the routed layers attend over the shard at ``positions`` (global, (S,)); ``docs``: the whole
        sequence's document ids (B, T) of packed documents, for the layers that mask by document, or with
        ``padded`` those of a padding mask (``sharding.padding_docs``), by which every layer masks."""
        self.positions, self.docs, self.padded = positions, docs, padded
        try:
            yield
        finally:
            self.positions = self.docs = None
            self.padded = False

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: bool = False) -> torch.Tensor:
        """q (B, H, S, D), k and v (B, H_kv, S, D), H_kv dividing H, of this rank's shard -> (B, H, S, D);
        ``documents``: attend inside each packed document only (by the document ids given to ``active``); with a
        padding mask (``active(..., padded=True)``) every call masks by its ids, whatever ``documents`` says.
        ``ring`` and ``allgather`` move the H_kv key/value heads and repeat them per block; ``alltoall`` splits
        heads, so it repeats them first (its transfers then carry H heads of keys and values)."""
        if self.positions is None:
            raise ContextError("under parallel.cp > 1 the model runs on sequence shards that plait makes in the "
                               "forward of the model p.setup returned: call that model (model(...), "
                               "p.forward_backward, p.evaluate), not one of its submodules, and with activation "
                               "checkpointing backpropagate each loss with p.backward(loss) after its forward")
        docs = None
        if self.padded:
            docs = self.docs
        elif documents:
            if self.docs is None:
                raise ContextError("the model masks attention by document, but the batch has no doc_ids; give "
                                   "plait's GPT packed batches with doc_ids (data.pack) or build it with "
                                   "document_mask=False")
            docs = self.docs
        if docs is not None and docs.device != q.device:  # once per step, not per layer
            self.docs = docs = docs.to(q.device)
        scale = 1.0 / math.sqrt(q.size(-1))
        if self.impl == "ring":
            return ring_attention(q, k, v, self.ring, scale, docs)
        if self.impl == "alltoall":
            repeat = q.size(1) // k.size(1)
            if repeat > 1:
                k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
            return alltoall_attention(q, k, v, self.group, scale, docs)
        return allgather_attention(q, k, v, self.group, scale, docs)


# the layers ``route_hf`` recognises: each computes q, k, v (and any per-head norm, rotary) itself, then calls the
# attention function ``config._attn_implementation`` names with transformers' signature
HF_ATTENTION = ("LlamaAttention", "Qwen2Attention", "MistralAttention", "MixtralAttention", "Qwen3MoeAttention")
HF_NAME = "plait_context"


def _hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q (B, H, S, D), k/v (B, H_kv, S, D) -> ((B, S, H, D), None)."""
    if dropout:
        raise ContextError(f"parallel.cp > 1 computes attention without dropout, but {type(module).__name__} has "
                           f"attention dropout {dropout}; set the config's attention_dropout=0")
    if scaling is not None and abs(scaling - query.size(-1) ** -0.5) > 1e-12:
        raise ContextError(f"parallel.cp > 1 scales attention scores by 1/sqrt(head_dim), but "
                           f"{type(module).__name__} uses {scaling}; use parallel.cp=1 for this model")
    window, length = kwargs.get("sliding_window"), query.size(2) * module._plait_context.ring.size
    if window is not None and window < length:
        raise ContextError(f"parallel.cp > 1 computes full causal attention, but {type(module).__name__} attends "
                           f"within a sliding window of {window} tokens, shorter than the sequence ({length}); use "
                           "parallel.cp=1 for this model, or sequences no longer than its window")
    out = module._plait_context(query, key, value)  # (B, H, S, D); GQA keys/values repeated where the impl needs
    return out.transpose(1, 2).contiguous(), None


def route_hf(model: nn.Module, attention: ContextAttention) -> int:
    """Route every recognised Hugging Face attention layer in ``model`` through ``attention``; returns how many.
    Raises naming the attention modules it did not recognise when the model is a transformers model with none."""
    import copy

    layers = [m for m in model.modules() if type(m).__name__ in HF_ATTENTION]
    if not layers:
        if any(type(m).__module__.startswith("transformers.") for m in model.modules()):
            found = sorted({type(m).__name__ for m in model.modules() if "Attention" in type(m).__name__})
            raise ContextError(f"parallel.cp > 1 routes the attention layers of plait's GPT and of Hugging Face "
                               f"{', '.join(HF_ATTENTION)}; {type(model).__name__}'s attention module "
                               f"{', '.join(found) or '(none found)'} is not one plait can route: use parallel.cp=1 "
                               f"for this model")
        return 0
    from transformers import AttentionInterface

    AttentionInterface.register(HF_NAME, _hf_attention)
    for layer in layers:
        if getattr(layer, "attention_dropout", 0.0):
            raise ContextError(f"parallel.cp > 1 computes attention without dropout, but {type(layer).__name__} has "
                               f"attention dropout {layer.attention_dropout}; set the config's attention_dropout=0")
        if attention.impl == "alltoall":
            check_heads(layer.config.num_attention_heads, attention.ring.size)
        config = copy.copy(layer.config)
        config._attn_implementation = HF_NAME
        layer.config = config
        layer._plait_context = attention
    return len(layers)
