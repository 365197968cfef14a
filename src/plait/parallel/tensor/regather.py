"""Sequence parallelism that keeps the shard: the column-parallel Linears of a block gather their input again in
backward instead of keeping the whole sequence (Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``
with ``sequence_parallel``; Korthikanti et al. 2022, section 4.2.2).

Under sequence parallelism the input of attention's q, k and v (and of an MLP's gate and up, or fc) is the norm's
output, split along the sequence over the tp ranks; the Linears need it whole. ``GatherSequence`` (a style on the
attention or MLP module) all-gathers it once per forward, cast to the autocast dtype first under autocast, and
hands the Linears the gathered tensor; ``ColwiseRegather`` (the Linears' style: column-parallel weights, as
``ColwiseParallel``) computes ``x W^T + b`` on it but saves only this rank's shard for backward. In backward the
first of the Linears to need its weight gradient all-gathers the shard again; the others reuse that tensor, which
is freed after the last of them. Per layer and micro-batch a rank keeps ``T / t`` tokens of each block input
instead of ``T``. A block that activation checkpointing recomputes keeps the gathered input instead
(``keep_gathered``): its recomputation gathers it anyway.

Communication: forward, one all-gather per block input (as before); backward, one all-gather of the kept shard
(new: the price of the memory) and one reduce-scatter of the Linears' summed input gradients (as before).
Numerics are those of ``ColwiseParallel`` on a gathered ``Replicate`` input: the same local matmuls, the weight
gradient from a bit-identical gathered tensor, the input gradients summed in the same dtype and reduce-scattered
once.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput

from plait.parallel.tensor.plan import PrepareGatheredInput

GATHERED_ATTR = "_plait_regather"
SITE_ATTR = "_plait_gather_sequence"  # a module whose input GatherSequence gathers
KEEP_ATTR = "_plait_keep_gathered"  # ... whose Linears keep the gathered input whole (keep_gathered)
SEQ_DIM = 1  # (B, T, C): the sequence dim
AUTOCAST_DEVICES = ("cpu", "cuda", "xpu")


def _wait(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _all_gather(shard: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    return _wait(funcol.all_gather_single(shard.contiguous(), gather_dim=SEQ_DIM, group=mesh))


def _autocast(device: str) -> bool:
    return device in AUTOCAST_DEVICES and torch.is_autocast_enabled(device)


def _no_autocast(device: str) -> contextlib.AbstractContextManager:
    return torch.autocast(device, enabled=False) if _autocast(device) else contextlib.nullcontext()


class Regather:
    """One gathered input shared by several Linears: the shard they keep, the mesh, and in backward the tensor
    gathered again, held until the last of the ``users`` has taken it."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh, self.users, self.full = mesh, 0, None

    def take(self, shard: torch.Tensor) -> torch.Tensor:
        """The whole input again (all-gathered by the first caller of a backward, reused by the others)."""
        full = self.full if self.full is not None else _all_gather(shard, self.mesh)
        self.users -= 1
        self.full = full if self.users > 0 else None
        return full


class _GatherSequence(torch.autograd.Function):
    """Forward: all-gather of the sequence shards (saves nothing). Backward: reduce-scatter (sum) of the gradient
    onto the shards."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:  # (B, T/t, C) -> (B, T, C)
        ctx.mesh = mesh
        return _all_gather(shard, mesh)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = funcol.reduce_scatter_single(grad.contiguous(), "sum", scatter_dim=SEQ_DIM, group=ctx.mesh)
        return _wait(out), None


class _RegatheredLinear(torch.autograd.Function):
    """``F.linear(full, weight, bias)`` keeping ``shard`` (and the weight) for backward instead of ``full``.
    Forward: no communication. Backward: the shard all-gathered again (once for all users of ``handle``) for the
    weight gradient; the input gradient returned to ``full`` (the gather's backward reduce-scatters it)."""

    @staticmethod
    def forward(ctx: Any, full: torch.Tensor, shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                handle: Regather) -> torch.Tensor:
        with _no_autocast(full.device.type):  # operands are in the matmul's dtype already
            out = torch.nn.functional.linear(full, weight, bias)
        ctx.save_for_backward(shard, weight)
        ctx.handle, ctx.has_bias = handle, bias is not None
        handle.users += 1
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        shard, weight = ctx.saved_tensors
        grad2d = grad.reshape(-1, grad.shape[-1])  # (B*T, N)
        grad_in = grad2d.mm(weight).view(*grad.shape[:-1], weight.shape[1]) if ctx.needs_input_grad[0] else None
        grad_w = grad_b = None
        if ctx.needs_input_grad[2]:
            full = ctx.handle.take(shard)
            grad_w = full.reshape(-1, full.shape[-1]).t().mm(grad2d).t()  # as mm's backward: (x^T dY)^T, (N, C)
        else:
            ctx.handle.users -= 1
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_b = grad2d.sum(0)
        return grad_in, None, grad_w, grad_b, None


class GatherSequence(PrepareGatheredInput):
    """The input of a block's column-parallel Linears (attention, MLP), sequence-sharded (``Shard(1)``): all-gathered
    once (under autocast in the autocast dtype, so the gather moves half the bytes and the Linears share one cast,
    as ``PrepareGatheredInput``) and handed on as a plain tensor that ``ColwiseRegather`` Linears recognise.

    In a block that activation checkpointing recomputes (``keep_gathered``) the gathered input is handed on as a
    ``Replicate`` DTensor instead, kept whole by the Linears (``PrepareGatheredInput``): there it lives only from
    the recomputation to the block's backward, which the recomputation's own all-gather already serves, so a
    second gather would only cost time."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        style = copy.copy(self)  # one per module: it reads its module's mode
        style.module = weakref.ref(module)
        module.__dict__[SITE_ATTR] = True
        return PrepareModuleInput._apply(style, module, device_mesh)

    def _prepare_input_arg(self, input: Any, mesh: DeviceMesh, input_layout: Any, desired_layout: Any) -> Any:
        if input_layout is None or not isinstance(input, torch.Tensor):
            return input
        if input_layout != Shard(SEQ_DIM) or desired_layout != Replicate():
            raise ValueError(f"GatherSequence gathers Shard({SEQ_DIM}) into Replicate; got {input_layout} -> "
                             f"{desired_layout}")
        module = self.module() if hasattr(self, "module") else None
        if module is not None and module.__dict__.get(KEEP_ATTR):
            return super()._prepare_input_arg(input, mesh, input_layout, desired_layout)
        shard = input.to_local() if isinstance(input, DTensor) else input
        if shard.dtype == torch.float32 and _autocast(shard.device.type):
            shard = shard.to(torch.get_autocast_dtype(shard.device.type))
        full = _GatherSequence.apply(shard, mesh)
        setattr(full, GATHERED_ATTR, (shard, Regather(mesh)))
        return full


def keep_gathered(block: nn.Module) -> None:
    """Make the ``GatherSequence`` modules inside ``block`` (a block activation checkpointing recomputes) hand their
    Linears the whole gathered input to keep, rather than the shard to gather again (``GatherSequence``)."""
    for m in block.modules():
        if m.__dict__.get(SITE_ATTR):
            m.__dict__[KEEP_ATTR] = True


class _RegatherLinear:
    """Placed before ``nn.Linear``'s class by ``ColwiseRegather``: on a ``GatherSequence`` input, the linear on this
    rank's weight shard keeping only the input's shard; any other input as ``ColwiseParallel``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        found = getattr(x, GATHERED_ATTR, None)
        if found is None:
            return super().forward(x)  # type: ignore[misc]
        shard, handle = found
        weight, bias = self._cast("weight", x), self._cast("bias", x)
        return _RegatheredLinear.apply(x, shard, weight, bias, handle)

    def _cast(self, name: str, x: torch.Tensor) -> torch.Tensor | None:
        """The parameter's local shard in ``x``'s dtype (differentiable). Under autocast the half-precision copy is
        shared by the forwards that overlap (a pipeline's micro-batches in flight), as autocast shares its cached
        cast of a parameter: reused while a forward still keeps it and the parameter is unchanged."""
        p = getattr(self, name)
        if p is None:
            return None
        local = p.to_local() if isinstance(p, DTensor) else p
        if local.dtype == x.dtype or not _autocast(x.device.type):
            return local
        key = (name, p._version, local.untyped_storage().data_ptr(), x.dtype)
        cached = self.__dict__.get("_plait_casts", {}).get(key)
        cast = cached() if cached is not None else None
        if cast is None:
            cast = local.to(x.dtype)
            self.__dict__["_plait_casts"] = {**{k: v for k, v in self.__dict__.get("_plait_casts", {}).items()
                                                if k[0] != name}, key: weakref.ref(cast)}
        return cast


class _RegatherLinearClass(_RegatherLinear, nn.Linear):
    pass


class ColwiseRegather(ColwiseParallel):
    """``ColwiseParallel`` (weight and bias ``Shard(0)``, output the local shard of the width) whose Linear, fed by
    ``GatherSequence``, keeps its input's sequence shard for backward and gathers it again there."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if type(module) is not nn.Linear:
            raise NotImplementedError(f"ColwiseRegather shards an nn.Linear; got {type(module).__name__}")
        module = super()._apply(module, device_mesh)
        module.__class__ = _RegatherLinearClass
        return module

    @staticmethod
    def _prepare_input_fn(input_layouts: Any, desired_input_layouts: Any, mod: nn.Module, inputs: Any,
                          device_mesh: DeviceMesh) -> Any:
        if getattr(inputs[0], GATHERED_ATTR, None) is not None:
            return inputs[0]  # the gathered input: the Linear's own forward takes it
        return ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)

    @staticmethod
    def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any,
                           device_mesh: DeviceMesh) -> Any:
        if not isinstance(outputs, DTensor):
            return outputs  # the local shard of the width, as ColwiseParallel's local output
        return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
