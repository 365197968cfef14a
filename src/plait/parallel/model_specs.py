"""The model specs plait ships, registered, and the lookup the generic code uses (``spec_for``).

Importing this module registers plait's own specs (plait's GPT: ``plait.models.gpt.spec``) before anyone can ask,
and before a user's ``register_train_spec`` (re-exported here, as ``plait.register_train_spec``), which may then
replace one. The registry and ``TrainSpec`` are ``plait.parallel.train_spec``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import nn

from plait.models.gpt import spec as _gpt_spec  # noqa: F401 - registers plait's GPT
from plait.parallel.train_spec import SPECS, TrainSpec, register_train_spec
from plait.plan.shapes import ModelShape, count_params, shape_from_model

__all__ = ["model_shape", "register_train_spec", "spec_for"]


def spec_for(model: nn.Module) -> TrainSpec | None:
    """The spec registered for ``type(model)`` or its nearest registered base class; None if there is none."""
    for cls in type(model).__mro__:
        if cls in SPECS:
            return SPECS[cls]
    return None


def model_shape(model: nn.Module, seq_len: int, cfg: Any = None) -> ModelShape:
    """The planner's shape of a built ``model`` (meta tensors fine) with its exact parameter count: its spec's
    ``shape`` (given ``cfg``, the run's ``Config``, or None), else from its Hugging Face ``config``
    (``plait.plan.shapes.shape_from_model``, which raises ``ConfigError`` naming the fix for a model with neither)."""
    spec = spec_for(model)
    if spec is None or spec.shape is None:
        return shape_from_model(model, seq_len)
    return replace(spec.shape(model, cfg), exact_params=count_params(model))
