"""Prices of hybrid sharding (HSDP), pipeline stages with ZeRO-1/2/3 and context parallelism (ring attention,
Ulysses) in ``plait.plan.layouts``; the step simulator and the planner use the first two (plait runs them) and
refuse or leave out the third. Exact: each price is its formula over ``collective_time``."""

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
from plait.plan.network import Group, collective_time, group_span
from plait.plan.params import param_list
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


def test_context_parallelism_is_simulated_and_planned_for_long_sequences(monkeypatch):
    """A cp rank is simulated as a data-parallel rank of its shard of the sequence (activations exactly 1 / cp
    for ring), with the ring's shifts priced; short sequences are not planned with cp, and a 512K-token
    sequence that fits no layout at cp=1 on 8 A100s is planned with cp > 1."""
    import plait.plan.planner as planner

    lay = Layout(dp=4, tp=2, cp=2, dp_shard=2)
    assert lay.world == 16 and "cp=2" in lay.describe() and "dp_shard=2" in lay.describe()
    shape = gpt_shape(4, 256, 4, 256, 1024)
    whole = simulate(Workload(shape, Layout(dp=2, micro_batch_size=1), 2), Cluster.of(A100, 2))
    split = simulate(Workload(shape, Layout(dp=1, cp=2, micro_batch_size=1), 1), Cluster.of(A100, 2))
    assert split.memory[0].activations == whole.memory[0].activations / 2
    assert split.as_dict()["context_parallel"]["comm_bytes_per_step"] > 0
    # a pipeline's ranks share the cp traffic: each sends its stages' blocks' (2 pipeline micro-batches of 1)
    piped = simulate(Workload(shape, Layout(dp=1, pp=2, cp=2, microbatches=2, micro_batch_size=2), 2),
                     Cluster.of(A100, 4)).as_dict()["context_parallel"]
    flat = simulate(Workload(shape, Layout(dp=1, cp=2, micro_batch_size=1), 2), Cluster.of(A100, 2))
    assert sum(piped["comm_bytes_per_step_by_pipeline_rank"]) == flat.as_dict()["context_parallel"][
        "comm_bytes_per_step"]
    assert len(piped["comm_bytes_per_step_by_pipeline_rank"]) == 2 and min(piped[
        "comm_bytes_per_step_by_pipeline_rank"]) > 0
    with pytest.raises(ConfigError, match="cp=2 is simulated with the flash attention kernel"):
        simulate(Workload(shape, Layout(dp=1, cp=2, micro_batch_size=1), 1, attention="unfused"), Cluster.of(A100, 2))
    with pytest.raises(ConfigError, match="needs zero=3"):
        simulate(Workload(shape, Layout(dp=4, zero=2, dp_shard=2, micro_batch_size=1), 4), Cluster.of(A100, 4))
    result = plan(shape, A100, 8, 16, top=40)
    assert all(s.work.layout.cp == 1 for s in result.ranked)
    long = gpt_shape(4, 1024, 4, 524288, 32000)
    best = plan(long, A100, 8, 8, top=4).best
    assert best.work.layout.cp > 1 and best.fits(), best.work.layout.describe()
    monkeypatch.setattr(planner, "LONG_SEQUENCE", 10**9)  # cp not considered: nothing fits
    with pytest.raises(ConfigError, match="no layout of 0.62B parameters fits 8 x a100-80gb"):
        plan(long, A100, 8, 8, top=2)


def test_simulator_prices_hsdp_states_and_collectives():
    """16 nodes of 8: FSDP over all 128 ranks against HSDP with shard groups of one node (dp_shard=8)."""
    shape = gpt_shape(24, 4096, 32, 50304, 2048)
    cluster = Cluster.of(A100, 128, nodes=16, devices_per_node=8)
    fsdp, hsdp = (simulate(Workload(shape, Layout(dp=128, zero=3, dp_shard=n, micro_batch_size=1), 128), cluster)
                  for n in (1, 8))
    psi = shape.param_count()
    assert fsdp.memory[0].model_states == pytest.approx(16 * psi / 128, rel=0.01)
    assert hsdp.memory[0].model_states == pytest.approx(16 * psi / 8, rel=0.01)  # 16 psi / dp_shard
    model = StageModel(Workload(shape, Layout(dp=128, zero=3, dp_shard=8, micro_batch_size=1), 128), cluster)
    node, replicas = model.placement.shard_group(8), model.placement.replica_group(8)
    assert node == list(range(8)) and replicas == list(range(0, 128, 8))

    def seconds(sim, name: str) -> float:
        return next(s.end - s.start for s in sim.timelines[0].spans if s.name == name)
    # the gathers stay on NVLink inside the node; the gradients are reduce-scattered there, then the eighth each
    # rank holds is all-reduced across the 16 replicas (one rank per node, on its own NIC share)
    unit = sum(p.local_numel(1) for p in param_list(shape, range(24), first=True, last=True) if p.layer == 0)
    node_g, replica_g = group_span(node, 8), group_span(replicas, 8)
    assert seconds(hsdp, "all-gather block 0 (backward)") == pytest.approx(
        collective_time(A100, "all_gather", 4 * unit, node_g))
    assert seconds(hsdp, "reduce-scatter block 0") == pytest.approx(
        hsdp_gradient_seconds(A100, 4 * unit, node_g, replica_g))
    assert seconds(hsdp, "all-gather block 0 (backward)") < seconds(fsdp, "all-gather block 0 (backward)")
    assert hsdp.as_dict()["layout"]["dp_shard"] == 8


def test_simulator_prices_pipelines_with_each_zero_stage():
    shape = gpt_shape(8, 1024, 16, 50304, 1024)
    cluster = Cluster.of(A100, 16, nodes=2, devices_per_node=8)
    sims = {z: simulate(Workload(shape, Layout(dp=8, pp=2, zero=z, microbatches=4, micro_batch_size=4), 64),
                        cluster) for z in range(4)}
    states = [sims[z].memory[0].model_states for z in range(4)]
    assert states[0] > states[1] > states[2] > states[3]  # each stage shards more of the stage's states
    assert sims[3].memory[0].params == pytest.approx(sims[0].memory[0].params / 8, rel=0.02)
    spans = {z: {s.name for s in sims[z].timelines[0].spans} for z in range(4)}
    assert "reduce-scatter the stage's gradients" in spans[3] and "all-gather the stage's units" in spans[3]
    assert any(name.startswith("all-gather bucket") for name in spans[1] | spans[2])


def test_planner_enumerates_hsdp_and_pipelines_with_zero():
    shape = gpt_shape(24, 2048, 16, 50304, 1024)
    result = plan(shape, A100, 16, 64, top=1000)  # every layout that fits, ranked: the test is about enumeration
    layouts = [s.work.layout for s in result.ranked]
    assert any(lay.pp > 1 and lay.zero in (1, 2) for lay in layouts)
    assert any(lay.pp > 1 and lay.zero == 3 for lay in layouts)
    assert any(lay.hybrid for lay in layouts)
    assert "zero=1-3 with pp>1" not in result.pruned and "zbv with zero=3" not in result.pruned
    # zbv over ZeRO-3 stages is screened like any layout (here none of zbv's fits: its weight passes keep more alive)
    assert any(" zbv " in name and "zero=3" in name for name in result.pruned)


def test_a_config_with_dp_shard_or_pipeline_zero_simulates_and_plans_to_a_runnable_config(tmp_path):
    from plait import recipes
    from plait.config import load_config
    from plait.plan.configured import simulate_config
    from plait.plan.planner import write_config
    from plait.validate import validate

    base = ["--model.n_layer=4", "--model.d_model=256", "--model.n_head=4", "--train.micro_batch_size=4",
            "--train.global_batch_size=32"]
    hsdp = simulate_config(load_config(overrides=[*base, "--parallel.nproc=8", "--parallel.zero=3",
                                                  "--parallel.dp_shard=2"]), A100, derive_tp=False, models=recipes)
    fsdp = simulate_config(load_config(overrides=[*base, "--parallel.nproc=8", "--parallel.zero=3"]), A100,
                           derive_tp=False, models=recipes)
    assert hsdp.work.layout.dp_shard == 2 and hsdp.work.layout.hybrid
    assert hsdp.memory[0].model_states == pytest.approx(4 * fsdp.memory[0].model_states, rel=0.01)
    pp = simulate_config(load_config(overrides=[*base, "--parallel.nproc=4", "--parallel.pp=2", "--parallel.zero=2"]),
                         A100, derive_tp=False, models=recipes)
    assert (pp.work.layout.pp, pp.work.layout.zero) == (2, 2)
    for sim in (hsdp, pp):  # what plait plan --write writes, plait train accepts as it is
        write_config(sim, load_config(overrides=base), str(tmp_path / "best.toml"))
        cfg = validate(load_config(tmp_path / "best.toml"), sim.work.layout.world)
        assert (cfg.parallel.dp_shard, cfg.parallel.zero, cfg.parallel.pp) == (
            2 if sim is hsdp else 0, sim.work.layout.zero, sim.work.layout.pp)
