"""Activation checkpointing: recompute chosen blocks, or chosen operators of every block, in backward.

``full`` / ``every_k``: a checkpointed block keeps only its input during forward; backward reruns the
block's forward to rebuild the activations it needs. ``selective``: every block is checkpointed with a
policy (torch's ``create_selective_checkpoint_contexts``): the outputs of the operators the policy names
are kept from forward (by default the matmuls and the attention kernels: the expensive ones) and
everything else (norms, activations, rotary, autocast's casts, tensor parallelism's all-gathers and
reduce-scatters) is recomputed before the block's backward. That is torchtitan's op-level selective
checkpointing; the planner prices it from the same operator lists (``plait.plan.stages``).

We use torch's non-reentrant ``torch.utils.checkpoint`` (it works with FSDP2, with parameters that are
views, and with post-accumulate-grad hooks, and calls each parameter's gradient accumulation once)
through ``checkpoint_wrapper``. The wrapper inserts a ``_checkpoint_wrapped_module`` level into module
names, which torch strips again in ``state_dict()`` / ``named_parameters()``-based state-dict helpers; we
verify the keys are unchanged rather than trust it (see the test). The blocks are the model's repeated
units (``plait.parallel.units.find_blocks``): plait's GPT's ``blocks``, a Hugging Face model's decoder
layers.

A Hugging Face decoder layer is called with the model's key-value cache, which it appends to: recomputing
it would append the block's keys a second time (a selective policy then fails, since the recomputation
runs more operators than the forward did). As Hugging Face's own gradient checkpointing does, a
checkpointed layer runs without the cache while training.

BatchNorm inside a recomputed block updates its running statistics twice per step (once in forward,
once in the recomputation), as it does with torch's checkpointing anywhere.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, CheckpointWrapper

from plait.config import ConfigError, TrainConfig
from plait.parallel.offload import offload_activations
from plait.parallel.tensor.regather import keep_gathered
from plait.parallel.units import NO_BLOCKS, find_blocks, replace_module

Mode = Literal["none", "full", "every_k", "selective"]
MODES = ("none", "full", "every_k", "selective")
DEFAULT_SAVE_OPS = ("matmul", "attention")
# Named groups of the selective policy: the aten operators behind a Linear (2-D mm, addmm with a bias,
# batched bmm / baddbmm, fp8's scaled mm) and every kernel scaled_dot_product_attention dispatches to.
OP_GROUPS = {
    "matmul": ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._scaled_mm"),
    "attention": ("aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
                  "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_cudnn_attention",
                  "aten._flash_attention_forward", "aten._efficient_attention_forward"),
}
CACHE_KWARGS = ("cache", "past_key_values", "layer_past")


class CheckpointPolicyError(ConfigError):
    """``train.checkpoint_save_ops`` names no operator; the message says what to write instead."""


def _lookup(name: str) -> list[torch._ops.OpOverload]:
    """The overloads ``name`` names: ``ns.op.overload``, ``ns.op`` (all its overloads) or ``op`` (aten's)."""
    parts = name.split(".")
    if len(parts) == 1:
        parts = ["aten", *parts]
    namespace = getattr(torch.ops, parts[0], None)
    packet = getattr(namespace, parts[1], None) if namespace is not None and len(parts) in (2, 3) else None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return []
    overloads = [parts[2]] if len(parts) == 3 else packet.overloads()
    found = [getattr(packet, o, None) for o in overloads]
    return [op for op in found if isinstance(op, torch._ops.OpOverload)]


def resolve_save_ops(names: Sequence[str]) -> frozenset:
    """The operators a selective policy keeps: each entry a group (``matmul``, ``attention``) or an operator
    name (``mm``, ``aten.mm.default``, ``_c10d_functional.reduce_scatter_tensor``). Raises
    ``CheckpointPolicyError`` for an empty policy or an entry that names no operator (a group that names
    none on this build of torch is not an error: its kernels are simply absent)."""
    if not names:
        raise CheckpointPolicyError(
            "train.checkpoint_save_ops is empty: a selective policy that keeps no operator's output recomputes "
            "the whole block; set train.activation_checkpointing=full for that, or name operators to keep (default "
            f"{list(DEFAULT_SAVE_OPS)})")
    ops: set = set()
    for name in names:
        if name in OP_GROUPS:
            for member in OP_GROUPS[name]:
                ops.update(_lookup(member))
            continue
        found = _lookup(name)
        if not found:
            raise CheckpointPolicyError(
                f"train.checkpoint_save_ops entry {name!r} names no operator: write a group ({', '.join(OP_GROUPS)}) "
                "or an operator as torch.ops names it (mm, aten.addmm, _c10d_functional.reduce_scatter_tensor)")
        ops.update(found)
    return frozenset(ops)


def selective_policy(keep: frozenset) -> Callable[..., Any]:
    """The policy function: keep (``MUST_SAVE``) the outputs of ``keep``'s operators, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if func in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class BlockCheckpoint(CheckpointWrapper):
    """torch's non-reentrant ``CheckpointWrapper`` that runs a Hugging Face layer without its key-value cache
    while training (module docstring)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training and torch.is_grad_enabled():
            kwargs = {k: (None if k in CACHE_KWARGS else v) for k, v in kwargs.items()}
            if "use_cache" in kwargs:
                kwargs["use_cache"] = False
        return super().forward(*args, **kwargs)


def check_checkpointing(mode: str, k: int, save_ops: Sequence[str], offload: bool = False) -> None:
    """Raise ``ConfigError`` for settings of ``train.activation_checkpointing`` that cannot run: an unknown mode,
    ``k < 1``, a selective policy that names no operator, or activation offload with blocks that keep nothing."""
    if mode not in MODES:
        raise ConfigError(f"train.activation_checkpointing must be one of {', '.join(MODES)}; got {mode!r}")
    if mode == "every_k" and k < 1:
        raise ConfigError(f"train.checkpoint_every_k must be at least 1; got {k}")
    if mode == "selective":
        resolve_save_ops(save_ops)
    if offload and mode in ("full", "selective"):
        raise ConfigError(f"train.activation_offload moves the tensors blocks save for backward to host memory, and "
                          f"with activation_checkpointing={mode} every block recomputes them instead; use one of "
                          "the two (or every_k, whose other blocks are offloaded)")


def apply_activation_checkpointing(model: nn.Module, mode: Mode = "none", k: int = 1,
                                   save_ops: Sequence[str] = DEFAULT_SAVE_OPS) -> nn.Module:
    """Wrap the model's blocks for recomputation; return the same (modified) module.

    Contract: ``mode="full"`` wraps every block; ``"every_k"`` wraps blocks ``0, k, 2k, ...`` (every
    k-th block, k >= 1; k=1 equals full); ``"selective"`` wraps every block with the policy keeping the
    outputs of ``save_ops`` (``resolve_save_ops``); ``"none"`` changes nothing. Call it before data-parallel /
    ZeRO / FSDP wrapping (composition order). ``model.state_dict()`` keys stay those of the unwrapped
    model. Raises ValueError for an unknown mode, k < 1, or a model without repeated blocks, and
    ``CheckpointPolicyError`` for a policy that names no operator.
    """
    if mode not in MODES:
        raise ValueError(f"train.activation_checkpointing must be none, full, every_k or selective; got {mode!r}")
    if mode == "every_k" and k < 1:
        raise ValueError(f"activation checkpointing every_k needs k >= 1; got k={k}")
    if mode == "none":
        return model
    context: dict[str, Any] = {}
    if mode == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        policy = selective_policy(resolve_save_ops(save_ops))
        context["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)
    blocks = find_blocks(model)
    if not blocks:
        raise ValueError(f"activation checkpointing recomputes a model's repeated blocks, and {type(model).__name__} "
                         f"has none ({NO_BLOCKS})")
    step = k if mode == "every_k" else 1
    for name, block in blocks[::step]:
        keep_gathered(block)  # sequence parallelism: its recomputation gathers the Linears' input again anyway
        replace_module(model, name, BlockCheckpoint(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                                    preserve_rng_state=True, **context))
    return model


def wrapped_block_indices(model: nn.Module) -> list[int]:
    """Indices of the blocks currently wrapped for recomputation (for logs and tests)."""
    return [i for i, (n, b) in enumerate(find_blocks(model))
            if isinstance(b, CheckpointWrapper) or n.endswith("_checkpoint_wrapped_module")]


def apply_checkpointing(model: nn.Module, t: TrainConfig) -> nn.Module:
    """The composition's activation step: checkpointing (full, selective, every k-th block) and activation offload
    (``plait.parallel.offload``); the model unchanged when both are off."""
    model = apply_activation_checkpointing(model, t.activation_checkpointing, t.checkpoint_every_k,
                                           t.checkpoint_save_ops)
    if t.activation_offload:
        offload_activations(model)
    return model
