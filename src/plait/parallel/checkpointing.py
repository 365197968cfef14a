"""Activation checkpointing: recompute chosen blocks in backward instead of saving their activations.

A checkpointed block keeps only its input during forward; backward reruns the block's forward to
rebuild the activations it needs. We use torch's non-reentrant ``torch.utils.checkpoint`` (it
works with FSDP2, with parameters that are views, and with post-accumulate-grad hooks, and calls
each parameter's gradient accumulation once) through ``checkpoint_wrapper``. The wrapper inserts a
``_checkpoint_wrapped_module`` level into module names, which torch strips again in
``state_dict()`` / ``named_parameters()``-based state-dict helpers; we verify the keys are
unchanged rather than trust it (see the test). The blocks are the model's repeated units
(``plait.parallel.units.find_blocks``): plait's GPT's ``blocks``, a Hugging Face model's decoder layers.

BatchNorm inside a recomputed block updates its running statistics twice per step (once in forward,
once in the recomputation), as it does with torch's checkpointing anywhere.
"""

from __future__ import annotations

from typing import Literal

from torch import nn

from plait.parallel.units import find_blocks, replace_module

Mode = Literal["none", "full", "every_k"]


def apply_activation_checkpointing(model: nn.Module, mode: Mode = "none", k: int = 1) -> nn.Module:
    """Wrap the model's blocks for recomputation; return the same (modified) module.

    Contract: ``mode="full"`` wraps every block; ``"every_k"`` wraps blocks ``0, k, 2k, ...`` (every
    k-th block, k >= 1; k=1 equals full); ``"none"`` changes nothing. Call it before data-parallel /
    ZeRO / FSDP wrapping (composition order). ``model.state_dict()`` keys stay those of the unwrapped
    model. Raises ValueError for an unknown mode, k < 1, or a model without repeated blocks.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    if mode not in ("none", "full", "every_k"):
        raise ValueError(f"train.activation_checkpointing must be none, full or every_k; got {mode!r}")
    if mode == "every_k" and k < 1:
        raise ValueError(f"activation checkpointing every_k needs k >= 1; got k={k}")
    if mode == "none":
        return model
    blocks = find_blocks(model)
    if not blocks:
        raise ValueError(f"activation checkpointing recomputes a model's repeated blocks, and {type(model).__name__} "
                         "has none (no _no_split_modules, no ModuleList/Sequential of layers); set "
                         "train.activation_checkpointing=none")
    step = 1 if mode == "full" else k
    for name, block in blocks[::step]:
        replace_module(model, name, checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                                       preserve_rng_state=True))
    return model


def wrapped_block_indices(model: nn.Module) -> list[int]:
    """Indices of the blocks currently wrapped for recomputation (for logs and tests)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return [i for i, (n, b) in enumerate(find_blocks(model))
            if isinstance(b, CheckpointWrapper) or n.endswith("_checkpoint_wrapped_module")]
