"""``train.compile``: ``torch.compile`` of the model (and the loss), composed with the layouts.

Two units (``train.compile = "auto" | "model" | "blocks" | false``; true is "auto"):

* **model**: the whole model in one compiled region, and under ``forward_backward`` (the Trainer's step) the
  model *and* the loss in one (``fused_loss``): no graph break between the blocks, nor between the last block and
  the cross-entropy over its ``(B, T, V)`` logits. ``model._compiled_call_impl`` is the compiled ``_call_impl``
  (``nn.Module.compile``'s slot), so ``model(...)`` runs it; the layout's forward routing (autocast, DDP) is
  traced inside it, and what must stay eager (plait's random stream, ``plait.components.rng``) runs around it.
  plait's reducer and ZeRO hook the parameters' gradients (AOTAutograd's backward accumulates into ``.grad`` as
  eager does, so the hooks fire; the buckets are reduced when the compiled backward has produced them: after
  backward, not overlapped with it, the price of one region, which "blocks" does not pay); DDP is traced by
  dynamo's DDP support.
* **blocks**: each repeated block (``plait.parallel.units.find_blocks``: plait's GPT's ``blocks``, a Hugging Face
  model's decoder layers) compiled in place (the blocks share one traced graph; parameter names and
  ``state_dict`` keys do not change; a model without repeated blocks is compiled whole), and the loss's
  ``output, target -> scalar`` function on its own. This is what FSDP2 (each block its own unit, parameters
  gathered around the block), activation checkpointing (which recomputes each block: dynamo traces
  ``torch.utils.checkpoint``), tensor parallelism (DTensor blocks) and pipeline parallelism (stages hold blocks)
  need: composition order tensor parallel -> activation checkpointing -> **compile** -> pipeline split ->
  data/ZeRO/FSDP wrapping (``plait.parallel.compose``).

"auto" picks "model" wherever the layout allows (``plait.parallel.compose.compile_blocks_because`` is empty:
activation checkpointing off, one rank, plait's reducer, DDP, ZeRO-1/2, context parallelism, a parameter server's
worker), else "blocks"; the choice and its reason are logged at ``setup``. "model" where the layout needs blocks is
refused before any process starts. tests/parallel/test_compile.py checks each layout against eager single-process
training.

A model the user compiled (``torch.compile(model, backend=..., mode=..., options=...)``) is unwrapped (no
``_orig_mod.`` prefix) and compiled again with the user's own dynamo context, so backend, mode and options stay the
user's (``backend="aot_eager"`` needs no C++ compiler), at the unit the layout allows. ``train.compile_backend`` and
``train.compile_mode`` (``max-autotune-no-cudagraphs``; ``reduce-overhead`` for CUDA graphs where shapes are
static) set plait's own compilation.

The loss stays eager under tensor parallelism with ``parallel.loss_parallel`` (the default): that loss runs over
vocabulary-sharded DTensor logits inside torch's ``loss_parallel()`` context, a global state dynamo's guards do
not see. Compiled, it was right in a fresh process but reused a graph traced for plain logits after another
layout had compiled the loss in the same process (step-1 loss 4.92 against 5.54), so it is not compiled there.

Expert parallelism compiles: the MoE layer and its all-to-all dispatch have static shapes and no host read
(``plait.parallel.expert.dispatch``), so each compiled block is one graph that is not recompiled as the routing
changes. Refused (``check_compile``: a clear error before anything runs): the dispatchers that read the host,
``moe.dispatcher=alltoall_split`` (variable splits) and ``allgather`` (the reference path).

Context parallelism compiles at either unit (it needs no blocks): dynamo traces the cut of each micro-batch and the
``alltoall`` and ``allgather`` attention (their c10d collectives rewritten into functional ones, forward and
backward: no graph break), while the ring attention's point-to-point transfers are not traceable and run eagerly
between the graphs (``torch.compiler.disable``: one graph break per attention layer). Measured with
``backend="aot_eager"`` on plait's 2-block GPT: ``alltoall`` one graph for the whole model and its loss, ``ring``
5 graphs by blocks (9 when dynamo broke inside the ring on its own); tests/parallel/context/test_context_compile.py.

The torch-collective counter (``observe.count_torch_collectives``) is a dispatch mode that lets dynamo
trace (``ignore_compile_internals``); collectives traced into a compiled region (tensor parallelism's, context
parallelism's all-to-all and all-gather) are then not counted in ``comm_bytes``.

On CPU the inductor backend generates C++ (a compiler, ``g++``, must be installed); on CUDA Triton
kernels. The first steps pay the compilation (seconds to minutes), cached on disk by inductor for the
next run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.config import Config, ConfigError, ParallelConfig, TrainConfig
from plait.parallel.units import find_blocks

Compiler = Callable[[Callable[..., Any]], Callable[..., Any]]


class CompileError(ConfigError):
    """``train.compile`` with a layout it cannot compose with; the message says what to change."""


def check_compile(compile_: Any, ep: int, dispatcher: str = "alltoall") -> None:
    """Raise ``CompileError`` for the combinations in the module docstring (before any process group):
    ``train.compile`` with expert parallelism of degree ``ep`` dispatched by a path that reads the host."""
    if compile_ and ep > 1 and dispatcher != "alltoall":
        raise CompileError(f"train.compile={compile_} is refused with moe.dispatcher={dispatcher} (it reads the "
                           "assignment counts on the host, so torch.compile would break the graph there); use "
                           "moe.dispatcher=alltoall (the default: static shapes), or set train.compile=false")


@dataclass
class CompilePlan:
    """How ``setup`` compiles: ``unit`` "model" or "blocks", with ``compiler`` (a function to its compiled
    version: ``torch.compile`` with plait's options, or the user's own dynamo context); ``why`` for the log."""

    unit: str
    compiler: Compiler
    why: str


def compile_unit(cfg: Config, blocks: str, asked: Any = None) -> tuple[str | None, str]:
    """(unit, reason): what ``asked`` (default ``train.compile``) means for this layout, which compiles block by block
    because of ``blocks`` (``plait.parallel.compose.compile_blocks_because``; empty: the whole model may be one
    region); ``CompileError`` for "model" where the layout needs blocks."""
    asked = cfg.train.compile if asked is None else asked
    if asked is False:
        return None, ""
    if asked in (True, "auto"):
        if blocks:
            return "blocks", f"auto: {blocks}"
        return "model", "auto: the layout keeps the model whole on each rank"
    if asked == "model" and blocks:
        raise CompileError(f"train.compile=model compiles the whole model in one region, but {blocks}: set "
                           "train.compile=blocks (or auto, which picks blocks here)")
    return asked, "asked"


def plait_compiler(t: TrainConfig) -> Compiler:
    """``torch.compile`` with ``train.compile_backend`` and ``train.compile_mode``."""
    mode = None if t.compile_mode == "default" else t.compile_mode
    return functools.partial(torch.compile, backend=t.compile_backend, mode=mode)


def compile_plan(cfg: Config, blocks: str, user_ctx: Any = None) -> CompilePlan | None:
    """The compilation ``setup`` applies: ``train.compile``'s, or, for a model the user compiled (``user_ctx``:
    its dynamo context), the user's own backend, mode and options at the unit the layout allows (None: eager)."""
    if user_ctx is not None:
        unit, why = compile_unit(cfg, blocks, "auto")
        return CompilePlan(unit, user_ctx, f"the model came compiled: the user's torch.compile options, {why}")
    unit, why = compile_unit(cfg, blocks)
    if unit is None:
        return None
    return CompilePlan(unit, plait_compiler(cfg.train), f"train.compile={cfg.train.compile}: {why}")


def compile_blocks(model: nn.Module, compiler: Compiler | None = None, **options: Any) -> list[str]:
    """Compile ``model``'s blocks in place (the whole model when it has none) with ``compiler`` (default:
    ``torch.compile(**options)``); returns what was compiled."""
    compiler = compiler if compiler is not None else functools.partial(torch.compile, **options)
    blocks = find_blocks(model) or [("", model)]
    for _, block in blocks:
        block._compiled_call_impl = compiler(block._call_impl)  # nn.Module.compile's slot, the user's options
    return [name for name, _ in blocks]


def compile_model(model: nn.Module, compiler: Compiler) -> None:
    """The whole model as one compiled region: ``model(...)`` runs the compiled ``_call_impl`` (its forward
    routing, autocast and the layout's wrapper, traced inside)."""
    model._compiled_call_impl = compiler(model._call_impl)


def fused_loss(model: nn.Module, loss: Any, compiler: Compiler) -> Callable[[Any], torch.Tensor]:
    """``batch -> loss`` with the model's forward and ``loss.loss`` in one compiled region (the batch is split
    eagerly by ``loss.split``); for a ``plait.losses.Loss`` that computes ``loss(model(*args, **kwargs), target)``."""
    region = compiler(lambda args, kwargs, target: loss.loss(model._call_impl(*args, **kwargs), target))

    def run(batch: Any) -> torch.Tensor:
        args, kwargs, target = loss.split(batch)
        return region(args, kwargs, target)

    loss._plait_compiled = True  # compiled, with the model
    return run


def fusable(loss: Any) -> bool:
    """Whether ``loss`` computes ``loss.loss(model(*args, **kwargs), target)`` over its ``split`` (a
    ``plait.losses.Loss`` whose ``__call__`` is the base class's), so it can join the model's region."""
    from plait.components.losses import Loss

    return isinstance(loss, Loss) and type(loss).__call__ is Loss.__call__


def compile_loss(loss: Any, p: ParallelConfig, compiler: Compiler | None = None, **options: Any) -> Any:
    """Compile ``loss.loss`` (output, target -> scalar) in place on this ``plait.losses.Loss`` instance,
    unless the layout keeps it eager (tensor parallelism with ``loss_parallel``, see the module docstring);
    a no-op for a loss already compiled. Returns the loss."""
    if p.tp > 1 and p.loss_parallel:
        return loss
    if loss is not None and not getattr(loss, "_plait_compiled", False):
        loss.loss = (compiler if compiler is not None else functools.partial(torch.compile, **options))(loss.loss)
        loss._plait_compiled = True
    return loss


def apply_compile(model: nn.Module, t: TrainConfig, plan: CompilePlan | None | bool) -> nn.Module:
    """The composition's compile step: the blocks compiled in place (a whole-model plan is applied by the layout's
    ``wrap_forward``, around the forward routing); ``plan`` False: eager."""
    if plan and plan.unit == "blocks":
        compile_blocks(model, plan.compiler)
    elif plan is None and t.compile:
        compile_blocks(model, backend=t.compile_backend)
    return model
