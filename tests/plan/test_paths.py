"""Per-event costs of plait's code paths (``plait.plan.calibrate_paths``) and ZBV's kept activations.

A synthetic calibrated profile (round numbers, no measurement) makes every figure exact: each per-event
constant must add itself once per event the simulator prices (tensor-parallel collectives recorded from
the real plan, FSDP2 unit collectives, optimizer steps on DTensors, pipeline actions); the calibration
procedure must recover constants from runs that obey the model; ZBV's split backward must keep the
attention core's and the loss's saved tensors of every micro-batch until the step ends.
"""

from __future__ import annotations

import os

import pytest

from plait.config import load_config
from plait.plan import record
from plait.plan.calibrate import _render, write_overheads
from plait.plan.calibrate_paths import PATHS, TINY, calibrate_paths, residual_constant, with_overhead
from plait.plan.configured import simulate_config
from plait.plan.hardware import load_profile
from plait.plan.network import COLLECTIVES
from plait.plan.ops import MEMORY_KINDS
from plait.plan.params import param_list

H = 1e-3  # a probe constant: 1 ms per event


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    dims = (32, 512, 2048)
    matmul = [["fp32", 1, m, n, k, 2 * m * n * k / 1e10] for m in dims for n in dims for k in dims]
    kernels = [[kind, 1, b, b / 1e10] for kind in MEMORY_KINDS for b in (10_000, 100_000_000)]
    attention = [[1, 16, 128, 32, 1e-3, 2e-3], [1, 16, 512, 64, 2e-2, 4e-2]]
    overhead = {"op": {"1": 2e-6}, "autograd": {"1": 5e-6}, "dtensor": {"1": 0.0}}
    collectives = [{"op": op, "world": w, "alpha_s": 1e-4, "beta_s_per_byte": 1e-9, "samples": [[4096, 1e-4]]}
                   for op in COLLECTIVES for w in (2, 4) if op != "send" or w == 2]
    path = tmp_path_factory.mktemp("profile") / "synthetic.toml"
    path.write_text(_render(matmul, kernels, attention, overhead, collectives, [1], 2, True))
    return load_profile(path)


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _slope(cfg, profile, key: str) -> float:
    """Seconds the step grows by per second of the ``key`` constant (events on the critical path)."""
    return (simulate_config(cfg, with_overhead(profile, key, H)).step_s
            - simulate_config(cfg, with_overhead(profile, key, 0.0)).step_s) / H


def test_a_profile_without_the_code_path_constants_prices_them_at_zero(profile):
    for key in ("dtensor", "tp_collective", "fsdp_unit", "pipeline_action"):
        assert profile.calibration.overhead[key] == {1: 0.0}
    cfg = load_config(None, TINY + PATHS["pipeline_action"])
    assert _slope(cfg, profile, "fsdp_unit") == 0.0  # a layout without the path: no event


def test_tp_collective_cost_counts_every_recorded_collective_once(profile):
    cfg = load_config(None, TINY + PATHS["tp_collective"])
    sim = simulate_config(cfg, profile)
    block, rest = record.tp_collectives(cfg, sim.work.pipe_micro_batch)
    per_micro_step = cfg.model.n_layer * len(block) + len(rest)
    assert per_micro_step == 2 * 4 + 5  # 2 blocks x (2 forward + 2 backward all-reduces) + embedding and loss
    assert _slope(cfg, profile, "tp_collective") == pytest.approx(sim.work.accumulation * per_micro_step, rel=1e-6)


def test_fsdp_unit_cost_counts_each_gather_and_reduce_scatter(profile):
    cfg = load_config(None, TINY + PATHS["fsdp_unit"])
    work = simulate_config(cfg, profile).work
    n = cfg.model.n_layer
    gathers = (n + 1) + (n if work.layout.reshard_after_forward else 0)  # root and blocks; blocks again in backward
    events = work.accumulation * gathers + (n + 1)  # reduce-scatters once, on the last micro-step
    assert _slope(cfg, profile, "fsdp_unit") == pytest.approx(events, rel=1e-6)


def test_step_cost_is_charged_once_per_optimizer_step(profile):
    """plait's per-step host work adds once per step: at world 1 with accumulation, and on every pipeline rank
    (they step side by side)."""
    for overrides in (PATHS["step"], PATHS["pipeline_action"], PATHS["fsdp_unit"]):
        assert _slope(load_config(None, TINY + overrides), profile, "step") == pytest.approx(1.0, rel=1e-6)


def test_dtensor_cost_covers_the_optimizer_steps_on_fsdp_shards(profile):
    cfg = load_config(None, TINY + PATHS["fsdp_unit"])
    sim = simulate_config(cfg, profile)
    ops_per_tensor = record.optimizer_traffic(cfg)[0]
    tensors = len(param_list(sim.work.shape, range(cfg.model.n_layer), first=True, last=True))
    per_tensor = ops_per_tensor + (3 if sim.work.grad_clip else 0)
    assert _slope(cfg, profile, "dtensor") == pytest.approx(per_tensor * tensors, rel=1e-6)


def test_pipeline_action_cost_lies_between_one_rank_s_actions_and_all_of_them(profile):
    cfg = load_config(None, TINY + PATHS["pipeline_action"])
    work = simulate_config(cfg, profile).work
    per_rank = 2 * work.layout.microbatches * work.accumulation  # F and B of every micro-batch
    assert per_rank <= _slope(cfg, profile, "pipeline_action") <= 2 * per_rank


def test_residual_constant_inverts_a_linear_prediction():
    assert residual_constant(0.5 + 40 * 3e-4, lambda c: 0.5 + 40 * c) == pytest.approx(3e-4)
    assert residual_constant(0.4, lambda c: 0.5 + 40 * c) == 0.0  # measured below the prediction: no cost
    assert residual_constant(0.9, lambda c: 0.5) == 0.0  # no event on the path


def test_calibration_recovers_the_constants_of_runs_that_follow_the_model(profile, tmp_path):
    truth = {"dtensor": 2e-5, "step": 3e-3, "tp_collective": 7e-4, "fsdp_unit": 1.5e-3, "pipeline_action": 9e-4}
    full = profile
    for key, value in truth.items():
        full = with_overhead(full, key, value)

    def measure(overrides):
        if overrides == ["dtensor"]:
            return truth["dtensor"]
        return simulate_config(load_config(None, TINY + overrides), full).step_s

    found = calibrate_paths(profile, log=lambda s: None, measure=measure)
    assert os.environ["OMP_NUM_THREADS"] == "1"  # restored to what it was
    for key, value in truth.items():
        assert found[key] == pytest.approx(value, rel=1e-6), key
    path = tmp_path / "p.toml"
    path.write_text(open(profile.source).read())
    write_overheads(path, found)
    again = load_profile(path).calibration.overhead
    for key, value in truth.items():
        assert again[key][1] == pytest.approx(value, rel=1e-5)
    assert again["op"] == profile.calibration.overhead["op"]  # the other rows stay


def test_zbv_keeps_the_attention_core_and_log_probabilities_until_the_step_ends(profile):
    """The kept sets of ``plait.plan.schedule`` (measured there) summed per rank: they stay until the step ends, so
    two accumulation steps hold the first one's kept tensors on top of the second's peak."""
    base = ["--model.n_layer=4", "--model.d_model=64", "--model.n_head=2", "--model.seq_len=32",
            "--parallel.nproc=2", "--parallel.pp=2", "--parallel.microbatches=4", "--parallel.pp_schedule=zbv",
            "--train.micro_batch_size=8"]
    one = simulate_config(load_config(None, base + ["--train.global_batch_size=8"]), profile)
    two = simulate_config(load_config(None, base + ["--train.global_batch_size=16"]), profile)
    assert (one.work.accumulation, two.work.accumulation) == (1, 2)
    mb, T, C, H_, V = one.work.pipe_micro_batch, 32, 64, 2, one.work.shape.vocab_size
    attention = 4 * mb * T * C * 4 + mb * H_ * T * 4  # q, k, v, output; log-sum-exp (fp32)
    log_probs, gelu_input = mb * T * V * 4, mb * T * 4 * C * 4
    # rank 0 holds stages 0 and 3 (a V): one block each, the head on stage 3. The first stage keeps nothing (its
    # weight pass is its whole backward); the last also keeps its GELU's input (measured on plait's runs)
    kept_rank0 = one.work.layout.microbatches * (attention + log_probs + gelu_input)
    kept_rank1 = one.work.layout.microbatches * 2 * attention
    assert two.memory[0].activations - one.memory[0].activations == pytest.approx(kept_rank0)
    assert two.memory[1].activations - one.memory[1].activations == pytest.approx(kept_rank1)
    f1b = [b.replace("zbv", "1f1b") for b in base]
    two_f1b = simulate_config(load_config(None, f1b + ["--train.global_batch_size=16"]), profile)
    one_f1b = simulate_config(load_config(None, f1b + ["--train.global_batch_size=8"]), profile)
    assert two_f1b.memory[0].activations == one_f1b.memory[0].activations  # a full backward frees everything
