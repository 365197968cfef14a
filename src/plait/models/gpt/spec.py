"""plait's GPT registered once: the ``TrainSpec`` gathering what this folder knows about it (``plait.parallel``
imports this module, so the spec is registered before any layout asks ``spec_for``)."""

from __future__ import annotations

from plait.models.gpt import context, parallelize, shape
from plait.models.gpt.model import GPT
from plait.models.gpt.pipeline import GPTPipeline
from plait.parallel.train_spec import ContextRouting, TrainSpec, register_train_spec

GPT_SPEC = TrainSpec(
    parallelize=parallelize.parallelize,
    pipeline=GPTPipeline(),
    context=ContextRouting(context.route, inputs="idx", targets="targets", row_positions=True),
    shape=shape.shape,
    flops=shape.flops_per_token,
)

register_train_spec(GPT, GPT_SPEC)
