"""Tensor and sequence parallelism against single-process training (tolerances: see references)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from helpers import run_ranks
from references import (
    MP_LOSS_ATOL,
    MP_PARAM_ATOL,
    allreduce_grads_mean,
    max_param_diff,
    mean_over,
    mp_batches,
    mp_config,
    mp_optimizer,
    mp_reference,
)

from plait.models.gpt.parallelize import check_tensor_parallel
from plait.models.tiny import seeded_gpt
from plait.parallel.tensor.plan import (
    TensorParallelError,
    full_state_dict,
    local_value,
    loss_context,
)


def _train_tp(cfg, data, tp_mesh, sp: bool, dp_group=None) -> tuple[list[float], object]:
    from plait.models.gpt.parallelize import apply_tensor_parallel

    model = apply_tensor_parallel(seeded_gpt(cfg), tp_mesh, sequence_parallel=sp)
    assert model.head.weight is model.tok_emb.weight
    opt = mp_optimizer(model.parameters())
    losses = []
    for idx, tgt in data:
        with loss_context(model):
            loss = model(idx, tgt)
            loss.backward()
        if dp_group is not None:
            allreduce_grads_mean(model.parameters(), dp_group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = local_value(loss.detach()).item()
        losses.append(mean_over(value, dp_group) if dp_group is not None else value)
    return losses, model


def _activation_bytes(cfg, tp_mesh, sp: bool) -> int:
    """Live bytes saved for backward after one forward of a (B=4, T=16) batch."""
    from plait.models.gpt.parallelize import apply_tensor_parallel
    from plait.parallel.memory import SavedTensorMeter

    model = apply_tensor_parallel(seeded_gpt(cfg), tp_mesh, sequence_parallel=sp)
    idx, tgt = mp_batches(4, steps=1, seed=5)[0]
    with loss_context(model), SavedTensorMeter() as meter:
        loss = model(idx, tgt)
        held = meter.live
        loss.backward()
    return held


def _tp2_worker(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    cfg = mp_config()
    data = mp_batches(4)
    ref_losses, ref_state = mp_reference(cfg, data)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    out: dict = {"ref": ref_losses}
    for sp in (False, True):
        losses, model = _train_tp(cfg, data, mesh["tp"], sp)
        state = full_state_dict(model)
        out[sp] = {"losses": losses, "diff": max_param_diff(state, ref_state),
                   "keys_match": sorted(state) == sorted(ref_state),
                   "shapes_match": all(state[k].shape == ref_state[k].shape for k in ref_state)}
    out["bytes"] = {sp: _activation_bytes(cfg, mesh["tp"], sp) for sp in (False, True)}
    return out


@pytest.fixture(scope="module")
def tp2_results() -> list[dict]:
    return run_ranks(_tp2_worker, 2)


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
def test_tp2_matches_single_process(tp2_results, sp):
    for res in tp2_results:
        assert res[sp]["losses"] == pytest.approx(res["ref"], abs=MP_LOSS_ATOL)
        assert res[sp]["diff"] < MP_PARAM_ATOL
        assert res[sp]["keys_match"] and res[sp]["shapes_match"]


def test_sequence_parallel_saves_activation_memory(tp2_results):
    for res in tp2_results:
        tp_bytes, sp_bytes = res["bytes"][False], res["bytes"][True]
        assert sp_bytes < tp_bytes, (sp_bytes, tp_bytes)


def _dp2_tp2_worker(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    cfg = mp_config()
    data = mp_batches(8)
    ref_losses, ref_state = mp_reference(cfg, data)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    local = [(i[dp_rank * 4:(dp_rank + 1) * 4], t[dp_rank * 4:(dp_rank + 1) * 4]) for i, t in data]
    losses, model = _train_tp(cfg, local, mesh["tp"], sp=True, dp_group=mesh["dp"].get_group())
    dist.barrier()
    return {"ref": ref_losses, "losses": losses, "diff": max_param_diff(full_state_dict(model), ref_state)}


def test_dp2_tp2_matches_single_process():
    for res in run_ranks(_dp2_tp2_worker, 4):
        assert res["losses"] == pytest.approx(res["ref"], abs=MP_LOSS_ATOL)
        assert res["diff"] < MP_PARAM_ATOL


def test_heads_not_divisible_by_tp_is_a_clear_error():
    with pytest.raises(TensorParallelError, match="n_head=4 does not divide by parallel.tp=3"):
        check_tensor_parallel(n_head=4, d_model=32, vocab_size=258, seq_len=18, tp=3, sequence_parallel=False)
    with pytest.raises(TensorParallelError, match="seq_len=15"):
        check_tensor_parallel(n_head=4, d_model=32, vocab_size=256, seq_len=15, tp=2, sequence_parallel=True)
    assert issubclass(TensorParallelError, ValueError)
    check_tensor_parallel(n_head=4, d_model=32, vocab_size=256, seq_len=16, tp=2, sequence_parallel=True)
