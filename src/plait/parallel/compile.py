"""``train.compile``: ``torch.compile`` of the model's blocks and of the loss, composed with the layouts.

Each repeated block (``plait.parallel.units.find_blocks``: plait's GPT's ``blocks``, a Hugging Face
model's decoder layers) is compiled in place with ``nn.Module.compile`` (a model without repeated
blocks is compiled whole), as torchtitan does: the blocks share one traced graph (parameters are graph
inputs), parameter names and ``state_dict`` keys do not change, and what runs between blocks (the
layout's hooks) stays eager. The loss's ``output, target -> scalar`` function is compiled too (the
cross-entropy over the ``(B, T, V)`` logits is one fused kernel instead of several passes over them).

Composition order: tensor parallel -> activation checkpointing -> **compile** -> pipeline split ->
data/ZeRO/FSDP wrapping (``plait.parallel.apply``). So the compiled blocks are what checkpointing
recomputes (dynamo traces ``torch.utils.checkpoint``), and every parallelism then acts on compiled
blocks: plait's reducer and ZeRO register gradient hooks on the parameters (AOTAutograd's backward
accumulates into ``.grad`` as eager does, so the hooks fire per parameter as without compile); DDP wraps
the model around them; FSDP2's ``fully_shard`` of a compiled block is torchtitan's composition; DTensor
(tensor parallelism) is traced by dynamo; the pipeline's stages hold the compiled blocks.

Not supported (``check_compile``: a clear error before anything runs): expert parallelism (the MoE
all-to-all dispatch has data-dependent shapes: every step would recompile), and tensor parallelism with
``loss_parallel`` (the loss over vocabulary-sharded logits runs under ``loss_parallel()``, a context
dynamo does not trace); set ``parallel.loss_parallel=false`` to compile with tensor parallelism.

On CPU the inductor backend generates C++ (a compiler, ``g++``, must be installed); on CUDA Triton
kernels. The first steps pay the compilation (seconds to minutes), cached on disk by inductor for the
next run.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.config import Config, ConfigError
from plait.parallel.units import find_blocks


class CompileError(ConfigError):
    """``train.compile`` with a layout it cannot compose with; the message says what to change."""


def check_compile(cfg: Config) -> None:
    """Raise ``CompileError`` for the combinations in the module docstring (before any process group)."""
    if not cfg.train.compile:
        return
    p = cfg.parallel
    if getattr(p, "ep", 1) > 1:
        raise CompileError("train.compile=true does not compose with expert parallelism (parallel.ep > 1): the "
                           "all-to-all dispatch has data-dependent shapes, so every step would recompile; set "
                           "train.compile=false or parallel.ep=1")
    if p.tp > 1 and p.loss_parallel:
        raise CompileError("train.compile=true with tensor parallelism needs parallel.loss_parallel=false: the "
                           "vocabulary-parallel loss runs under torch's loss_parallel() context, which "
                           "torch.compile does not trace")


def compile_blocks(model: nn.Module, **options: Any) -> list[str]:
    """Compile ``model``'s blocks in place (the whole model when it has none); returns what was compiled."""
    blocks = find_blocks(model)
    if not blocks:
        model.compile(**options)
        return [""]
    for _, block in blocks:
        block.compile(**options)
    return [name for name, _ in blocks]


def compile_loss(loss: Any, **options: Any) -> Any:
    """Compile ``loss.loss`` (output, target -> scalar) in place on this ``plait.losses.Loss`` instance;
    a no-op for a loss already compiled. Returns the loss."""
    if loss is not None and not getattr(loss, "_plait_compiled", False):
        loss.loss = torch.compile(loss.loss, **options)
        loss._plait_compiled = True
    return loss
