"""Tensor (and sequence) parallelism over float8 Linears (``train.precision = "fp8"``): torchao's float8 styles
wherever a plan shards a ``Float8Linear``, as torchtitan does.

float8 converts the Linears first (``plait.parallel.float8``); every plan plait applies (plait's GPT, a Hugging Face
model's shipped plan, a user's dict of style names, with or without sequence parallelism) then passes through
``float8_plan``, which gives each entry the float8 form of its style where the module it shards is a Float8Linear:

==============================================  ==============================================================
plait's style                                   on a Float8Linear (or a module whose input only they read)
==============================================  ==============================================================
column-parallel (``ColwiseParallel``,           ``Float8ColwiseParallel``: the input cast to float8 before any
plait's ``ColwiseRegather``)                    redistribution; the output's gradient cast to float8 before it
                                                is redistributed backward
row-parallel (``RowwiseParallel``)              ``Float8RowwiseParallel``: the same at its input and output
the input several column-parallel Linears       ``PrepareFloat8ModuleInput``: cast to float8 once for all of them
share (plait's ``PrepareGatheredInput``,        and, under sequence parallelism, all-gathered in float8 (half
``GatherSequence``)                             the bytes of bf16)
==============================================  ==============================================================

The float8 form is taken where every Linear child of such a module is a Float8Linear the plan shards (attention's
q, k, v and proj; an MLP's fc and proj); a module whose input another Linear reads (an MoE router) keeps its input in
high precision. Everything else (embeddings, norms, the bf16 head) keeps its style. Two departures from torchao's
styles, each for the single-process numerics: a Linear with a bias keeps its output's gradient in high precision
until its own matmul casts it (torchao casts it where it leaves the module, so the bias's gradient would be summed
from float8_e5m2 values), and the input is first cast to the autocast dtype where ``Float8Linear`` itself would
(under CUDA autocast), so its scale is that of the same tensor.

Numerics: each dynamic per-tensor scale is computed on the DTensor, over the whole tensor (where the tensor is sharded,
one all-reduce of its max over tp: the communication float8 adds), so each float8 cast of a tensor the single-process
model also has gives the same float8 values. What differs is the order of sums: a row-parallel Linear's partial outputs
are added over tp in its output dtype (bf16 under autocast), and input gradients summed over tp; a rounding difference
there moves an element that a later float8 cast puts near a rounding boundary by one float8 step
(tests/parallel/test_float8_compose.py bounds this by float8's own rounding). Under sequence parallelism the
column-parallel float8 Linears keep the gathered float8 input for backward (1 byte per element of the whole sequence)
instead of the bf16 shard that ``ColwiseRegather`` keeps and gathers again (2 / tp bytes): equal at tp = 2. On the CPU
(gloo has no float8 type) the sequence is gathered in high precision and cast after: the same float8 values, twice the
bytes.

A user's ``parallelize_fn`` is applied as it is (it chooses its styles, torchao's among them, as torchtitan's does).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle


def _autocast_input(x: Any) -> Any:
    """Float8Linear's own first step: under CUDA autocast (the only autocast torchao checks) its input is cast to
    the autocast dtype before float8, so the scale is that of the half-precision tensor. A style that casts the
    input earlier does the same, for the same scale."""
    if isinstance(x, torch.Tensor) and x.dtype == torch.float32 and torch.is_autocast_enabled():
        return x.to(torch.get_autocast_dtype("cuda"))
    return x


@functools.cache
def _float8_classes() -> tuple[type, type, type]:
    # imported here: torchao is the fp8 extra, imported only once a model has Float8Linears
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    # torchao's styles cast the output's gradient to float8 where it leaves the module, after the bias: a bias's
    # gradient would then be summed from float8_e5m2 values. On a Linear with a bias the plain style's output is
    # kept, and the matmul's own backward casts that gradient (the same scale: the whole DTensor's), so the bias
    # gets the high-precision sum, as in one process.
    def keep_bias_grad(float8_style: type, plain_style: type) -> type:
        """``float8_style`` casting its input as autocast would, with ``plain_style``'s output on a Linear with a
        bias."""

        class Style(float8_style):
            @staticmethod
            def _prepare_input_fn(input_layouts: Any, desired_input_layouts: Any, mod: nn.Module, inputs: Any,
                                  device_mesh: DeviceMesh) -> Any:
                inputs = (_autocast_input(inputs[0]), *inputs[1:])
                return float8_style._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)

            @staticmethod
            def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any,
                                   device_mesh: DeviceMesh) -> Any:
                base = plain_style if mod.bias is not None else float8_style
                return base._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)

        return Style

    Float8Colwise = keep_bias_grad(Float8ColwiseParallel, ColwiseParallel)
    Float8Rowwise = keep_bias_grad(Float8RowwiseParallel, RowwiseParallel)

    class PrepareFloat8Input(PrepareFloat8ModuleInput):
        def _prepare_input_arg(self, input: Any, mesh: DeviceMesh, input_layout: Any, desired_layout: Any) -> Any:
            if input_layout is None:
                return input
            input = _autocast_input(input)
            if mesh.device_type != "cuda" and desired_layout not in (None, input_layout):
                # gloo has no float8 type: the high-precision shard is gathered, then cast. The same float8 values
                # (the scale is the whole tensor's either way, the cast elementwise), twice the bytes on the wire
                input = PrepareModuleInput._prepare_input_arg(self, input, mesh, input_layout, desired_layout)
                input_layout = desired_layout
            return super()._prepare_input_arg(input, mesh, input_layout, desired_layout)

    return Float8Colwise, Float8Rowwise, PrepareFloat8Input


def _is_float8(module: nn.Module) -> bool:
    found = sys.modules.get("torchao.float8.float8_linear")  # a Float8Linear exists only once torchao made it
    return found is not None and isinstance(module, found.Float8Linear)


def float8_plan(root: nn.Module, plan: dict[str, ParallelStyle | None]) -> dict[str, ParallelStyle | None]:
    """``plan`` (names of ``root``'s modules, relative to it -> styles, as ``parallelize_module`` takes them; None:
    left whole) with the float8 form of each style that shards a Float8Linear (module docstring); unchanged when
    ``root`` holds no Float8Linear."""
    if not any(_is_float8(m) for m in root.modules()):
        return plan
    colwise_cls, rowwise_cls, prepare_cls = _float8_classes()
    modules = {name: root.get_submodule(name) for name in plan}
    sharded = {id(m): isinstance(plan[n], ColwiseParallel) for n, m in modules.items()
               if _is_float8(m) and isinstance(plan[n], ColwiseParallel | RowwiseParallel)}
    out: dict[str, ParallelStyle | None] = {}
    for name, style in plan.items():
        module = modules[name]
        if type(style).__module__.startswith("torchao."):
            out[name] = style  # a float8 style already
        elif isinstance(style, ColwiseParallel | RowwiseParallel) and _is_float8(module):
            float8 = colwise_cls() if isinstance(style, ColwiseParallel) else rowwise_cls()
            float8.__dict__.update({k: v for k, v in vars(style).items() if k in (
                "input_layouts", "output_layouts", "desired_input_layouts", "use_local_output")})
            out[name] = float8
        elif isinstance(style, PrepareModuleInput) and _float8_readers(module, sharded):
            out[name] = prepare_cls(input_layouts=style.input_layouts,
                                    desired_input_layouts=style.desired_input_layouts,
                                    input_kwarg_layouts=style.input_kwarg_layouts if style.with_kwargs else None,
                                    desired_input_kwarg_layouts=style.desired_input_kwarg_layouts,
                                    use_local_output=style.use_local_output)
        else:
            out[name] = style
    return out


def _float8_readers(module: nn.Module, sharded: dict[int, bool]) -> bool:
    """Whether the input ``module`` prepares is read by float8 column-parallel Linears only: every Linear child is a
    Float8Linear of the plan, at least one of them column-parallel (the row-parallel ones read what those make)."""
    linears = [c for c in module.children() if isinstance(c, nn.Linear)]
    return bool(linears) and all(id(c) in sharded for c in linears) and any(sharded[id(c)] for c in linears)
