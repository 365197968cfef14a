"""What the layout needs to know about a model beyond its modules (``ModelSpec``: its tensor-parallel plan, its
pipeline split, the loss, a sample micro-batch, the compile plan)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn


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
