"""Per-model-class parallelization hooks: what plait cannot discover from a model by itself.

A model class can register a tensor-parallel function (``parallelize(model, tp_mesh, parallel_cfg)``,
used for ``parallel.tp_plan = "auto"``) and a pipeline adapter (how to cut it into stages). plait's
GPT has both (``plait.parallel.tensor.gpt`` and ``plait.parallel.pipeline.gpt``, registered here); a user
registers their own classes the same way, or passes ``tp_plan`` / ``parallelize_fn`` / ``stage_fn`` to
``Plait.setup`` instead. Models registered nowhere fall back to what plait finds on them: a Hugging Face
model's shipped tensor-parallel plan and pipeline plan, an ``nn.Sequential``'s children.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from plait.models.gpt import GPT
from plait.parallel.pipeline.gpt import GPTPipeline
from plait.parallel.tensor.gpt import parallelize


@dataclass
class ModelPlan:
    """Hooks for one model class; each may be None."""

    parallelize: Callable[[nn.Module, Any, Any], nn.Module] | None = None
    pipeline: Any = None  # a plait.parallel.pipeline.runner.PipelineAdapter


_PLANS: dict[type, ModelPlan] = {}


def register_plan(cls: type, *, parallelize: Callable[[nn.Module, Any, Any], nn.Module] | None = None,
                  pipeline: Any = None) -> None:
    """Register hooks for ``cls`` and its subclasses (later registrations replace earlier ones)."""
    _PLANS[cls] = ModelPlan(parallelize=parallelize, pipeline=pipeline)


def plan_for(model: nn.Module) -> ModelPlan | None:
    """The hooks registered for ``type(model)`` or its nearest registered base class."""
    for cls in type(model).__mro__:
        if cls in _PLANS:
            return _PLANS[cls]
    return None


register_plan(GPT, parallelize=parallelize, pipeline=GPTPipeline())
