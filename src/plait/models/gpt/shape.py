"""plait's GPT for the planner and for MFU: its ``ModelShape`` from a built model and its FLOPs per token."""

from __future__ import annotations

from typing import Any

from plait.models.gpt.model import GPT, MLP
from plait.plan.flops import model_flops
from plait.plan.shapes import ModelShape, gpt_shape, with_moe


def dense(model: GPT) -> bool:
    """Whether every block has the dense MLP (no ``plait.nn.MoE`` feed-forward)."""
    return all(isinstance(b.mlp, MLP) for b in model.blocks)


def shape(model: GPT, cfg: Any = None) -> ModelShape:
    """The GPT's shape from its ``cfg`` (``plait.plan.shapes.gpt_shape``); a GPT with MoE blocks takes its experts
    from the run's ``[moe]`` section, which built them (``with_moe``: the planner's dispatcher and imbalance are the
    config's too), so ``cfg``, the run's ``Config``, must be given for one."""
    m = model.cfg
    shape = gpt_shape(m.n_layer, m.d_model, m.n_head, m.seq_len, m.vocab_size, m.dropout)
    if dense(model):
        return shape
    if cfg is None:
        raise ValueError("the shape of plait's GPT with MoE blocks needs the run's Config (its [moe] section)")
    return with_moe(shape, cfg)


def flops_per_token(model: GPT) -> float | None:
    """PaLM's ``6 N_mm + 12 L d T`` per token (``plait.plan.flops.model_flops``) for the dense GPT; None when a
    block has an MoE feed-forward (its active FLOPs are counted instead, ``plait.train.mfu``)."""
    return model_flops(shape(model), 1.0) if dense(model) else None
