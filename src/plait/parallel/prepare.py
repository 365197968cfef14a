"""Preparing a user's model for a layout: one set of weights everywhere, BatchNorm, forward routing.

Before any layout is applied every rank must hold the same weights (tensor parallelism and FSDP shard
whatever each rank holds), so rank 0's are broadcast. After it, the user's ``model(...)`` must run
through the layout's wrapper where there is one (DDP) and under autocast where the precision asks for
it, and return in float32 what the lower precision made, while the user keeps their own model object.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

from plait.comm.collectives import Comm
from plait.components.precision import autocast, compute_dtype


def unwrap_compiled(model: nn.Module) -> tuple[nn.Module, Any]:
    """A ``torch.compile``d model's original module (its state-dict keys carry ``_orig_mod.``), and the dynamo
    context it was compiled with (None for a model that was not): ``setup`` compiles the module again with it once
    the layout is applied, so the user's backend, mode and options stay (``plait.parallel.compile``)."""
    inner = getattr(model, "_orig_mod", None)
    return (inner, model.dynamo_ctx) if isinstance(inner, nn.Module) else (model, None)


@torch.no_grad()
def broadcast_weights(model: nn.Module, comm: Comm, world_size: int) -> None:
    """Every rank takes global rank 0's parameters and buffers, whatever seed built them.

    Communication: one broadcast per dtype of all tensors flattened; none in backward."""
    if world_size == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if t.numel():
            by_dtype.setdefault(t.dtype, []).append(t)
    for dtype in sorted(by_dtype, key=str):
        group = by_dtype[dtype]
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        comm.broadcast(flat, src=0, group=None, name="initial weights broadcast")
        offset = 0
        for t in group:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def sync_batchnorm(model: nn.Module, group: dist.ProcessGroup | None, device: torch.device) -> nn.Module:
    """BatchNorm layers replaced by synchronized ones over ``group``: torch's on CUDA, plait's on the CPU,
    where torch's refuses to run."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model, group)
    from plait.nn import convert_sync_batchnorm

    return convert_sync_batchnorm(model, group)


def float32_outputs(out: Any, low: torch.dtype) -> Any:
    """``out`` with every tensor of dtype ``low`` as float32, in tensors, tuples, lists, dicts and the containers
    registered with torch's pytree (named tuples, transformers' ``ModelOutput``); integer tensors, tensors of any
    other dtype and anything else unchanged."""
    return tree_map_only(torch.Tensor, lambda t: t.float() if t.dtype == low else t, out)


def route_forward(model: nn.Module, wrapper: Callable[..., Any] | None, precision: str, amp: bool,
                  device: torch.device) -> None:
    """Make ``model(...)`` run through ``wrapper`` (DDP) and under autocast (``amp``), and return the outputs the
    lower ``precision`` made (bf16 or fp16, by autocast or by FSDP2's mixed-precision policy) as float32
    (``float32_outputs``), as the user's own loop gets them when its autocast region covers the loss: the loss
    and whatever else the user computes from the outputs run in float32, where autocast would have run
    cross-entropy. A model whose floating parameters all hold that dtype already (the user chose it: autocast
    changes nothing) keeps its outputs. The model object and its state-dict keys stay the user's."""
    low = compute_dtype(precision)
    if low is not None and all(q.dtype == low for q in model.parameters() if q.is_floating_point()):
        low = None
    if wrapper is None and not amp and low is None:
        return
    inner = wrapper if wrapper is not None else model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        with autocast(precision, device, amp):
            out = inner(*args, **kwargs)
        return out if low is None else float32_outputs(out, low)

    model.forward = forward
