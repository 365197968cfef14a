"""Hugging Face decoder models as pipeline stages, from the pipeline plan they ship.

A decoder whose config carries a ``base_model_pp_plan`` (Llama, Mistral, Qwen2 and their relatives)
is a base model (``model.model``) holding an input embedding, a ``ModuleList`` of decoder layers and a
final norm, plus a ``lm_head``. The plan lists those parts in order; the layers are the split units.
A stage keeps, under the full model's names, the parts before the layers on the first stage, its own
layers, and the parts after them and the head on the last stage; parameter-free helpers of the base
model (the rotary embedding) are shared by every stage.

A stage's forward does what the base model's forward does for its part: token ids to embeddings
(first stage; under sequence parallelism sliced to this rank's ``T / tp`` tokens there, so a first stage holding
the embedding alone sends the shard), positions ``0..T-1``, the rotary embedding and the causal mask built as the
model builds them (``transformers.masking_utils.create_causal_mask``, no padding mask: pipelined batches are full
sequences; under sequence parallelism a stage's input holds ``T / tp`` tokens and positions run over all ``T``;
a stage without layers computes none of them), every owned layer, then norm and head (last stage: logits
``(B, T, V)``). The first stage may hold the embedding alone and the last the norm and head alone
(``parallel.pp_split_embedding``, ``pp_split_head``). Padding masks,
caches and models without rotary position embeddings are not supported here; use ``stage_fn``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn


def _base(model: nn.Module) -> tuple[str, nn.Module] | None:
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    return (prefix, base) if isinstance(base, nn.Module) else None


def decoder_pipeline(model: nn.Module) -> HFDecoderPipeline | None:
    """The adapter for a Hugging Face decoder with a ``base_model_pp_plan``; None for other models."""
    plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None)
    found = _base(model)
    if not plan or found is None:
        return None
    _, base = found
    names = list(plan)
    layers = [n for n in names if isinstance(getattr(base, n, None), nn.ModuleList)]
    if len(layers) != 1 or not hasattr(base, "rotary_emb"):
        return None
    i = names.index(layers[0])
    return HFDecoderPipeline(before=names[:i], layers=layers[0], after=names[i + 1:])


class _Holder(nn.Module):
    """Stands in for the base model inside a stage, so parameter names stay ``model.layers.3...``."""

    def __init__(self, parts: dict[str, nn.Module]) -> None:
        super().__init__()
        for name, part in parts.items():
            self.add_module(name, part)


class HFDecoderStage(nn.Module):
    """The part of a Hugging Face decoder one pipeline stage owns (see the module docstring)."""

    def __init__(self, model: nn.Module, adapter: HFDecoderPipeline, layer_ids: list[str], *, is_first: bool,
                 is_last: bool) -> None:
        super().__init__()
        prefix, base = _base(model)
        self.prefix, self.is_first, self.is_last = prefix, is_first, is_last
        self.config = model.config
        parts: dict[str, nn.Module] = {}
        if is_first:
            parts.update({n: getattr(base, n) for n in adapter.before})
        layers = getattr(base, adapter.layers)
        parts[adapter.layers] = nn.ModuleDict({i: layers[int(i)] for i in layer_ids})
        if is_last:
            parts.update({n: getattr(base, n) for n in adapter.after})
        parts["rotary_emb"] = base.rotary_emb
        self.add_module(prefix, _Holder(parts))
        self.adapter = adapter
        # sequence parallelism (plait.parallel.tensor.hf_sequence): later stages receive T / shards tokens
        self.shards = int(base.__dict__.get("_plait_sequence_shards", 1))
        if self.shards > 1 and is_first:
            from plait.parallel.tensor.hf_sequence import sequence_mesh

            self.mesh = sequence_mesh(base)
        if is_last:
            self.lm_head = model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = getattr(self, self.prefix)
        if self.is_first:  # x: token ids (B, T)
            for name in self.adapter.before:
                x = getattr(base, name)(x)  # (B, T, C)
            if self.shards > 1:  # this rank's tokens (B, T / shards, C), whether or not a layer follows here
                from plait.parallel.tensor.hf_sequence import slice_sequence

                x = slice_sequence(self.mesh, x)
        layers = getattr(base, self.adapter.layers)
        if len(layers):  # positions, rotary angles and the mask of the whole sequence, for this stage's layers
            T = x.size(1) * self.shards  # under sequence parallelism the input holds this rank's T / shards
            position_ids = torch.arange(T, device=x.device).unsqueeze(0)  # (1, T)
            position_embeddings = base.rotary_emb(x, position_ids=position_ids)
            whole = x if T == x.size(1) else x.new_empty(x.size(0), T, 1)  # the mask's shape: the whole sequence
            mask = _causal_mask(self.config, whole, position_ids)
        for layer in layers.values():
            out = layer(x, attention_mask=mask, position_ids=position_ids, position_embeddings=position_embeddings)
            x = out[0] if isinstance(out, tuple) else out  # (B, T, C)
        if self.is_last:
            for name in self.adapter.after:
                x = getattr(base, name)(x)
            x = self.lm_head(x)  # (B, T, V)
        return x


def _causal_mask(config: Any, embeds: torch.Tensor, position_ids: torch.Tensor) -> Any:
    """The mask the base model would build for a full, unpadded batch (None when its attention
    implementation applies causality itself)."""
    from transformers.masking_utils import create_causal_mask

    # The cache argument (None: no cache) is named past_key_values up to transformers 5.2x and cache after
    # (where the old name is deprecated); the signature says which this one takes.
    cache = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
    return create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=None, position_ids=position_ids,
                              **{cache: None})


class HFDecoderPipeline:
    """Pipeline adapter for Hugging Face decoders (see the module docstring)."""

    def __init__(self, before: list[str], layers: str, after: list[str]) -> None:
        self.before, self.layers, self.after = before, layers, after

    def layer_names(self, model: nn.Module) -> list[str]:
        prefix, base = _base(model)
        return [f"{prefix}.{self.layers}.{i}" for i in range(len(getattr(base, self.layers)))]

    def head_name(self, model: nn.Module) -> str:
        """The split point that starts a stage holding only the final norm and the head (``parallel.pp_split``)."""
        prefix, _ = _base(model)
        return f"{prefix}.{self.after[0]}" if self.after else "lm_head"

    def build_stage(self, model: nn.Module, layers: list[str], *, is_first: bool, is_last: bool) -> nn.Module:
        if is_first:  # the first stage slices the embedding's output itself (HFDecoderStage.forward)
            from plait.parallel.tensor.hf_sequence import mark_sliced

            mark_sliced(model)
        return HFDecoderStage(model, self, [n.rsplit(".", 1)[1] for n in layers], is_first=is_first, is_last=is_last)
