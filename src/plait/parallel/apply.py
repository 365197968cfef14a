"""Composition of parallelisms, in one documented order.

Tensor parallel -> activation checkpointing -> compile (``train.compile``) -> pipeline split ->
data/ZeRO/FSDP wrapping, each step returning the model. The result is a ``Layout`` (``layout.py``,
``mp_layout.py``): the one object the engine talks to, whatever the strategy underneath. Which model it
is does not matter here: the tensor-parallel plan, the pipeline adapter and the loss come in a ``ModelSpec``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from plait.comm.collectives import Comm
from plait.config import Config
from plait.parallel.checkpointing import apply_activation_checkpointing
from plait.parallel.data import apply_data_parallel
from plait.parallel.layout import FsdpLayout, Layout, ZeroLayout
from plait.topology import Topology


@dataclass
class ModelSpec:
    """What the layout needs to know about the model beyond its modules.

    ``tp_plan``: a dict of module patterns to styles, or "auto"; ``parallelize_fn(model, tp_mesh)``
    overrides it. ``pp_split``: names of the layers that start stages 2..n; ``stage_fn(model,
    stage_index, num_stages)`` overrides the adapter. ``loss``: a ``plait.train.losses.Loss`` (needed by
    the pipeline's last stage); ``sample``: one micro-batch, to measure layer costs for the split.
    """

    tp_plan: Any = "auto"
    parallelize_fn: Callable[[nn.Module, Any], nn.Module] | None = None
    pp_split: list[str] = field(default_factory=list)
    stage_fn: Callable[[nn.Module, int, int], nn.Module] | None = None
    loss: Any = None
    sample: Any = None


def _tp_function(model: nn.Module, cfg: Config, spec: ModelSpec) -> Callable[[nn.Module, Any], nn.Module]:
    from plait.parallel.plans import plan_for
    from plait.parallel.tensor import resolve_tp

    plan = plan_for(model)
    registered = plan.parallelize if plan is not None else None
    return resolve_tp(model, spec.tp_plan, spec.parallelize_fn,
                      (lambda m, mesh: registered(m, mesh, cfg.parallel)) if registered is not None else None)


def check_model(model: nn.Module, topo: Topology, cfg: Config, spec: ModelSpec) -> None:
    """What can be checked about the model against the layout without communicating: a tensor-parallel
    plan (every pattern matches, kinds and widths and heads divide), a pipeline split (an adapter exists,
    the named split points are layers, every stage gets one). Raises a ``ConfigError`` subclass; every rank
    raises the same one, before any collective."""
    p = cfg.parallel
    if p.tp > 1 and spec.parallelize_fn is None:
        from plait.parallel.tensor import hf_plan, validate_plan

        _tp_function(model, cfg, spec)  # raises when no plan applies
        plan = spec.tp_plan if isinstance(spec.tp_plan, dict) else None
        if plan is None and not _registered(model):
            plan = hf_plan(model)
        if plan:
            validate_plan(model, plan, p.tp)
    if p.pp > 1 and spec.stage_fn is None:
        from plait.parallel.pipeline import NATURAL_VIRTUAL
        from plait.parallel.pipeline_split import PipelineConfigError, pipeline_adapter, split_by_names

        stages = p.pp * (p.pp_virtual_stages or NATURAL_VIRTUAL.get(p.pp_schedule, 1))
        names = pipeline_adapter(model).layer_names(model)
        if len(names) < stages:
            raise PipelineConfigError(f"{stages} pipeline stages but {type(model).__name__} has {len(names)} layers "
                                      f"({names[0]} ... {names[-1]}): every stage needs one; lower parallel.pp")
        if spec.pp_split:
            split_by_names(names, spec.pp_split, stages)


def _registered(model: nn.Module) -> bool:
    from plait.parallel.plans import plan_for

    plan = plan_for(model)
    return plan is not None and plan.parallelize is not None


def apply_parallel(model: nn.Module, topo: Topology, cfg: Config, comm: Comm, spec: ModelSpec) -> Layout:
    """Apply the configured layout to ``model`` in the composition order; returns the engine's Layout.

    Unsupported combinations were rejected by ``plait.validate``. The model's weights are already the
    same on every rank (the engine broadcasts them first).
    """
    p, t = cfg.parallel, cfg.train
    if p.tp > 1:
        model = _tp_function(model, cfg, spec)(model, topo.mesh["tp"])
    experts = None
    if topo.ep > 1:  # this rank's slice of the experts; the layouts below leave them to ExpertParallelLayout
        from plait.parallel.expert import shard_experts

        experts = shard_experts(model, topo.ep, topo.coord("ep"), topo.ep_group, cfg.moe.dispatcher)
    model = apply_activation_checkpointing(model, t.activation_checkpointing, t.checkpoint_every_k)
    if t.compile:
        from plait.parallel.compile import compile_blocks

        compile_blocks(model, backend=cfg.train.compile_backend)
    layout = _layout(model, topo, cfg, comm, spec)
    if experts:
        from plait.parallel.expert import ExpertParallelLayout

        return ExpertParallelLayout(layout, topo, comm)  # type: ignore[return-value]
    return layout


def _layout(model: nn.Module, topo: Topology, cfg: Config, comm: Comm, spec: ModelSpec) -> Layout:
    p = cfg.parallel
    if p.tp > 1 and p.zero == 3:
        from plait.parallel.mp_layout import TensorFsdpLayout

        return TensorFsdpLayout(model, cfg, topo, comm)
    if p.pp > 1:
        from plait.parallel.mp_layout import PipelineLayout

        return PipelineLayout(model, cfg, topo, comm, loss=spec.loss, sample=spec.sample, split=spec.pp_split,
                              stage_fn=spec.stage_fn)
    if p.tp > 1:
        from plait.parallel.mp_layout import TensorLayout

        return TensorLayout(model, cfg, topo, comm)
    if p.zero in (1, 2):
        return ZeroLayout(model, cfg, topo, comm)
    if p.zero == 3:
        return FsdpLayout(model, cfg, topo, comm)
    engine = apply_data_parallel(model, topo.dp_group, topo.dp, p.impl, p.bucket_mb, comm, broadcast=False)
    return Layout(model, cfg, topo, comm, engine)
