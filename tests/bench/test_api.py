"""bench/api.py: its ``--quick`` path end to end on 2 gloo ranks, and its pure helpers.

The quick run trains a tiny Llama (2 layers, hidden 32) for 3 steps in all seven ways and checks the
record: every implementation, finite positive step times, the ratio keys and the 1.02x flags derived
from them, and final losses that agree within ``QUICK_LOSS_ATOL``. The maths is the same in every
implementation and the first steps differ at most by float32 rounding of the reductions, so 1e-4 is
far above what they differ by (0 measured, torch 2.13 CPU) and far below what 3 AdamW steps at lr 1e-3
move the loss (~0.03). Speed itself is not asserted (DESIGN.md: measured in bench/, never in a test).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import api  # noqa: E402

QUICK_LOSS_ATOL = 1e-4


@pytest.fixture(scope="module")
def quick() -> dict:
    return api.run_bench(api.QUICK)


def test_quick_run_reports_every_implementation_with_positive_step_times(quick) -> None:
    json.dumps(quick)  # what main() prints must be JSON
    assert set(quick["results"]) == set(api.IMPLS)
    assert set(quick["machine"]) == {"backend", "torch", "machine"}
    samples = api.QUICK.rounds * api.QUICK.per_round
    for name, rec in quick["results"].items():
        assert rec["samples"] == len(rec["step_s"]) == samples, name
        assert all(math.isfinite(t) and t > 0 for t in rec["step_s"]), name
        assert 0 < rec["min_s"] <= rec["q1_s"] <= rec["median_s"] <= rec["q3_s"] <= rec["max_s"], name


def test_quick_run_reports_ratios_and_flags_from_the_medians(quick) -> None:
    assert set(quick["ratios"]) == set(quick["ratios_paired_by_round"]) == set(api.RATIOS)
    res = quick["results"]
    for key, (mine, peer) in api.RATIOS.items():
        assert quick["ratios"][key] == pytest.approx(res[mine]["median_s"] / res[peer]["median_s"])
        assert math.isfinite(quick["ratios_paired_by_round"][key]) and quick["ratios_paired_by_round"][key] > 0
    assert quick["api_within_1.02x_of_ddp"] is (quick["ratios"]["api/ddp"] <= 1.02)
    assert quick["trainer_within_1.02x_of_ddp"] is (quick["ratios"]["trainer/ddp"] <= 1.02)


def test_quick_run_final_losses_agree_across_implementations(quick) -> None:
    finals = {name: rec["final_loss"] for name, rec in quick["results"].items()}
    assert all(math.isfinite(v) for v in finals.values()), finals
    assert max(finals.values()) - min(finals.values()) <= QUICK_LOSS_ATOL, finals
    assert quick["final_losses_agree"]
    for name, rec in quick["results"].items():
        assert rec["loss_max_abs_diff_vs_ddp"] <= QUICK_LOSS_ATOL, name
        assert rec["first_loss"] - rec["final_loss"] > 100 * QUICK_LOSS_ATOL, name  # it trained


def _ranks(times: dict[str, list[float]], loss: float = 2.0) -> dict:
    return {"times": times, "losses": {name: [loss] * len(ts) for name, ts in times.items()}}


def test_summary_takes_the_slowest_rank_and_flags_a_slow_api_as_missing_the_target() -> None:
    s = api.Setup(hidden=8, intermediate=8, layers=1, heads=1, seq_len=4, micro=1, warmup=0, rounds=3, per_round=1)
    fast = {name: [1.0, 1.0, 1.0] for name in api.IMPLS}
    slow = {**fast, "api": [1.05, 1.1, 1.0], "trainer": [1.01, 0.5, 1.02]}
    out = api.summarize([_ranks(fast), _ranks(slow, loss=2.0 + 1e-6)], s)
    assert out["results"]["api"]["step_s"] == [1.05, 1.1, 1.0]  # per step, the slower of the two ranks
    assert out["ratios"]["api/ddp"] == pytest.approx(1.05) and not out["api_within_1.02x_of_ddp"]
    assert out["ratios"]["trainer/ddp"] == pytest.approx(1.01) and out["trainer_within_1.02x_of_ddp"]
    assert out["results"]["ddp"]["final_loss"] == pytest.approx(2.0 + 5e-7)  # mean over ranks
    assert out["final_losses_agree"]


def test_peer_data_gives_each_rank_what_plaits_loader_gives_it_at_every_step() -> None:
    from torch.utils.data import DataLoader, DistributedSampler

    from plait.data.loader import DistributedLoader

    s = api.QUICK
    windows = api.corpus_windows(s)
    mine, theirs = api.CausalLMData(windows), api.peer_data(windows, s)
    for rank in range(api.WORLD):
        plait_loader = DistributedLoader(mine, s.micro, dp_rank=rank, dp_size=api.WORLD, seed=api.SEED)
        sampler = DistributedSampler(theirs, num_replicas=api.WORLD, rank=rank, shuffle=False)
        torch_loader = DataLoader(theirs, batch_size=s.micro, sampler=sampler, drop_last=True)
        pairs = list(zip(plait_loader, torch_loader, strict=True))
        assert len(pairs) == s.total_steps
        for a, b in pairs:
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
