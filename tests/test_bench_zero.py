"""bench/zero.py's pure helpers: its config validates at both dp sizes, rank records merge, rounds pool,
ratios pair each plait stage with its peer, and DeepSpeed's state counter counts shared storage once.
The benchmark itself spawns many rank groups and is run by hand (see its docstring)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import _zero_deepspeed  # noqa: E402
import zero  # noqa: E402

from plait.config import load_config, validate  # noqa: E402


def _rank(step_s, total, peak, loss=1.0):
    state = {"params": total // 2, "grads": total // 4, "optimizer": total // 4, "total": total}
    return {"step_s": step_s, "final_loss": loss, "model_state": state, "peak_rss": peak,
            "peak_above_baseline": peak - 10}


@pytest.mark.parametrize("dp", [2, 4])
def test_overrides_validate_one_micro_batch_per_rank(dp):
    cfg = validate(load_config(overrides=zero.overrides(dp)), dp)
    assert cfg.parallel.dp == dp and cfg.grad_accum == 1
    assert (cfg.model.n_layer, cfg.model.d_model, cfg.model.seq_len) == (4, 256, 64)


def test_merge_takes_slowest_rank_per_step_and_keeps_per_rank_memory():
    merged = zero.merge_ranks([_rank([1.0, 3.0], 100, 500, loss=2.5), _rank([2.0, 1.0], 120, 400)])
    assert merged["step_s"] == [2.0, 3.0]
    assert merged["model_state_bytes"] == [100, 120]
    assert merged["final_loss"] == 2.5 and merged["peak_above_baseline_bytes"] == [490, 390]


def test_summarize_pools_rounds_for_the_median():
    a = zero.merge_ranks([_rank([1.0, 5.0], 100, 500)])
    b = zero.merge_ranks([_rank([2.0], 100, 700)])
    s = zero.summarize([a, b])
    assert s["step_s"] == 2.0 and s["step_samples"] == 3
    assert s["model_state_bytes_max"] == 100 and s["peak_rss_bytes_max"] == 700


def test_ratios_pair_stages_with_peers_and_skip_missing_or_failed():
    results = {"plait1": zero.summarize([zero.merge_ranks([_rank([1.0], 80, 300)])]),
               "zero_redundancy": zero.summarize([zero.merge_ranks([_rank([2.0], 100, 300)])]),
               "deepspeed1": zero.summarize([zero.merge_ranks([_rank([0.5], 40, 300)])]),
               "plait2": "failed: boom", "fsdp_no_reshard": zero.summarize([zero.merge_ranks([_rank([1.0], 1, 1)])])}
    r = zero.ratios(results)
    assert set(r) == {"stage1_vs_zero_redundancy", "stage1_vs_deepspeed1"}
    assert r["stage1_vs_zero_redundancy"]["model_state_ratio"] == 0.8
    assert r["stage1_vs_zero_redundancy"]["step_time_ratio"] == 0.5
    assert r["stage1_vs_zero_redundancy"]["meets_memory_target"] and r["stage1_vs_zero_redundancy"]["meets_time_target"]
    assert not r["stage1_vs_deepspeed1"]["meets_memory_target"]
    assert not r["stage1_vs_deepspeed1"]["meets_time_target"]


def test_deepspeed_counter_counts_each_storage_once():
    module = torch.nn.Linear(4, 4)  # 16 + 4 floats
    flat_grad = torch.zeros(10)
    master = torch.zeros(10)
    states = {"exp_avg": torch.zeros(10), "exp_avg_sq": torch.zeros(10)}
    ds_opt = SimpleNamespace(averaged_gradients={0: [flat_grad[:5], flat_grad[5:]]},
                             single_partition_of_fp32_groups=[master, master[:3]],
                             optimizer=SimpleNamespace(state={master: states}))
    got = _zero_deepspeed.deepspeed_state_bytes(module, ds_opt)
    assert got == {"params": 80, "grads": 40, "optimizer": 40 + 80, "total": 80 + 40 + 120}
