"""Activation checkpointing: same loss and gradients as without (exact: the recomputation runs the
same kernels on the same inputs), unchanged state_dict keys, fewer saved activation bytes; selective
checkpointing keeps the policy's outputs and recomputes the rest (also with dropout, whose masks are replayed
from the restored generator); a policy that names no operator is one clear error. The bytes selective
checkpointing keeps against the planner: tests/plan/test_activations.py; the layouts: test_selective.py."""

from __future__ import annotations

import pytest
import torch
from references import SHARDED_LLAMA, dp_batches, dp_model, saved_activation_bytes

from plait.config import ConfigError
from plait.models.gpt import GPT
from plait.models.tiny import tiny_config
from plait.parallel.activation_checkpoint import (
    CheckpointPolicyError,
    apply_activation_checkpointing,
    resolve_save_ops,
    wrapped_block_indices,
)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode,k,wrapped", [("full", 1, [0, 1]), ("every_k", 2, [0]), ("selective", 1, [0, 1])])
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
    ref_grads, grads = _grads(ref), _grads(model)
    assert grads.keys() == ref_grads.keys()
    for n, g in ref_grads.items():
        assert torch.equal(grads[n], g), n
    assert saved < ref_saved


def test_selective_checkpointing_of_a_llama_and_of_dropout_is_exact():
    """A Hugging Face Llama (its layers called with the key-value cache, which the checkpointed layers drop) under
    bf16 autocast, and plait's GPT with dropout: losses and gradients equal without checkpointing, bit for bit."""
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(0, SHARDED_LLAMA["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(3))

    def llama():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHARDED_LLAMA))

    def gpt():
        torch.manual_seed(0)
        cfg = tiny_config(n_layer=2, d_model=32, n_head=4)
        cfg.dropout = 0.1
        return GPT(cfg)

    runs = {"llama": (llama, lambda m: m(input_ids=ids, labels=ids).loss),
            "gpt": (gpt, lambda m: m(ids[:, :-1] % 256, ids[:, 1:] % 256))}
    for name, (build, run) in runs.items():
        out = {}
        for mode in ("none", "selective"):
            model = apply_activation_checkpointing(build(), mode)
            torch.manual_seed(5)  # the dropout masks
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=name == "llama"):
                loss = run(model)
            loss.backward()
            out[mode] = loss, _grads(model)
        assert torch.equal(out["none"][0], out["selective"][0]), name
        for n, g in out["none"][1].items():
            assert torch.equal(out["selective"][1][n], g), (name, n)


def test_checkpointing_rejects_bad_input():
    with pytest.raises(ValueError, match="none, full, every_k or selective"):
        apply_activation_checkpointing(dp_model(), "some")
    with pytest.raises(ValueError, match="k >= 1"):
        apply_activation_checkpointing(dp_model(), "every_k", 0)
    assert wrapped_block_indices(apply_activation_checkpointing(dp_model(), "none")) == []


def test_a_policy_that_names_no_operator_is_one_clear_error():
    assert torch.ops.aten.mm.default in resolve_save_ops(["matmul"])
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in resolve_save_ops(["attention"])
    assert resolve_save_ops(["aten.addmm.default"]) == {torch.ops.aten.addmm.default}
    assert torch.ops._c10d_functional.reduce_scatter_tensor.default in resolve_save_ops(
        ["_c10d_functional.reduce_scatter_tensor"])
    with pytest.raises(CheckpointPolicyError, match="'matmull' names no operator"):
        apply_activation_checkpointing(dp_model(), "selective", save_ops=["matmull"])
    with pytest.raises(CheckpointPolicyError, match="is empty"):
        resolve_save_ops([])
    import plait

    with pytest.raises(ConfigError, match="'mm.nothing' names no operator") as caught:
        plait.Plait(train={"activation_checkpointing": "selective", "checkpoint_save_ops": ["mm.nothing"]},
                    observe={"trackers": [], "progress": False}, run={"dir": ""})
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="activation_offload"):
        plait.Plait(train={"activation_checkpointing": "full", "activation_offload": True},
                    observe={"trackers": [], "progress": False}, run={"dir": ""})
