"""Pipeline parallelism composed on one device mesh: pp=4, dp x pp, tp x pp, and dp x tp x pp.

Data parallelism here is a plain gradient all-reduce over the dp group in the test loop. Tolerances:
see references.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from helpers import run_ranks
from references import MP_LOSS_ATOL, MP_PARAM_ATOL, max_param_diff, mp_batches, mp_config, mp_reference, train_pipeline

from plait.models.tiny import seeded_gpt


def _dp_slice(data, dp_rank: int, dp: int):
    n = data[0][0].size(0) // dp
    return [(i[dp_rank * n:(dp_rank + 1) * n], t[dp_rank * n:(dp_rank + 1) * n]) for i, t in data]


def _result(losses, runner, ref_losses, ref_state) -> dict:
    return {"losses": losses, "ref": ref_losses, "diff": max_param_diff(runner.state_dict(), ref_state),
            "blocks": sorted(int(k) for m in runner.modules for k in m.blocks)}


def _pp4_costed(cfg, data, ref) -> dict:
    from plait.parallel.pipeline.runner import measure_layer_costs

    costs = measure_layer_costs(seeded_gpt(cfg), *mp_batches(2, steps=1, seed=9)[0], repeats=1)
    group = dist.new_group(list(range(4)))
    losses, runner = train_pipeline(cfg, data, group, "1f1b", microbatches=4, costs=costs)
    return _result(losses, runner, *ref) | {"costs": costs}


def _four_rank_worker(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    cfg6 = mp_config(n_layer=6)
    data = mp_batches(8)
    out["pp4"] = _pp4_costed(cfg6, data, mp_reference(cfg6, data))
    cfg = mp_config()
    ref = mp_reference(cfg, data)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    local = _dp_slice(data, mesh["dp"].get_local_rank(), 2)
    losses, runner = train_pipeline(cfg, local, mesh["pp"].get_group(), "1f1b", 2, dp_group=mesh["dp"].get_group())
    out["dp2_pp2"] = _result(losses, runner, *ref)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    losses, runner = train_pipeline(cfg, data, mesh["pp"].get_group(), "interleaved", 4, tp_mesh=mesh["tp"])
    out["tp2_pp2"] = _result(losses, runner, *ref)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def four_rank_results() -> list[dict]:
    return run_ranks(_four_rank_worker, 4, timeout=300)


def _check(results: list[dict], layout: str) -> None:
    last_losses = [r[layout]["losses"] for r in results if r[layout]["losses"][0] is not None]
    assert last_losses, "no rank reported the loss"
    for losses in last_losses:
        assert losses == pytest.approx(results[0][layout]["ref"], abs=MP_LOSS_ATOL)
    for r in results:
        assert r[layout]["diff"] < MP_PARAM_ATOL


def test_pp4_1f1b_with_measured_costs_matches_single_process(four_rank_results):
    _check(four_rank_results, "pp4")
    owned = sorted(b for r in four_rank_results for b in r["pp4"]["blocks"])
    assert owned == list(range(6))  # every block on exactly one stage


def test_dp2_pp2_matches_single_process(four_rank_results):
    _check(four_rank_results, "dp2_pp2")


def test_tp2_pp2_matches_single_process(four_rank_results):
    _check(four_rank_results, "tp2_pp2")


def _eight_rank_worker(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    cfg = mp_config()
    data = mp_batches(8)
    ref = mp_reference(cfg, data)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    local = _dp_slice(data, mesh["dp"].get_local_rank(), 2)
    losses, runner = train_pipeline(cfg, local, mesh["pp"].get_group(), "1f1b", 2,
                               dp_group=mesh["dp"].get_group(), tp_mesh=mesh["tp"])
    dist.barrier()
    return {"dp2_tp2_pp2": _result(losses, runner, *ref)}


@pytest.mark.slow
def test_dp2_tp2_pp2_matches_single_process():
    _check(run_ranks(_eight_rank_worker, 8, timeout=400), "dp2_tp2_pp2")
