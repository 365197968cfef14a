"""Tiny GPTs and fixed token batches: what tests, benchmarks and calibration build when they need a small
model and the same data on every rank.

``tiny_config`` is a few-thousand-parameter GPT shape (no dropout); ``seeded_gpt`` builds a GPT from the
global seed, so every rank and every reference starts from the same weights; ``token_batches`` draws
(input, target) token batches from a private generator, the same on every rank and call;
``model_flags`` writes a shape as the ``--model.*`` overrides ``plait train`` takes.
"""

from __future__ import annotations

import dataclasses

import torch

from plait.config import ModelConfig, MoeConfig
from plait.models.gpt import GPT

SHAPE = ("n_layer", "d_model", "n_head", "seq_len", "vocab_size")


def tiny_config(n_layer: int = 2, d_model: int = 32, n_head: int = 2, seq_len: int = 16,
                vocab_size: int = 256) -> ModelConfig:
    """A tiny GPT shape without dropout (deterministic forward passes)."""
    return ModelConfig(n_layer=n_layer, d_model=d_model, n_head=n_head, seq_len=seq_len, vocab_size=vocab_size,
                       dropout=0.0)


def seeded_gpt(cfg: ModelConfig, seed: int = 0, moe: MoeConfig | None = None) -> GPT:
    """``GPT(cfg, moe)`` initialised right after ``torch.manual_seed(seed)``: the same weights every time."""
    torch.manual_seed(seed)
    return GPT(cfg, moe)


def token_batches(count: int, batch_size: int, seq_len: int = 16, vocab_size: int = 256, seed: int = 1,
                  shifted: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` (input, target) pairs of shape (B, T) from a generator seeded with ``seed``. Targets are
    drawn independently of the inputs, or, ``shifted``, are the inputs moved one token on (language
    modelling windows cut from ``seq_len + 1`` tokens)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        if shifted:
            x = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=g)
            out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
        else:
            out.append((torch.randint(0, vocab_size, (batch_size, seq_len), generator=g),
                        torch.randint(0, vocab_size, (batch_size, seq_len), generator=g)))
    return out


def model_flags(cfg: ModelConfig) -> list[str]:
    """The shape of ``cfg`` as command-line overrides: ``--model.n_layer=2`` and so on."""
    values = dataclasses.asdict(cfg)
    return [f"--model.{k}={values[k]}" for k in SHAPE]
