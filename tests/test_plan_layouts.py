"""Prices of the layouts plait does not run yet (``plait.plan.layouts``): HSDP, pipeline stages with ZeRO-1/2/3,
context parallelism (ring attention, Ulysses); the planner's ``Layout`` holds ``dp_shard`` and ``cp`` but neither
enumerates them nor simulates them. Exact: each price is its formula over ``collective_time``."""

from __future__ import annotations

import pytest

from plait.config import ConfigError
from plait.plan.hardware import load_profile
from plait.plan.layouts import (
    context_parallel_activations,
    hsdp_gather_seconds,
    hsdp_gradient_seconds,
    hsdp_states,
    pipeline_zero,
    ring_attention,
    sharded_states,
    ulysses,
)
from plait.plan.memory import predict_model_state_bytes
from plait.plan.network import Group, collective_time
from plait.plan.planner import plan
from plait.plan.shapes import gpt_shape
from plait.plan.simulate import simulate
from plait.plan.stages import Cluster, StageModel
from plait.plan.workload import Layout, Workload

A100 = load_profile("a100-80gb")
NODE = Group(size=8, nodes=1, per_node=8)
ACROSS = Group(size=16, nodes=16, per_node=1)
PSI = 1_000_000


def test_hsdp_holds_16_psi_over_its_shard_group():
    for dp_shard in (1, 8, 64):
        assert hsdp_states(PSI, (4, 4, 8), dp_shard).total == pytest.approx(16 * PSI / dp_shard)
    # each ZeRO stage as plait.plan.memory's table (fp32 AdamW)
    for zero in range(4):
        table = predict_model_state_bytes(PSI, stage=zero, dp=8)
        states = sharded_states(PSI, (4, 4, 8), zero, 8)
        assert (states.params, states.grads, states.optimizer) == pytest.approx(
            (table["params"], table["grads"], table["optimizer"]), abs=8)
    with pytest.raises(ValueError, match="ZeRO stage"):
        sharded_states(PSI, (4, 4, 8), 4, 8)


def test_hsdp_reduce_scatters_in_the_shard_group_and_all_reduces_the_shard_across_replicas():
    grads = 4.0 * 2**30
    seconds = hsdp_gradient_seconds(A100, grads, NODE, ACROSS)
    assert seconds == pytest.approx(collective_time(A100, "reduce_scatter", grads, NODE)
                                    + collective_time(A100, "all_reduce", grads / 8, ACROSS))
    assert hsdp_gather_seconds(A100, grads / 2, NODE) == collective_time(A100, "all_gather", grads / 2, NODE)
    # what HSDP buys: the per-forward gathers stay on NVLink instead of crossing 16 nodes' NICs
    everywhere = Group(size=128, nodes=16, per_node=8)
    assert hsdp_gather_seconds(A100, grads / 2, NODE) < hsdp_gather_seconds(A100, grads / 2, everywhere)


def test_pipeline_stages_compose_with_each_zero_stage():
    numel, dp = 2e9, Group(size=8, nodes=8, per_node=1)
    ar = collective_time(A100, "all_reduce", 2 * numel, dp)
    rs = collective_time(A100, "reduce_scatter", 2 * numel, dp)
    ag = collective_time(A100, "all_gather", 2 * numel, dp)
    assert pipeline_zero(A100, 0, numel, 2, 2, dp).after == ar
    one, two = pipeline_zero(A100, 1, numel, 2, 2, dp), pipeline_zero(A100, 2, numel, 2, 2, dp)
    assert (one.after, one.after_step) == (ar, ag) and (two.after, two.after_step) == (rs, ag)
    three = pipeline_zero(A100, 3, numel, 2, 2, dp)
    assert (three.before, three.per_action, three.after) == (ag, 0.0, rs)
    assert pipeline_zero(A100, 3, numel, 2, 2, dp, reshard_after_forward=True).per_action == ag


def test_the_simulator_prices_pipeline_stages_under_zero_3():
    """pp=2 x dp=4 at ZeRO-3: each stage's states are sharded four ways, its units gathered before its first
    action (and again before every forward and backward when resharding), its gradients reduce-scattered once."""
    shape = gpt_shape(8, 2048, 16, 1024, 51200)
    base = Layout(dp=4, pp=2, microbatches=8, micro_batch_size=8, recompute="full")
    cluster = Cluster.of(A100, 8)
    sims = {(z, r): simulate(Workload(shape, Layout(**{**base.__dict__, "zero": z, "reshard_after_forward": r}), 32,
                                      precision="bf16"), cluster) for z, r in ((0, False), (3, False), (3, True))}
    dense, kept, resharded = sims[(0, False)], sims[(3, False)], sims[(3, True)]
    assert kept.memory[0].model_states == pytest.approx(dense.memory[0].model_states / 4, rel=0.01)
    gather = [s for s in kept.timelines[0].spans if s.name == "all-gather the stage's units"]
    assert len(gather) == 1 and kept.exposed()["fsdp"] > 0
    assert resharded.step_s > kept.step_s  # every forward and backward of every micro-batch gathers again


def test_context_parallelism_splits_activations_and_prices_ring_and_ulysses():
    shape = gpt_shape(2, 8192, 64, 32768, 51200)
    block = StageModel(Workload(shape, Layout(), 1, precision="bf16"), Cluster.of(A100, 1)).block(0)
    assert context_parallel_activations(block.saved, 8) == block.saved / 8
    cp = NODE
    kv = 2 * 1 * (32768 // 8) * shape.kv_dim * 2
    slow = ring_attention(A100, 1, 32768, shape.kv_dim, 1, 2, cp, attention_fwd_s=0.0, attention_bwd_s=0.0)
    step = collective_time(A100, "send", kv, cp)
    assert slow.bytes_fwd == 7 * kv and slow.bytes_bwd == 14 * kv
    assert slow.exposed_fwd == pytest.approx(7 * step)
    hidden = ring_attention(A100, 1, 32768, shape.kv_dim, 1, 2, cp, attention_fwd_s=1.0, attention_bwd_s=2.0)
    assert hidden.exposed_fwd == hidden.exposed_bwd == 0.0
    uly = ulysses(A100, 1, 32768, shape.d_model, shape.kv_dim, 1, 2, cp)
    sizes = [4096 * w * 2 for w in (8192, 8192, 8192, 8192)]  # multi-head: kv_dim == d_model
    assert uly.bytes_fwd == sum(sizes)
    assert uly.exposed_fwd == pytest.approx(sum(collective_time(A100, "all_to_all", b, cp) for b in sizes))


def test_layout_holds_dp_shard_and_cp_that_the_planner_neither_enumerates_nor_simulates():
    lay = Layout(dp=4, tp=2, cp=2, dp_shard=2)
    assert lay.world == 16 and "cp=2" in lay.describe() and "dp_shard=2" in lay.describe()
    shape = gpt_shape(4, 256, 4, 256, 1024)
    with pytest.raises(ConfigError, match="context parallelism"):
        simulate(Workload(shape, Layout(dp=2, cp=2, micro_batch_size=1), 2), Cluster.of(A100, 4))
    with pytest.raises(ConfigError, match="HSDP"):
        simulate(Workload(shape, Layout(dp=4, zero=3, dp_shard=2, micro_batch_size=1), 4), Cluster.of(A100, 4))
    result = plan(shape, A100, 8, 16, top=40)
    assert all(s.work.layout.cp == 1 and s.work.layout.dp_shard == 1 for s in result.ranked)
