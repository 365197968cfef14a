"""The simulator prices, and the planner searches, the layouts that compose: context parallelism with pipelines,
with experts and with hybrid sharding, ZeRO-1/2 with tensor parallelism, fp8 (float8 Linears at the profile's fp8
peak, FSDP2's float8 all-gather), and DiLoCo's outer synchronisation. Each price is checked against its formula over
``collective_time`` and the operators' roofline, computed here by hand (exact, or to float rounding)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from plait.config import ConfigError
from plait.plan.derive import fsdp_shard_numel, zero_buckets
from plait.plan.hardware import load_profile
from plait.plan.layouts import hsdp_gradient_seconds
from plait.plan.network import Group, collective_time, group_span
from plait.plan.params import param_list
from plait.plan.shapes import gpt_shape
from plait.plan.simulate import OUTER_BYTES_PER_ELEMENT, simulate
from plait.plan.stages import Cluster, StageModel
from plait.plan.workload import Layout, Workload

A100, H100 = load_profile("a100-80gb"), load_profile("h100-sxm")
SHAPE = gpt_shape(4, 256, 4, 256, 1024)  # plait's GPT: learned positions, so every activation is token-sized


def _seconds(sim, name: str, rank: int = 0) -> float:
    return sum(s.end - s.start for s in sim.timelines[rank].spans if s.name == name)


def test_cp_with_pp_prices_each_stage_on_its_shard():
    """pp=2 x cp=2 against pp=2 alone on the same pipeline micro-batches: every stage's activations are exactly half
    (each token-sized tensor split in two, the schedule's in-flight micro-batches the same), each pipeline rank's
    ring traffic is its blocks' shifts, and the bubble is the schedule's."""
    m, layers = 4, SHAPE.n_layer // 2
    piped = Layout(dp=1, pp=2, microbatches=m, micro_batch_size=m)
    whole = simulate(Workload(SHAPE, replace(piped, dp=2), 2 * m), Cluster.of(A100, 4))
    split = simulate(Workload(SHAPE, replace(piped, cp=2), m), Cluster.of(A100, 4))
    for r in (0, 1):
        assert split.memory[r].activations == whole.memory[r].activations / 2
    # ring, fp32 blocks: forward cp - 1 shifts of K and V, backward cp - 1 more and cp of their gradients
    kv = 1 * SHAPE.n_head * (SHAPE.seq_len // 2) * SHAPE.head_dim  # one pipeline micro-batch of one sequence
    per_layer = (2 - 1) * 2 * kv * 4 + (2 * 2 - 1) * 2 * kv * 4
    context = split.as_dict()["context_parallel"]
    assert context["comm_bytes_per_step_by_pipeline_rank"] == [m * layers * per_layer] * 2
    assert split.bubble()["theory"] == whole.bubble()["theory"] == round((2 - 1) / (m + 2 - 1), 4)
    # the stages hand each other the residual stream of their shard of the sequence
    hop = 1 * (SHAPE.seq_len // 2) * SHAPE.d_model * 4
    assert StageModel(split.work.rank_view(), Cluster.of(A100, 4)).hop_bytes == hop


def test_cp_with_ep_dispatches_a_shards_tokens_and_reduces_experts_over_dp_x_cp_over_ep():
    """dp=2 x cp=2 with ep=2 on 2 nodes of 2: the mesh puts cp inside ep (ranks e * cp + c), so the all-to-alls
    cross the nodes and the experts' gradients are all-reduced inside a node, over the dp x cp / ep = 2 ranks
    holding the same experts. A cp rank's MoE block is a data-parallel rank's at a sequence of T / cp."""
    moe = replace(SHAPE, num_experts=4, top_k=2, expert_hidden=512, moe_dispatch="alltoall_split")
    cluster = Cluster.of(A100, 4, nodes=2, devices_per_node=2)
    work = Workload(moe, Layout(dp=2, cp=2, ep=2, micro_batch_size=2), 4)
    sim = simulate(work, cluster)
    model = StageModel(work.rank_view(), cluster)
    assert model.placement.ep_group() == [0, 2] and model.placement.expert_dp_group() == [0, 1]
    # the tokens a cp rank dispatches: its micro-batch of 2 sequences of T / 2, top_k each, in fp32
    tokens = 2 * (moe.seq_len // 2) * moe.top_k * moe.d_model * 4
    moe_fwd = [o.bytes for o in model._moe_fwd.ops if o.comm == "all_to_all"]
    assert moe_fwd == [moe.num_experts * 8, tokens, tokens]
    across = Group(size=2, nodes=2, per_node=1)
    per_block = sum(collective_time(A100, "all_to_all", b, across) for b in moe_fwd + [tokens, tokens])
    assert model.block(0).ep_fwd + model.block(0).ep_bwd == pytest.approx(per_block)
    experts = sum(p.local_numel(1) for p in param_list(moe, ep=2) if p.expert)
    assert _seconds(sim, "expert gradients and weights over their replicas") == pytest.approx(
        collective_time(A100, "all_reduce", 4 * experts, Group(size=2, nodes=1, per_node=2)))
    # the dense parameters are reduced over all dp x cp = 4 ranks (two nodes)
    short = StageModel(Workload(replace(moe, seq_len=moe.seq_len // 2, positions=moe.seq_len),
                                Layout(dp=4, ep=2, micro_batch_size=2), 8), cluster)
    assert [o.bytes for o in short._moe_fwd.ops if o.comm] == moe_fwd


def test_hsdp_with_cp_shards_over_dp_shard_x_cp():
    """dp=4 x cp=2 at ZeRO-3 with dp_shard=2 on 2 nodes of 4: a shard group is dp_shard x cp = 4 ranks (one node),
    replicated across the 2 nodes; model states 16 psi / 4; each unit's gradients reduce-scattered in the node, the
    shard all-reduced across."""
    cluster = Cluster.of(A100, 8, nodes=2, devices_per_node=4)
    work = Workload(SHAPE, Layout(dp=4, cp=2, zero=3, dp_shard=2, micro_batch_size=1), 4)
    sim = simulate(work, cluster)
    model = StageModel(work.rank_view(), cluster)
    shard, replicas = model.placement.shard_group(4), model.placement.replica_group(4)
    assert shard == [0, 1, 2, 3] and replicas == [0, 4]
    params = param_list(SHAPE)
    states = 16 * sum(fsdp_shard_numel(p, 1, 4) for p in params)
    assert sim.memory[0].model_states == states
    unit = sum(p.local_numel(1) for p in params if p.layer == 0)
    assert _seconds(sim, "reduce-scatter block 0") == pytest.approx(
        hsdp_gradient_seconds(A100, 4 * unit, group_span(shard, 4), group_span(replicas, 4)))


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_1_2_with_tp_shards_each_tp_shards_states_over_its_dp_group(zero):
    """tp=2 x dp=4 at ZeRO-1/2: the optimizer states of this rank's tp shards over its dp group (ranks of one tp
    coordinate: 0, 2, 4, 6), in flat buckets of one sharding pattern each (the ZeRO optimizer's rule); parameters
    whole, gradients whole (ZeRO-1) or a quarter (ZeRO-2); each bucket reduced and its parameters gathered over dp."""
    cluster = Cluster.of(A100, 8)
    sim = simulate(Workload(SHAPE, Layout(dp=4, tp=2, zero=zero, micro_batch_size=1), 4), cluster)
    params = param_list(SHAPE)
    buckets = zero_buckets(params, 2, 25.0, 4)
    assert all(len({params[i].shard_dim is None for i in idx}) == 1 for idx, _ in buckets)  # one pattern each
    padded = sum(n for _, n in buckets)
    assert padded - sum(p.local_numel(2) for p in params) < 4 * len(buckets)  # padding to a multiple of dp only
    mem = sim.memory[0]
    assert (mem.params, mem.grads, mem.optimizer) == (4 * padded, 4 * padded / (4 if zero == 2 else 1),
                                                      8 * padded / 4)
    assert StageModel(sim.work, cluster).placement.dp_group() == [0, 2, 4, 6]
    dp = group_span([0, 2, 4, 6], 8)
    op, name = ("all_reduce", "all-reduce") if zero == 1 else ("reduce_scatter", "reduce-scatter")
    for i, (_, n) in enumerate(buckets):
        assert _seconds(sim, f"{name} bucket {i}") == pytest.approx(collective_time(A100, op, 4 * n, dp))
        assert _seconds(sim, f"all-gather bucket {i}") == pytest.approx(collective_time(A100, "all_gather", 4 * n, dp))


def test_fp8_peaks_come_from_the_datasheets_and_a_device_without_one_is_refused():
    h200 = load_profile("h200-sxm")
    for profile in (H100, h200):  # dense float8: twice bf16 (the datasheets' 3,958 TFLOPS are with sparsity)
        assert profile.peak("fp8") == 2 * profile.peak("bf16") == 1978.8e12
    assert (h200.memory_bytes, h200.memory_bandwidth, h200.intra) == (141e9, 4.8e12, H100.intra)
    assert "fp8" not in A100.peak_flops
    with pytest.raises(ConfigError, match=r"a100-80gb.*gives no \[device.peak_flops\] fp8.*train.precision=bf16"):
        simulate(Workload(SHAPE, Layout(), 1, precision="fp8"), Cluster.of(A100, 1))


@pytest.mark.parametrize("zero", [0, 3])
def test_fp8_multiplies_the_block_linears_in_float8_with_their_casts(zero):
    """Per float8 Linear (M, K) x (K, N): forward casts the input (5 MK bytes) and the fp32 weight (9 NK; not at
    ZeRO-3, where FSDP2 gathered it in float8), backward the output gradient twice (5 MN each), the weight again and
    the input again; all three matmuls at the fp8 peak on one-byte operands. autocast's weight copies of these
    Linears are not kept; everything else saved is bf16's. The head stays bf16."""
    from plait.plan.kernels import ComputeModel

    lay = Layout(zero=zero, micro_batch_size=2)
    bf16, fp8 = (StageModel(Workload(SHAPE, lay, 2, precision=p), Cluster.of(H100, 1)) for p in ("bf16", "fp8"))
    M, C, F = 2 * SHAPE.seq_len, SHAPE.d_model, SHAPE.d_ff
    weights = 0 if zero == 3 else 1
    fwd = {o.name: o for o in fp8._fwd.ops}
    bwd = {o.name: o for o in fp8._bwd.ops}
    assert fwd["attn.q.float8_cast"].bytes == 5 * M * C + weights * 9 * C * C
    assert fwd["mlp.fc.float8_cast"].bytes == 5 * M * C + weights * 9 * F * C
    assert bwd["mlp.proj.dX.float8_cast"].bytes == 5 * M * C + weights * 9 * C * F  # dY (M, C), W (C, F)
    assert bwd["mlp.proj.dW.float8_cast"].bytes == 5 * M * C + 5 * M * F  # dY (M, C), X (M, F)
    q = fwd["attn.q"]
    assert (q.dtype, q.bytes, q.flops) == ("fp8", M * C + C * C + 2 * M * C, 2 * M * C * C)
    seconds = max(q.flops / (1978.8e12 * 0.62), q.bytes / (3.35e12 * 0.8)) + 2e-6
    assert ComputeModel(H100, "bf16").time(q) == pytest.approx(seconds)
    assert all(o.dtype == "fp8" for o in fp8._fwd.ops + fp8._bwd.ops if o.kind == "matmul")
    f8, b16 = fp8._fwd.saved(), bf16._fwd.saved()
    if zero == 0:  # autocast: bf16 keeps a half copy of every block weight, fp8 none
        assert b16.pop("w.block") == 2 * SHAPE.block_matmul_params()
    assert f8 == b16
    head = fp8.head()
    assert head.fwd == bf16.head().fwd  # the head multiplies in bf16


def test_fp8_gathers_the_float8_linears_in_one_byte_under_zero_3():
    """FSDP2's float8 all-gather: a block unit's Linear weights travel in one byte each (its biases and norms in
    bf16's two), after one amax all-reduce per weight over the shard group (torchao's pre-all-gather)."""
    cluster = Cluster.of(H100, 8)
    sims = {p: simulate(Workload(SHAPE, Layout(dp=8, zero=3, micro_batch_size=1), 8, precision=p), cluster)
            for p in ("bf16", "fp8")}
    block = [p for p in param_list(SHAPE) if p.layer == 0]
    linear = sum(p.numel() for p in block if len(p.shape) == 2)
    rest = sum(p.numel() for p in block) - linear
    node = Group(size=8, nodes=1, per_node=8)
    assert _seconds(sims["bf16"], "all-gather block 0 (backward)") == pytest.approx(
        collective_time(H100, "all_gather", 2 * (linear + rest), node))
    assert _seconds(sims["fp8"], "all-gather block 0 (backward)") == pytest.approx(
        collective_time(H100, "all_gather", linear + 2 * rest, node) + 6 * collective_time(H100, "all_reduce", 4, node))
    # the root unit and two block units gathered at once (resharding after forward): two blocks' Linears, a byte less
    assert sims["bf16"].memory[0].buffers - sims["fp8"].memory[0].buffers == pytest.approx(2 * linear)


def test_fp8_composes_with_tp_pp_cp_and_ep_and_is_faster_where_the_matmuls_are_big():
    big = gpt_shape(4, 4096, 32, 8192, 32000)
    cluster = Cluster.of(H100, 8)
    lay = Layout(dp=1, tp=2, pp=2, cp=2, microbatches=2, micro_batch_size=2, recompute="full")
    sims = {p: simulate(Workload(big, lay, 2, precision=p), cluster) for p in ("bf16", "fp8")}
    assert sims["fp8"].step_s < sims["bf16"].step_s
    assert any("fp8" in n for n in sims["fp8"].notes) and sims["fp8"].as_dict()["precision"] == "fp8"
    moe = replace(SHAPE, num_experts=4, top_k=2, expert_hidden=512)
    sim = simulate(Workload(moe, Layout(dp=2, cp=2, ep=2, micro_batch_size=1), 2, precision="fp8"), Cluster.of(H100, 4))
    assert sim.step_s > 0 and sim.as_dict()["context_parallel"]["cp"] == 2


@pytest.mark.parametrize("fragments", [1, 4])
def test_diloco_prices_the_replica_alone_plus_one_hth_of_its_outer_sync(fragments):
    """DiLoCo around ZeRO-3: 8 ranks, 2 per replica (dp_shard=2), so 4 replicas meeting every H = 50 steps. The step
    is the replica's own step (2 ranks of FSDP on its quarter of the batch, priced alone) plus 1/50 of a period's
    outer syncs: each rank all-reduces the float32 pseudo-gradient of its FSDP shard over the 4 ranks holding the
    same shard (0, 2, 4, 6), in F fragments, and runs the outer Nesterov step on it (56 bytes per element); the
    outer start weights and momentum add 8 bytes per element of the shard."""
    cluster = Cluster.of(H100, 8)
    lay = Layout(dp=8, zero=3, dp_shard=2, micro_batch_size=2, sync="diloco", diloco_inner_steps=50,
                 diloco_fragments=fragments)
    sim = simulate(Workload(SHAPE, lay, 16), cluster)
    alone = simulate(Workload(SHAPE, Layout(dp=2, zero=3, micro_batch_size=2), 4), Cluster.of(H100, 2))
    held = sum(fsdp_shard_numel(p, 1, 2) for p in param_list(SHAPE))
    group = Group(size=4, nodes=1, per_node=4)
    assert StageModel(sim.work.replica_view(), cluster).placement.diloco_group() == [0, 2, 4, 6]
    sync = (collective_time(H100, "all_reduce", 4 * held / fragments, group)
            + OUTER_BYTES_PER_ELEMENT * held / fragments / (3.35e12 * 0.8) + 2e-6)
    d = sim.diloco
    assert (d["replicas"], d["ranks_per_replica"], d["bytes_per_sync"]) == (4, 2, int(4 * held / fragments))
    assert d["sync_s"] == pytest.approx(sync) and d["inner_step_s"] == pytest.approx(alone.step_s)
    assert sim.step_s == pytest.approx(alone.step_s + fragments * sync / 50)
    assert d["outer_bytes_per_step"] == int(4 * held / 50)  # 1/H of the shard's bytes, whatever F
    assert sim.memory[0].optimizer == pytest.approx(alone.memory[0].optimizer + 8 * held)
    assert sim.tokens_per_s == pytest.approx(16 * SHAPE.seq_len / sim.step_s) and "diloco H=50" in lay.describe()


def test_pure_diloco_sends_one_hth_of_the_gradient_bytes():
    """One rank per replica (DiLoCo's own setting): every step's data parallelism all-reduces 4 bytes per parameter;
    DiLoCo all-reduces the same count every H steps, and nothing in between."""
    cluster = Cluster.of(A100, 4)
    every = simulate(Workload(SHAPE, Layout(dp=4, micro_batch_size=1), 4), cluster)
    lay = Layout(dp=4, micro_batch_size=1, sync="diloco", diloco_inner_steps=100)
    sim = simulate(Workload(SHAPE, lay, 4), cluster)
    local = sum(p.numel() for p in param_list(SHAPE))
    assert sim.diloco["outer_bytes_per_step"] == int(4 * local / 100) and sim.diloco["replicas"] == 4
    assert every.exposed()["dp"] > 0 and "dp" not in sim.exposed()  # (exposed seconds are rounded to 1 us)
    assert sim.exposed()["diloco"] == pytest.approx(sim.diloco["mean_s_per_step"], abs=1e-6)
    assert sim.step_s < every.step_s


def test_the_planner_enumerates_what_composes():
    from plait.plan.planner import Space, _layouts

    long = gpt_shape(4, 512, 8, 16384, 1024)
    pruned: dict[str, str] = {}
    layouts = _layouts(long, 16, 16, 8, pruned, Space())
    assert any(lay.cp > 1 and lay.pp > 1 for lay in layouts)
    assert any(lay.cp > 1 and lay.hybrid for lay in layouts)
    assert any(lay.tp > 1 and lay.zero in (1, 2) for lay in layouts)
    assert not {"zero=1/2 with tp>1", "dp_shard with cp"} & set(pruned)
    moe = replace(long, num_experts=4, top_k=2, expert_hidden=1024)
    assert any(lay.cp > 1 and lay.ep > 1 for lay in _layouts(moe, 16, 8, 8, {}, Space()))
    # DiLoCo: dp_shard is the data-parallel ranks of one replica, at every ZeRO stage
    diloco = _layouts(SHAPE, 8, 8, 8, {}, Space(), diloco=True)
    assert {(lay.zero, lay.dp_shard) for lay in diloco if lay.dp == 8} >= {(0, 1), (1, 2), (2, 4), (3, 8), (0, 8)}


def test_the_planner_returns_cp_x_pp_where_it_is_best():
    """A 56B GPT at 131,072 tokens on 32 H200s (four nodes), without ZeRO (a space that leaves it out): tp over the
    node alone cannot hold its states (2 x 56B bytes per device at tp=8), two pipeline stages without cp cannot hold
    a whole sequence's activations beside them, and of the layouts that fit, cp=2 x pp=2 x tp=8 is the fastest
    (faster than four stages without cp, whose bubble is larger). With ZeRO in the space the planner shards the
    states over the data-parallel ranks instead (docs/simulate.md)."""
    from plait.plan.planner import Space, plan

    h200 = load_profile("h200-sxm")
    shape = gpt_shape(68, 8192, 64, 131072, 32000)
    space = Space(zeros=(0,), recomputes=("full",), sequence_parallel=(True,))
    result = plan(shape, h200, 32, 4, base=Workload(shape, Layout(), 4, precision="bf16"), top=3, space=space)
    best = result.best.work.layout
    assert (best.tp, best.cp, best.pp) == (8, 2, 2) and result.best.fits(), best.describe()
    assert "GiB" in result.pruned["tp=8 pp=1 zero=0"]  # tp alone
    assert all(sim.step_s > result.best.step_s for sim in result.ranked[1:])
    assert not any(sim.work.layout.cp == 1 and sim.work.layout.pp <= 2 for sim in result.ranked)  # none fits


def test_the_planner_keeps_fp8_and_diloco_and_writes_them(tmp_path):
    from plait.config import load_config
    from plait.plan.planner import Space, plan, write_config

    shape = gpt_shape(8, 2048, 16, 2048, 32000)
    space = Space(recomputes=("none",), micro_batches=(1,), sequence_parallel=(False,), hybrid=False)
    best = {p: plan(shape, H100, 8, 16, base=Workload(shape, Layout(), 16, precision=p), top=1, space=space).best
            for p in ("bf16", "fp8")}
    assert best["fp8"].work.precision == "fp8" and best["fp8"].step_s < best["bf16"].step_s
    with pytest.raises(ConfigError, match="fp8"):
        plan(shape, A100, 8, 16, base=Workload(shape, Layout(), 16, precision="fp8"), top=1, space=space)
    base = Workload(shape, Layout(sync="diloco", diloco_inner_steps=20), 16, precision="bf16")
    result = plan(shape, H100, 8, 16, base=base, top=4, space=space)
    assert all(s.work.layout.sync == "diloco" and s.diloco["inner_steps"] == 20 for s in result.ranked)
    sim = result.best
    write_config(sim, load_config(None, []), str(tmp_path / "best.toml"))
    p = load_config(tmp_path / "best.toml").parallel
    lay = sim.work.layout
    assert (p.sync, p.diloco_inner_steps, p.dp_shard or 1) == ("diloco", 20, lay.dp_shard)
