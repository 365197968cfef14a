"""Composition of parallelisms, in one documented order.

Tensor parallel -> activation checkpointing -> pipeline split -> data/ZeRO/FSDP wrapping, each step
returning the model. The result is a ``Layout`` (``layout.py``, ``mp_layout.py``): the one object the
engine talks to, whatever the strategy underneath. Which model it is does not matter here: the
tensor-parallel plan, the pipeline adapter and the loss come in a ``ModelSpec``.
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


def apply_parallel(model: nn.Module, topo: Topology, cfg: Config, comm: Comm, spec: ModelSpec) -> Layout:
    """Apply the configured layout to ``model`` in the composition order; returns the engine's Layout.

    Unsupported combinations were rejected by ``plait.validate``. The model's weights are already the
    same on every rank (the engine broadcasts them first).
    """
    from plait.parallel.plans import plan_for

    p, t = cfg.parallel, cfg.train
    if p.tp > 1:
        from plait.parallel.tensor import resolve_tp

        plan = plan_for(model)
        registered = plan.parallelize if plan is not None else None
        shard = resolve_tp(model, spec.tp_plan, spec.parallelize_fn,
                           (lambda m, mesh: registered(m, mesh, p)) if registered is not None else None)
        model = shard(model, topo.mesh["tp"])
    model = apply_activation_checkpointing(model, t.activation_checkpointing, t.checkpoint_every_k)
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
