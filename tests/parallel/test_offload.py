"""Activation offload: the same losses and gradients as without (bit for bit: the tensors come back unchanged),
every distinct saved storage of each block moved once each way, parameters never, and the bytes moved equal to
the planner's figure (``LayerCost.host``: a block's saved bytes, autocast's weight copies and rotary's cos and
sin). On a CPU the host is the device's own memory: the path and its accounting are what is tested; the
pinned, side-stream overlap of a GPU is not measured here."""

from __future__ import annotations

import contextlib

import pytest
import torch
from references import dp_batches, dp_model

from plait.parallel.offload import activation_offload_of, offload_activations
from plait.plan.hardware import load_profile
from plait.plan.shapes import gpt_shape, shape_from_hf
from plait.plan.stages import Cluster, StageModel
from plait.plan.workload import Layout, Workload

B, T = 2, 16


def _llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=112, max_position_embeddings=T,
                                      tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    ids = torch.randint(0, 112, (B, T))
    return (lambda: transformers.LlamaForCausalLM(config)), shape_from_hf(config, T), \
        (lambda m: m(input_ids=ids, labels=ids).loss)


def _gpt():
    x, y = dp_batches(1)[0]
    return dp_model, gpt_shape(2, 32, 2, 16, 256), (lambda model: model(x[:B], y[:B]))


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("regime", ["fp32", "autocast"])
def test_offload_is_exact_and_moves_what_the_planner_says(family, regime):
    build, shape, run = _llama() if family == "llama" else _gpt()
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if regime == "autocast" else contextlib.nullcontext
    torch.manual_seed(0)
    ref = build()
    torch.manual_seed(0)
    model = build()
    offload = offload_activations(model)
    assert activation_offload_of(model) is offload
    for m in (ref, model):
        with ctx():
            loss = run(m)
        loss.backward()
        m.loss = loss
    assert torch.equal(ref.loss, model.loss)
    for (n, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n
    work = Workload(shape, Layout(micro_batch_size=B, act_offload=True), B,
                    precision="fp32" if regime == "fp32" else "bf16")
    stage = StageModel(work, Cluster.of(load_profile("h100-sxm"), 1))
    want = sum(stage.block(i).host for i in range(shape.n_layer))
    assert offload.stats.to_host == pytest.approx(want, rel=0.01), (offload.stats, want)
    assert offload.stats.to_device == offload.stats.to_host and offload.stats.host_live == 0
    assert stage.block(0).saved == 0 and stage.block(0).transient >= stage.block(0).host


def test_offload_composes_with_compiled_blocks(tmp_path):
    """``train.activation_offload`` with ``train.compile`` (``aot_eager``, no C++ compiler): the layout compiles block
    by block (the offload's hooks open each block's saved-tensor context eagerly around its compiled region), what the
    compiled graphs save still moves (bytes counted both ways), and the user's loop through ``plait.Plait`` trains as
    the eager plain loop does: losses and parameters after 3 AdamW steps within 1e-6 (aot_eager runs the traced aten
    ops: the same kernels, measured 0)."""
    import plait

    x, y = dp_batches(1)[0]
    ref = dp_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_losses = []
    for _ in range(3):
        loss = ref(x[:B], y[:B])
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    p = plait.Plait(train={"global_batch_size": B, "micro_batch_size": B, "compile": True,
                           "compile_backend": "aot_eager", "activation_offload": True},
                    run={"dir": str(tmp_path)}, observe={"progress": False, "trackers": []})
    model, _ = p.setup(dp_model(), optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    losses = []
    for _ in range(3):
        loss = model(x[:B], y[:B])
        p.backward(loss)
        p.step()
        losses.append(loss.item())
    offload = activation_offload_of(model)
    assert offload is not None and offload.stats.to_host > 0 and offload.stats.to_device == offload.stats.to_host
    assert losses == pytest.approx(ref_losses, abs=1e-6)
    for (n, q), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(q, r, atol=1e-6, rtol=0), n
    assert any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())  # blocks compiled
    p.close()
