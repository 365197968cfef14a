"""ZeRO stage 3 on FSDP2: ``fully_shard`` per block and at the root.

Each of the model's repeated blocks (``plait.parallel.units.find_blocks``: plait's GPT's ``blocks``, a
Hugging Face model's decoder layers) becomes its own FSDP unit (its parameters are all-gathered just
before the block runs and freed after, so at most about one block is unsharded at a time), and the
root unit holds the rest: embeddings, final norm and the head. A block's outputs that are views (T5's
relative position bias) are handed on as copies (``_copy_view_outputs``), so FSDP2's pre-backward hook on
them cannot be lost to an in-place op. A head tied to the embedding belongs to
the root unit with it, so the one shared parameter is sharded once and its gradient gets both
contributions before the reduce-scatter. Tying must happen before this call; FSDP2 replaces
parameters with DTensors and the tie survives because both modules hold the same Parameter object. A
model without repeated blocks is one unit.

Communication (per unit, done by FSDP2): forward all-gathers the unit's parameters (and, with
``reshard_after_forward=True``, all-gathers them again in backward); backward reduce-scatters its
gradients (averaged over the mesh) in ``reduce_dtype``.

Hybrid sharding (HSDP): given the 2-D ``(dp_replicate, dp_shard)`` mesh (``Topology.fsdp_mesh``), FSDP2
shards each parameter over the ``dp_shard`` ranks of a shard group and replicates it across the groups
(placements ``(Replicate(), Shard(0))``): forward and backward all-gather inside the shard group only, and
backward reduce-scatters the gradients inside it, then all-reduces the reduced shard across the replicas.
Memory per rank follows the shard group's size, ``16 psi / dp_shard`` for fp32 AdamW.

Checked on this CPU build (torch 2.13, gloo): ``fully_shard`` and ``MixedPrecisionPolicy`` (bf16)
work on CPU; ``CPUOffloadPolicy`` does not ("Cannot access accelerator device when none is
available"), so ``offload="params"`` is rejected up front on CPU with a message instead.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_leaves, tree_map_only

from plait.observe.log import get_logger
from plait.parallel.units import NO_BLOCKS, describe_blocks, find_blocks, tied_uses
from plait.parallel.zero.optimizer import ZeroConfigError


def _mesh_device_type(mesh: DeviceMesh) -> str:
    return mesh.device_type


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype | None = torch.float32,
               offload: Literal["none", "params"] = "none",
               reshard_after_forward: bool = True,
               ignored_params: set[nn.Parameter] | None = None,
               blocks: list[nn.Module] | None = None) -> nn.Module:
    """Shard ``model`` with FSDP2 over the data-parallel ``mesh``; return the same module.

    ``mesh`` is 1-D (FSDP: sharded over all its ranks) or 2-D ``(replicate, shard)`` (HSDP: sharded along
    dim 1, replicated along dim 0). ``blocks`` are the units besides the root (default: the model's repeated
    blocks, ``plait.parallel.units.find_blocks``; a pipeline stage passes the blocks it holds).

    Contract: call it last in the composition
    order (after tensor parallelism and activation checkpointing) and build the optimizer on
    ``model.parameters()`` afterwards (they are DTensors then). ``param_dtype=torch.bfloat16`` runs
    forward/backward in bf16 with fp32 sharded master parameters; ``reduce_dtype`` is the gradient
    reduce-scatter dtype. ``reshard_after_forward=False`` keeps each block unsharded between forward
    and backward (ZeRO-2-like memory, one all-gather fewer). ``ignored_params`` stay plain, unsharded
    and unreduced (expert-parallel weights, reduced by ``plait.parallel.expert.dispatch``). Raises
    ``ZeroConfigError`` for a mesh of size 1 without offload (one rank with ``offload="params"`` is
    allowed: the states live in host memory), an unknown offload, or offload on a CPU device.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if mesh.ndim not in (1, 2):
        raise ZeroConfigError(f"apply_fsdp takes the 1-D data-parallel mesh or the 2-D (replicate, shard) mesh of "
                              f"hybrid sharding; got a {mesh.ndim}-D mesh (pass topology.fsdp_mesh)")
    if mesh.size() < 2 and offload != "params":
        raise ZeroConfigError("parallel.zero=3 shards parameters across the data-parallel ranks, but the "
                              "data-parallel mesh has 1 rank; use parallel.zero=0 or dp >= 2")
    if offload not in ("none", "params"):
        raise ZeroConfigError(f"zero=3 offload must be 'none' or 'params'; got {offload!r}")
    if offload == "params" and _mesh_device_type(mesh) == "cpu":
        raise ZeroConfigError(
            "parallel.offload=params (FSDP2 CPUOffloadPolicy) needs an accelerator: it moves sharded "
            "parameters, gradients and optimizer states from GPU memory to CPU memory, and this run is "
            "already on the CPU (torch's CPUOffloadPolicy fails here with 'Cannot access accelerator "
            "device'). Set parallel.offload=none"
        )
    if blocks is None:
        found = find_blocks(model)
        blocks = [m for _, m in found]
        log = get_logger(mesh.get_rank())  # which units ZeRO-3 gathers one at a time, or why it gathers everything
        if found:
            log.info("ZeRO-3 shards %s as one unit each, the rest with the root", describe_blocks(found))
        else:
            log.warning("ZeRO-3 finds no repeated blocks in %s (%s): the whole model is one unit, gathered whole "
                        "in forward", type(model).__name__, NO_BLOCKS)
    check_ties_within_units(model, blocks)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload_policy = CPUOffloadPolicy() if offload == "params" else OffloadPolicy()
    for block in blocks:
        block.register_forward_hook(_copy_view_outputs)  # before fully_shard's own: it runs first
        fully_shard(block, mesh=mesh, mp_policy=policy, offload_policy=offload_policy,
                    reshard_after_forward=reshard_after_forward, ignored_params=ignored_params)
    # The root unit's parameters are needed first in backward too (the tied head): never reshard the
    # root after forward, since backward would all-gather it again at once.
    fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload_policy,
                reshard_after_forward=False, ignored_params=ignored_params)
    return model


def check_ties_within_units(model: nn.Module, blocks: list[nn.Module]) -> None:
    """A ``ZeroConfigError`` when modules that share one weight (a tie) fall in different FSDP units: ``fully_shard``
    of a block replaces the parameters of the block's own modules only, so a user outside the block would keep the
    old tensor and train apart from it. A tied embedding and head, both outside the blocks, share the root unit."""
    unit_of = {id(m): b for b, block in enumerate(blocks) for m in block.modules()}
    for tie in tied_uses(model):
        uses = [(name, unit_of.get(id(module), -1)) for name, module in tie]
        if len({unit for _, unit in uses}) > 1:
            where = ", ".join(f"{n} ({f'block {u}' if u >= 0 else 'root'})" for n, u in uses)
            raise ZeroConfigError(f"parallel.zero=3 shards each repeated block as its own FSDP unit, but the model "
                                  f"ties one weight across units: {where}; the tie would break. Untie the weights, "
                                  "or use parallel.zero=0, 1 or 2")


def _copy_view_outputs(module: nn.Module, args: Any, output: Any) -> Any:
    """A unit's outputs that are views, as copies (None: the outputs unchanged, where there is none).

    FSDP2 hooks every output of a unit that requires grad, so that the gradient flowing back into it
    all-gathers the unit's parameters first; an in-place op on an output that is a view would drop that hook,
    so torch warns for each view ("FSDP2-wrapped module returned a view tensor"). A T5Block returns such a
    view beside its hidden states: the relative position bias (a permute of the bias embedding, computed by
    the first block and passed on by the others). A copy keeps the hook whatever the caller does with it, at
    the cost of one copy of that tensor per block."""
    def hooked_view(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t._base is not None and t.requires_grad

    if not torch.is_grad_enabled() or not any(hooked_view(t) for t in tree_leaves(output)):
        return None
    return tree_map_only(torch.Tensor, lambda t: t.clone() if hooked_view(t) else t, output)


def clip_grad_norm_(model: nn.Module, max_norm: float, params: list[nn.Parameter] | None = None) -> torch.Tensor:
    """Clip the global gradient norm of an FSDP2 model; return the total norm as a plain tensor on the device
    (nothing read on the host). ``params``: the model's trainable parameters, if the caller listed them once.

    Communication: torch computes each shard's norm locally and all-reduces it across the mesh (the
    DTensor reduction); no backward. The returned norm may be non-finite: the trainer should skip
    the step then. ``max_norm`` inf: the norm only.
    """
    from torch.distributed.tensor import DTensor

    params = [p for p in (params if params is not None else model.parameters()) if p.grad is not None]
    if math.isinf(max_norm):
        total = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.zeros(())
    else:
        total = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return total.full_tensor() if isinstance(total, DTensor) else total


@contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Accumulation micro-steps of an FSDP2 model without the gradient reduce-scatter (kept unsharded)."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
