"""Activation checkpointing: same loss and gradients as without (exact: the recomputation runs the
same kernels on the same inputs), unchanged state_dict keys, fewer saved activation bytes."""

from __future__ import annotations

import pytest
import torch
from references import dp_batches, dp_model, saved_activation_bytes

from plait.parallel.checkpointing import apply_activation_checkpointing, wrapped_block_indices


@pytest.mark.parametrize("mode,k,wrapped", [("full", 1, [0, 1]), ("every_k", 2, [0])])
def test_checkpointing_is_exact_and_saves_memory(mode, k, wrapped):
    x, y = dp_batches(1)[0]
    ref = dp_model()
    ref_loss, ref_saved = saved_activation_bytes(ref, x, y)
    ref_loss.backward()
    model = apply_activation_checkpointing(dp_model(), mode, k)
    assert wrapped_block_indices(model) == wrapped
    assert list(model.state_dict().keys()) == list(ref.state_dict().keys())
    loss, saved = saved_activation_bytes(model, x, y)
    loss.backward()
    assert torch.equal(loss, ref_loss)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
    assert grads.keys() == ref_grads.keys()
    for n, g in ref_grads.items():
        assert torch.equal(grads[n], g), n
    assert saved < ref_saved


def test_checkpointing_rejects_bad_input():
    with pytest.raises(ValueError, match="none, full, every_k or selective"):
        apply_activation_checkpointing(dp_model(), "some")
    with pytest.raises(ValueError, match="k >= 1"):
        apply_activation_checkpointing(dp_model(), "every_k", 0)
    assert wrapped_block_indices(apply_activation_checkpointing(dp_model(), "none")) == []
