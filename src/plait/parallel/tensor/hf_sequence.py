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

Mixture-of-experts blocks (an ``mlp`` that ``plait.parallel.expert.hf`` recognises: Mixtral, Qwen3-MoE...) are not
gathered: each tp rank routes its own sequence shard through the whole block (``LocalTokens``, as Megatron-LM runs
MoE layers under sequence parallelism, and as plait's GPT does): its router and experts are replicated over tp (or
their experts sharded over ``parallel.ep``), their gradients summed over tp where the gradient-sync policy reads them,
and the model's auxiliary balancing loss is taken over the whole sequence (``plait.parallel.expert.apply``).

Models: decoders with a ``base_model_pp_plan`` whose layers hold ``input_layernorm``, ``self_attn`` (called with
``hidden_states=``), ``post_attention_layernorm`` and ``mlp`` (Llama, Mistral, Qwen2, Mixtral, Qwen3-MoE and
relatives); others are refused with a clear error rather than left silently unsplit.

Where attention's q, k and v (the MLP's gate and up) are the only Linears reading the gathered input, and all
column-parallel, they keep its sequence shard for backward instead of the whole sequence and gather it again
there (``plait.parallel.tensor.regather``, as Megatron-LM does): one more all-gather per layer input in backward,
``tp`` times fewer bytes kept. A layer whose input has other readers (an MoE router) keeps it whole.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from plait.parallel.expert.hf import find_moe_blocks
from plait.parallel.pipeline.hf import _base, decoder_pipeline
from plait.parallel.sequence import (  # noqa: F401  (re-exported)
    MESH_ATTR,
    SHARDS_ATTR,
    SLICED_ATTR,
    mark_first_layer_sliced,
    sequence_mesh,
    sequence_shards,
    slice_sequence,
)
from plait.parallel.tensor.local_tokens import LocalTokens
from plait.parallel.tensor.plan import PrepareGatheredInput, TensorParallelError
from plait.parallel.tensor.regather import ColwiseRegather, GatherSequence

LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
READERS = {"attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}
ROWWISE = ("rowwise", "o_proj", "down_proj")


def mark_sliced(model: nn.Module) -> None:
    """Tell the first layer that its input is this rank's slice already (a pipeline's first stage slices the
    embedding's output itself: ``slice_sequence``); no effect on a model without sequence parallelism."""
    found = _base(model)
    adapter = decoder_pipeline(model)
    layers = getattr(found[1], adapter.layers, None) if found and adapter else None
    if found:
        mark_first_layer_sliced(found[1], layers)


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
            f"whose layers hold {', '.join(LAYER_PARTS)} (Llama, Mistral, Qwen2, Mixtral, Qwen3-MoE...); "
            f"{type(model).__name__} is neither: set parallel.sequence_parallel=false")
    prefix = _base(model)[0]
    names = [f"{prefix}.{adapter.layers}.{i}" for i in range(len(layers))]
    return prefix, names, [f"{prefix}.{n}" for n in adapter.after]


def sequence_parallel_plan(model: nn.Module, plan: dict[str, Any], tp: int) -> dict[str, Any]:
    """``plan`` (module name -> style, resolved against ``model``) with sequence parallelism added (module
    docstring); marks the base model with its ``tp`` shards. Raises ``TensorParallelError`` for a model it does
    not apply to."""
    prefix, layers, after = check_sequence_parallel(model)
    moe = {b.name for b in find_moe_blocks(model)}
    out = dict(plan)
    for name, style in plan.items():  # row-parallel outputs reduce-scattered onto the sequence shards
        if any(name.startswith(layer + ".") for layer in layers) and (
                style in ("rowwise", "rowwise_rep") or isinstance(style, RowwiseParallel)):
            out[name] = RowwiseParallel(output_layouts=Shard(1))
    for layer in layers:
        out[f"{layer}.input_layernorm"] = SequenceParallel()
        out[f"{layer}.post_attention_layernorm"] = SequenceParallel()
        attn, mlp = _regathered(model, out, f"{layer}.self_attn"), _regathered(model, out, f"{layer}.mlp")
        out[f"{layer}.self_attn"] = (GatherSequence if attn else PrepareGatheredInput)(
            input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()})
        out[f"{layer}.mlp"] = LocalTokens() if f"{layer}.mlp" in moe else (
            GatherSequence if mlp else PrepareGatheredInput)(input_layouts=(Shard(1),),
                                                             desired_input_layouts=(Replicate(),))
        for name in attn + mlp:
            out[name] = ColwiseRegather()
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


def _regathered(model: nn.Module, plan: dict[str, Any], name: str) -> list[str]:
    """The column-parallel Linears reading the input of the layer's module ``name`` (attention's q, k and v; the
    MLP's gate and up): they keep its shard and gather it again in backward (``plait.parallel.tensor.regather``).
    Empty (the gathered input kept whole, as a DTensor) unless every Linear reading it is a plain column-parallel
    nn.Linear of the plan: other readers (a router, latent attention's down-projections) see no shard."""
    module = model.get_submodule(name)
    readers = READERS["attn" if name.endswith(".self_attn") else "mlp"]
    children = dict(module.named_children())
    found = [f"{name}.{r}" for r in readers if r in children]
    linears = [n for n, m in children.items() if isinstance(m, nn.Linear)]
    others = [n for n in linears if f"{name}.{n}" not in found and n not in ("o_proj", "down_proj")]
    ok = found and not others and all(type(model.get_submodule(f)) is nn.Linear and (
        plan.get(f) == "colwise" or type(plan.get(f)) is ColwiseParallel) for f in found)
    return found if ok else []


def mark_sequence_mesh(model: nn.Module, mesh: DeviceMesh) -> None:
    """Record the tp mesh the residual stream is split over on the base model (``slice_sequence`` reads it), by a
    weak reference: copies of the model share it rather than copy its process groups."""
    _base(model)[1].__dict__[MESH_ATTR] = weakref.ref(mesh)
