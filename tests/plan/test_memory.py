"""The memory model against measurement: model-state bytes (stages 0-3, dp=2 and 4, fp32 and bf16
mixed) within 5%, and GPT activation bytes against saved-tensor measurement."""

from __future__ import annotations

import pytest
import torch
from helpers import run_ranks
from references import DP_CFG, dp_batches, dp_model, local_micro_batches, param_groups, saved_activation_bytes

from plait.observe.memory import measure_model_state_bytes
from plait.parallel.activation_checkpoint import apply_activation_checkpointing
from plait.parallel.fsdp.shard import apply_fsdp
from plait.parallel.zero.optimizer import ZeroOptimizer
from plait.plan.memory import (
    GPTShape,
    format_memory_table,
    gpt_num_params,
    predict_activation_bytes,
    predict_model_state_bytes,
)


def _build(stage, precision, world, mesh):
    model = dp_model()
    if stage == 3:
        dtype = torch.bfloat16 if precision == "bf16" else None
        model = apply_fsdp(model, mesh, param_dtype=dtype)
        return model, torch.optim.AdamW(param_groups(model), lr=1e-3)
    if stage == 0:
        return model, torch.optim.AdamW(param_groups(model), lr=1e-3)
    return model, ZeroOptimizer(model, param_groups(model), torch.optim.AdamW, stage=stage, lr=1e-3)


def _memory_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for precision in ("fp32", "bf16"):
        for stage in (0, 1, 2, 3):
            model, opt = _build(stage, precision, world, mesh)
            autocast = precision == "bf16" and stage != 3  # stage 3 casts through FSDP2's policy
            for i, (x, y) in enumerate(dp_batches(2)):
                (mx, my), = local_micro_batches(x, y, rank, world, 1)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss = model(mx, my)
                loss.backward()
                if i == 1:
                    if isinstance(opt, ZeroOptimizer):
                        opt.finish_grad_sync()
                    break  # measure after backward: gradients and optimizer states all alive
                opt.step()
                opt.zero_grad()
            out[(stage, precision)] = measure_model_state_bytes(model, opt)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_measured_model_state_matches_prediction(world):
    psi = gpt_num_params(DP_CFG.n_layer, DP_CFG.d_model, DP_CFG.vocab_size, DP_CFG.seq_len)
    assert psi == dp_model().num_params()
    per_rank = run_ranks(_memory_worker, world)
    for measured_all in per_rank:
        for (stage, precision), measured in measured_all.items():
            pred = predict_model_state_bytes(psi, stage=stage, dp=world, precision=precision)
            for key in ("params", "grads", "optimizer", "total"):
                assert measured[key] == pytest.approx(pred[key], rel=0.05), (stage, precision, key,
                                                                              measured, pred)


@pytest.mark.parametrize("mode,k", [("none", 1), ("full", 1), ("every_k", 2)])
def test_activation_prediction_matches_saved_tensors(mode, k):
    x, y = dp_batches(1)[0]
    model = apply_activation_checkpointing(dp_model(), mode, k)
    _, measured = saved_activation_bytes(model, x, y)
    shape = GPTShape(x.shape[0], DP_CFG.seq_len, DP_CFG.d_model, DP_CFG.n_head, DP_CFG.n_layer, DP_CFG.vocab_size)
    pred = predict_activation_bytes(shape, checkpointing=mode, k=k)
    # within 1%: the formula counts every saved activation; a few scalars are left out
    assert measured == pytest.approx(pred["saved"], rel=0.01)


def test_paper_accounting_and_table():
    psi = 1_000_000
    paper0 = predict_model_state_bytes(psi, stage=0, dp=4, precision="bf16", accounting="paper")
    assert (paper0["params"], paper0["grads"], paper0["optimizer"]) == (2 * psi, 2 * psi, 12 * psi)
    paper3 = predict_model_state_bytes(psi, stage=3, dp=4, precision="bf16", accounting="paper")
    assert paper3["total"] == 16 * psi // 4
    fp32_2 = predict_model_state_bytes(psi, stage=2, dp=4, precision="fp32", accounting="paper")
    assert (fp32_2["params"], fp32_2["grads"], fp32_2["optimizer"]) == (4 * psi, psi, 2 * psi)
    sgd = predict_model_state_bytes(psi, stage=0, dp=1, optimizer="sgd")
    assert sgd["optimizer"] == 4 * psi
    shape = GPTShape(16, 128, 128, 4, 4, 256)
    table = format_memory_table(psi, dp=4, stage=2, shape=shape, checkpointing="full")
    assert "optimizer states" in table and "activations (saved)" in table and "total" in table
    with pytest.raises(ValueError, match="stage must be 0..3"):
        predict_model_state_bytes(psi, stage=4, dp=2)
