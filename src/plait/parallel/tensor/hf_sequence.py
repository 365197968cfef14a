"""Sequence parallelism for Hugging Face decoders (``parallel.sequence_parallel`` with a Llama-style model).

The residual stream between the decoder layers is split along the sequence over the tp ranks (each holds
``T / tp`` tokens), as in plait's GPT and Megatron-LM (Korthikanti et al. 2022): the norms run on the shards
(``SequenceParallel``: their weights replicated, their gradients summed over tp by DTensor), the attention's and
the MLP's input is all-gathered before their column-parallel projections (one all-gather each, shared by q, k
and v, by gate and up, and kept once for their backward; under autocast gathered in half precision:
``PrepareGatheredInput``; backward: one reduce-scatter of the summed input gradient), and the row-parallel
``o_proj`` and ``down_proj`` reduce-scatter their outputs onto the shards (backward: an all-gather) instead of
all-reducing them. The head all-gathers the final norm's shards.

Positions stay whole: the embedding's output is the full sequence on every tp rank (the vocabulary-parallel
embedding's all-reduce), so the model computes its positions, rotary angles and mask for all ``T`` tokens as
it does without tensor parallelism; the first decoder layer takes its slice of the tokens (no communication;
backward: an all-gather of the gradient). In a pipeline the first stage slices the embedding's output itself
(``slice_sequence``; the first layer then passes its input on: ``mark_sliced``), so a first stage holding the
embedding alone sends the shard; a later stage receives the shards and computes its positions for ``T = tp x``
its input's length (``sequence_shards``; ``plait.parallel.pipeline.hf``).

Models: decoders with a ``base_model_pp_plan`` whose layers hold ``input_layernorm``, ``self_attn`` (called with
``hidden_states=``), ``post_attention_layernorm`` and ``mlp`` (Llama, Mistral, Qwen2 and relatives); others are
refused with a clear error rather than left silently unsplit.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from plait.parallel.pipeline.hf import _base, decoder_pipeline
from plait.parallel.tensor.plan import PrepareGatheredInput, TensorParallelError

SHARDS_ATTR = "_plait_sequence_shards"
MESH_ATTR = "_plait_sequence_mesh"
SLICED_ATTR = "_plait_input_sliced"
LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
ROWWISE = ("rowwise", "o_proj", "down_proj")


def sequence_shards(base: nn.Module) -> int:
    """Over how many ranks the residual stream of ``base`` (a decoder's base model) is split along the sequence."""
    return int(base.__dict__.get(SHARDS_ATTR, 1))


def sequence_mesh(base: nn.Module) -> DeviceMesh | None:
    """The tp mesh the residual stream of ``base`` (a decoder's base model) is split over; None without sequence
    parallelism."""
    ref = base.__dict__.get(MESH_ATTR)
    return ref() if ref is not None else None


def slice_sequence(mesh: DeviceMesh, x: torch.Tensor) -> torch.Tensor:
    """This tp rank's slice ``(B, T / tp, C)`` of the whole sequence ``x`` every rank of ``mesh`` holds (the
    embedding's output), as the first layer takes it (forward: no communication; backward: an all-gather of the
    gradient)."""
    return DTensor.from_local(x, mesh, (Replicate(),), run_check=False).redistribute(mesh, (Shard(1),)).to_local()


def mark_sliced(model: nn.Module) -> None:
    """Tell the first layer that its input is this rank's slice already (a pipeline's first stage slices the
    embedding's output itself: ``slice_sequence``); no effect on a model without sequence parallelism."""
    found = _base(model)
    adapter = decoder_pipeline(model)
    layers = getattr(found[1], adapter.layers, None) if found and adapter else None
    if layers is not None and len(layers) and sequence_shards(found[1]) > 1:
        layers[0].__dict__[SLICED_ATTR] = True


class _SliceSequence(PrepareModuleInput):
    """The first layer's input: the whole sequence, sliced to this rank's tokens (``Replicate`` to ``Shard(1)``),
    unless the layer is marked sliced already (``mark_sliced``)."""

    def __init__(self) -> None:
        super().__init__(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(layer: nn.Module, inputs: Any) -> Any:
            return inputs if layer.__dict__.get(SLICED_ATTR) else self._prepare_input_fn(inputs, device_mesh)

        module.register_forward_pre_hook(hook)
        return module


def check_sequence_parallel(model: nn.Module) -> tuple[str, list[str], list[str]]:
    """(the base model's prefix, its layers' names, its modules after the layers) of a decoder sequence
    parallelism applies to; raises ``TensorParallelError`` for any other model."""
    adapter = decoder_pipeline(model)
    layers = getattr(_base(model)[1], adapter.layers, None) if adapter is not None else None
    if adapter is None or not isinstance(layers, nn.ModuleList) or not all(
            isinstance(getattr(layer, part, None), nn.Module) for layer in layers for part in LAYER_PARTS):
        raise TensorParallelError(
            f"parallel.sequence_parallel splits the residual stream of plait's GPT and of Hugging Face decoders "
            f"whose layers hold {', '.join(LAYER_PARTS)} (Llama, Mistral, Qwen2); {type(model).__name__} is "
            "neither: set parallel.sequence_parallel=false")
    prefix = _base(model)[0]
    names = [f"{prefix}.{adapter.layers}.{i}" for i in range(len(layers))]
    return prefix, names, [f"{prefix}.{n}" for n in adapter.after]


def sequence_parallel_plan(model: nn.Module, plan: dict[str, Any], tp: int) -> dict[str, Any]:
    """``plan`` (module name -> style, resolved against ``model``) with sequence parallelism added (module
    docstring); marks the base model with its ``tp`` shards. Raises ``TensorParallelError`` for a model it does
    not apply to."""
    prefix, layers, after = check_sequence_parallel(model)
    out = dict(plan)
    for name, style in plan.items():  # row-parallel outputs reduce-scattered onto the sequence shards
        if any(name.startswith(layer + ".") for layer in layers) and (
                style in ("rowwise", "rowwise_rep") or isinstance(style, RowwiseParallel)):
            out[name] = RowwiseParallel(output_layouts=Shard(1))
    for layer in layers:
        out[f"{layer}.input_layernorm"] = SequenceParallel()
        out[f"{layer}.post_attention_layernorm"] = SequenceParallel()
        out[f"{layer}.self_attn"] = PrepareGatheredInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                         desired_input_kwarg_layouts={"hidden_states": Replicate()})
        out[f"{layer}.mlp"] = PrepareGatheredInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    # the first layer takes its slice of the whole sequence the embedding gave every rank
    out[layers[0]] = _SliceSequence()
    for name in after:
        out[name] = SequenceParallel()
    head = next((n for n in plan if not n.startswith(prefix + ".")), None)
    if head is not None:
        out[head] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    elif isinstance(getattr(model, "lm_head", None), nn.Module):  # a head the plan leaves whole
        out["lm_head"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                            use_local_output=True)
    _base(model)[1].__dict__[SHARDS_ATTR] = tp
    return out


def mark_sequence_mesh(model: nn.Module, mesh: DeviceMesh) -> None:
    """Record the tp mesh the residual stream is split over on the base model (``slice_sequence`` reads it), by a
    weak reference: copies of the model share it rather than copy its process groups."""
    _base(model)[1].__dict__[MESH_ATTR] = weakref.ref(mesh)
