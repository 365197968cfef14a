"""Composition of parallelisms, in one documented order.

Tensor parallel -> experts sharded over ep -> activation checkpointing -> compile (``train.compile``) ->
the strategy's own wrapping (pipeline split, data/ZeRO/FSDP) -> wrappers (expert parallelism), each step
returning the model. ``compose_model`` does the steps before the strategy (``Strategy.apply`` calls it);
``plait.parallel.registry.build_strategy`` adds the wrappers. Which model it is does not matter here: the
tensor-parallel plan, the pipeline adapter and the loss come in a ``ModelSpec``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from plait.config import ParallelConfig, TrainConfig
from plait.nn.moe import moe_layers
from plait.parallel.checkpointing import apply_activation_checkpointing
from plait.parallel.compile import compile_blocks
from plait.parallel.expert.dispatch import shard_experts
from plait.parallel.expert.hf import check_hf_experts, check_pipeline_router_loss, shard_hf_experts
from plait.parallel.offload import offload_activations
from plait.parallel.pipeline.split import pipeline_adapter, stage_layer_ranges
from plait.parallel.plans import plan_for
from plait.parallel.tensor.hf import hf_tp_function
from plait.parallel.tensor.plan import hf_plan, resolve_tp, retie, tied_names, validate_plan
from plait.plan.schedule import NATURAL_VIRTUAL
from plait.topology import Topology


@dataclass
class ModelSpec:
    """What the layout needs to know about the model beyond its modules.

    ``tp_plan``: a dict of module patterns to styles, or "auto"; ``parallelize_fn(model, tp_mesh)``
    overrides it. ``pp_split``: names of the layers that start stages 2..n; ``stage_fn(model,
    stage_index, num_stages)`` overrides the adapter. ``loss``: a ``plait.components.losses.Loss`` (needed by
    the pipeline's last stage); ``sample``: one micro-batch, to measure layer costs for the split.
    """

    tp_plan: Any = "auto"
    parallelize_fn: Callable[[nn.Module, Any], nn.Module] | None = None
    pp_split: list[str] = field(default_factory=list)
    stage_fn: Callable[[nn.Module, int, int], nn.Module] | None = None
    loss: Any = None
    sample: Any = None
    compile: Any = None  # a plait.parallel.compile.CompilePlan (None: train.compile's blocks, as before one existed)


def _tp_function(model: nn.Module, p: ParallelConfig, spec: ModelSpec) -> Callable[[nn.Module, Any], nn.Module]:
    plan = plan_for(model)
    registered = plan.parallelize if plan is not None else None
    if spec.parallelize_fn is None and registered is None:  # a Hugging Face plan, as transformers means it
        hf = hf_tp_function(model, spec.tp_plan, p.ep > 1, p.sequence_parallel)
        if hf is not None:
            return hf
    return resolve_tp(model, spec.tp_plan, spec.parallelize_fn,
                      (lambda m, mesh: registered(m, mesh, p)) if registered is not None else None)


def check_model(model: nn.Module, topo: Topology, p: ParallelConfig, spec: ModelSpec) -> None:
    """What can be checked about the model against the layout without communicating: a tensor-parallel
    plan (every pattern matches, kinds and widths and heads divide), a pipeline split (an adapter exists,
    the named split points are layers, every stage gets one). Raises a ``ConfigError`` subclass; every rank
    raises the same one, before any collective."""
    tp, pp = topo.degree("tp"), topo.degree("pp")
    if topo.ep > 1 and not moe_layers(model):  # a Hugging Face MoE model: its blocks recognised, or an error
        check_hf_experts(model, topo.ep, p)
    if tp > 1 and spec.parallelize_fn is None:
        fn = _tp_function(model, p, spec)  # raises when no plan applies
        plan = spec.tp_plan if isinstance(spec.tp_plan, dict) else None
        if hasattr(fn, "check"):
            fn.check(model, tp)
        else:
            if plan is None and not _registered(model):
                plan = hf_plan(model)
            if plan:
                validate_plan(model, plan, tp)
    if pp > 1:
        check_pipeline_router_loss(model)
    if pp > 1 and spec.stage_fn is None:
        stages = pp * (p.pp_virtual_stages or NATURAL_VIRTUAL.get(p.pp_schedule, 1))
        stage_layer_ranges(model, pipeline_adapter(model), stages, spec.pp_split, None,
                           embedding_unit=p.pp_split_embedding, head_unit=p.pp_split_head)


def _registered(model: nn.Module) -> bool:
    plan = plan_for(model)
    return plan is not None and plan.parallelize is not None


def compose_model(model: nn.Module, topo: Topology, p: ParallelConfig, t: TrainConfig, dispatcher: str,
                  spec: ModelSpec) -> nn.Module:
    """The model after the composition steps that precede a strategy's own wrapping, in order: tensor
    parallel (``spec``'s plan), this rank's slice of the experts (dispatched by ``moe.dispatcher``),
    activation checkpointing (and activation offload), compile (of the blocks; a whole-model plan is applied
    by the strategy's ``wrap_forward``, around the forward routing).

    Unsupported combinations were rejected by ``plait.validate``. The model's weights are already the
    same on every rank (the strategy broadcasts them first)."""
    if topo.degree("tp") > 1:
        tied = tied_names(model)
        model = _tp_function(model, p, spec)(model, topo.mesh["tp"])
        retie(model, tied)  # whatever sharded it (a user's parallelize_fn too), a tied weight stays one tensor
    if topo.ep > 1:  # this rank's slice of the experts; the expert-parallel wrapper reduces their gradients
        shard = shard_experts if moe_layers(model) else shard_hf_experts  # plait's MoE, or Hugging Face blocks
        shard(model, topo.ep, topo.coord("ep"), topo.ep_group, dispatcher)
    model = apply_activation_checkpointing(model, t.activation_checkpointing, t.checkpoint_every_k,
                                           t.checkpoint_save_ops)
    if t.activation_offload:
        offload_activations(model)
    plan = spec.compile
    if plan and plan.unit == "blocks":  # the whole model is compiled later, around its forward routing
        compile_blocks(model, plan.compiler)
    elif plan is None and t.compile:
        compile_blocks(model, backend=t.compile_backend)
    return model
