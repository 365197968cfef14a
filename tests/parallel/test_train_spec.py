"""The model-spec registry (``plait.parallel.train_spec``, ``model_specs``): plait's GPT is registered once with its
folder's knowledge, a class's subclasses find its spec, a user's registration replaces it, and what is not a spec
or not a module is refused. One process, no collectives."""

from __future__ import annotations

from dataclasses import replace

import pytest
from torch import nn

import plait
from plait.config import ConfigError, ModelConfig, MoeConfig
from plait.models.gpt import GPT
from plait.parallel.model_specs import model_shape, spec_for
from plait.parallel.train_spec import SPECS
from plait.plan.shapes import count_params, gpt_shape

CFG = ModelConfig(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=64)


def test_gpt_is_registered_with_its_folders_knowledge() -> None:
    from plait.models.gpt import context, parallelize, pipeline, shape

    spec = spec_for(GPT(CFG))
    assert spec.parallelize is parallelize.parallelize and isinstance(spec.pipeline, pipeline.GPTPipeline)
    assert spec.context.route is context.route and spec.context.inputs == "idx" and spec.context.row_positions
    assert spec.shape is shape.shape and spec.flops is shape.flops_per_token
    assert [cls for cls in SPECS if issubclass(GPT, cls)] == [GPT]  # registered once


def test_gpt_shape_and_flops() -> None:
    model = GPT(CFG)
    got = model_shape(model, 16)
    assert got.exact_params == count_params(model) == got.formula_params()  # the formula counts the model
    assert got == replace(gpt_shape(2, 32, 2, 16, 64), exact_params=count_params(model))
    n_mm = 2 * 12 * 32 * 32 + 64 * 32  # the blocks' matmul weights and the tied head
    assert spec_for(model).flops(model) == pytest.approx(6 * n_mm + 12 * 2 * 32 * 16)
    moe = GPT(CFG, MoeConfig(num_experts=4))
    assert spec_for(moe).flops(moe) is None  # no formula for the MoE GPT: MFU counts its FLOPs instead


def test_subclass_finds_its_base_spec_and_a_user_registration_replaces_it() -> None:
    class MyGPT(GPT):
        pass

    class Other(nn.Module):
        pass

    assert spec_for(MyGPT(CFG)) is spec_for(GPT(CFG)) and spec_for(Other()) is None
    mine = plait.TrainSpec(flops=lambda model: 1.0)
    plait.register_train_spec(MyGPT, mine)
    try:
        assert spec_for(MyGPT(CFG)) is mine and spec_for(GPT(CFG)) is not mine
    finally:
        del SPECS[MyGPT]


def test_refused() -> None:
    with pytest.raises(TypeError, match="takes an nn.Module subclass"):
        plait.register_train_spec(int, plait.TrainSpec())
    with pytest.raises(TypeError, match=r"takes a plait.TrainSpec; got dict"):
        plait.register_train_spec(nn.Linear, {"parallelize": None})
    with pytest.raises(ConfigError, match="registered spec"):  # no spec, no Hugging Face config: no shape
        model_shape(nn.Linear(2, 2), 16)
