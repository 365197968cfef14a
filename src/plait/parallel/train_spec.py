"""What plait knows about a model class, in one object registered once (``TrainSpec``, after torchtitan's).

plait discovers most of what a layout needs from the model itself (its repeated blocks, a Hugging Face model's
shipped tensor-parallel and pipeline plans, its attention layers). What it cannot discover is a model class's own
knowledge: its tensor-parallel plan, how it is cut into pipeline stages, how its attention layers are routed
through the context-parallel attention, its shape for the planner and its FLOPs per token for MFU. A model keeps
that knowledge in its own folder (plait's GPT: ``plait.models.gpt``, its ``spec`` module) and registers one
``TrainSpec`` for its class with ``register_train_spec``; the generic code (``tensor.apply``, ``pipeline.split``,
``context``, the planner's ``record``, ``plait.train.mfu``) asks ``plait.parallel.model_specs.spec_for(model)``.

A model registered nowhere keeps plait's discovery: a Hugging Face model's shipped tensor-parallel plan, its
pipeline plan and its attention layers (``context.attention.route_hf``), an ``nn.Sequential``'s children, its
shape from its ``config``. A user registers their own class the same way (a spec with only the fields it
knows), or passes ``tp_plan`` / ``parallelize_fn`` / ``stage_fn`` to ``Plait.setup`` for one run.

This module imports no model; ``plait.parallel.model_specs`` imports plait's own specs (each imports this module to
register itself) and holds the lookup, so whoever asks has them registered, and there is no circle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from plait.plan.shapes import ModelShape


@dataclass(frozen=True)
class ContextRouting:
    """How context parallelism (``parallel.cp > 1``) runs a model class.

    ``route(module, attention)``: make the attention layers inside ``module`` attend through ``attention`` (a
    ``plait.parallel.context.attention.ContextAttention``), and the class's pipeline stages inside it take their
    shard's positions from ``attention.positions``; returns how many layers and stages it routed (0: none there),
    raises ``ContextError`` naming the fix for a layer it cannot route. It is called on the whole model, and under
    a pipeline again on the stages after the split. ``inputs`` / ``targets``: the names of the forward's token ids
    (B, T) and next-token targets (B, T) (given targets, the forward returns the mean cross-entropy over them);
    ``row_positions``: the forward's ``position_ids`` are one (S,) row shared by the batch rather than (B, S)."""

    route: Callable[[nn.Module, Any], int]
    inputs: str
    targets: str
    row_positions: bool = False


@dataclass(frozen=True)
class TrainSpec:
    """A model class's knowledge (see the module docstring); a field left None falls back to plait's discovery.

    ``parallelize(model, tp_mesh, parallel_cfg) -> model``: its tensor-parallel plan, used for
    ``parallel.tp_plan = "auto"``. ``pipeline``: its pipeline adapter (``plait.parallel.pipeline.runner``'s
    ``PipelineAdapter``: ``layer_names``, ``build_stage``, optionally ``head_name``). ``context``: its
    ``ContextRouting``. ``shape(model, cfg) -> ModelShape``: its shape for the planner and the memory model from a
    built model (meta tensors fine; ``cfg`` the run's ``Config`` or None). ``flops(model) -> float | None``: its
    model FLOPs per token of forward and backward for MFU, None where no formula applies (then MFU counts them)."""

    parallelize: Callable[[nn.Module, Any, Any], nn.Module] | None = None
    pipeline: Any = None
    context: ContextRouting | None = None
    shape: Callable[[nn.Module, Any], ModelShape] | None = None
    flops: Callable[[nn.Module], float | None] | None = None


SPECS: dict[type, TrainSpec] = {}  # read through ``plait.parallel.model_specs.spec_for``


def register_train_spec(cls: type, spec: TrainSpec) -> None:
    """Register ``spec`` for ``cls`` and its subclasses; a later registration for the same class replaces it."""
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise TypeError(f"register_train_spec takes an nn.Module subclass and a TrainSpec; got {cls!r}")
    if not isinstance(spec, TrainSpec):
        raise TypeError(f"register_train_spec({cls.__name__}, ...) takes a plait.TrainSpec; got "
                        f"{type(spec).__name__}")
    SPECS[cls] = spec
