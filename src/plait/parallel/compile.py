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
tests/parallel/test_compile.py checks each against eager single-process training.

The loss stays eager under tensor parallelism with ``parallel.loss_parallel`` (the default): that loss
runs over vocabulary-sharded DTensor logits inside torch's ``loss_parallel()`` context, a global state
dynamo's guards do not see. Compiled, it was right in a fresh process but reused a graph traced for
plain logits after another layout had compiled the loss in the same process (step-1 loss 4.92 against
5.54), so it is not compiled there.

Expert parallelism compiles: the MoE layer and its all-to-all dispatch have static shapes and no host read
(``plait.parallel.expert.dispatch``), so each compiled block is one graph that is not recompiled as the routing
changes. Refused (``check_compile``: a clear error before anything runs): the dispatchers that read the host,
``moe.dispatcher=alltoall_split`` (variable splits) and ``allgather`` (the reference path).

The torch-collective counter (``observe.count_torch_collectives``) is a dispatch mode that lets dynamo
trace (``ignore_compile_internals``); collectives traced into a compiled block (tensor parallelism's)
are then not counted in ``comm_bytes``.

On CPU the inductor backend generates C++ (a compiler, ``g++``, must be installed); on CUDA Triton
kernels. The first steps pay the compilation (seconds to minutes), cached on disk by inductor for the
next run.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.config import ConfigError, ParallelConfig
from plait.parallel.units import find_blocks


class CompileError(ConfigError):
    """``train.compile`` with a layout it cannot compose with; the message says what to change."""


def check_compile(compile_: bool | str, ep: int, dispatcher: str = "alltoall") -> None:
    """Raise ``CompileError`` for the combinations in the module docstring (before any process group):
    ``train.compile`` with expert parallelism of degree ``ep`` dispatched by a path that reads the host."""
    if compile_ not in (False, None, "false") and ep > 1 and dispatcher != "alltoall":
        raise CompileError(f"train.compile is refused with moe.dispatcher={dispatcher} (it reads the assignment "
                           "counts on the host, so torch.compile would break the graph there); use "
                           "moe.dispatcher=alltoall (the default: static shapes), or set train.compile=false")


def compile_blocks(model: nn.Module, **options: Any) -> list[str]:
    """Compile ``model``'s blocks in place (the whole model when it has none); returns what was compiled."""
    blocks = find_blocks(model)
    if not blocks:
        model.compile(**options)
        return [""]
    for _, block in blocks:
        block.compile(**options)
    return [name for name, _ in blocks]


def compile_loss(loss: Any, p: ParallelConfig, **options: Any) -> Any:
    """Compile ``loss.loss`` (output, target -> scalar) in place on this ``plait.losses.Loss`` instance,
    unless the layout keeps it eager (tensor parallelism with ``loss_parallel``, see the module docstring);
    a no-op for a loss already compiled. Returns the loss."""
    if p.tp > 1 and p.loss_parallel:
        return loss
    if loss is not None and not getattr(loss, "_plait_compiled", False):
        loss.loss = torch.compile(loss.loss, **options)
        loss._plait_compiled = True
    return loss
