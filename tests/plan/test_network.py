"""Collectives across nodes and ZeRO-3's prefetch: NCCL's own model and what one unit's compute hides.

The A100 profile carries NCCL 2.8's tuning constants (``[network.nccl]``): these tests pin the algorithm and
protocol NCCL's model picks by size, the per-hop latency of a ring and a tree, the bus-bandwidth factors
nccl-tests reports, each GPU's share of its node's NICs, and the exposure FSDP's prefetch leaves when a unit's
collectives outlast its compute. Exact where the formula is the code's; a stated bound otherwise.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from plait.config import ConfigError
from plait.plan.hardware import load_profile
from plait.plan.nccl import PROTOCOLS, predict
from plait.plan.network import Group, collective_time, nccl_choice
from plait.plan.shapes import gpt_shape
from plait.plan.simulate import simulate
from plait.plan.stages import Cluster, StageModel
from plait.plan.workload import Layout, Workload

A100 = load_profile("a100-80gb")
NODE = Group(size=8, nodes=1, per_node=8)
GB = 1 << 30


def _bus(group: Group) -> float:
    intra = A100.intra.bandwidth * A100.intra.efficiency
    return intra if group.nodes == 1 else min(intra, group.ranks_per_node * A100.inter.bandwidth
                                              * A100.inter.efficiency)


def test_nccl_picks_the_fastest_of_its_algorithms_and_protocols_by_size():
    wide = Group(size=1536, nodes=192, per_node=8)
    for group in (NODE, wide):
        for nbytes in (8, 1 << 20, GB):
            choice = nccl_choice(A100, "all_reduce", nbytes, group)
            options = [predict(A100.nccl, a, p, "all_reduce", nbytes, group.size, group.nodes, _bus(group))
                       for a in ("ring", "tree") for p in PROTOCOLS]
            assert choice.seconds == min(options)
    assert nccl_choice(A100, "all_reduce", GB, NODE).algorithm == "ring"
    # across 192 nodes a ring all-reduce pays 2 x 1535 hops: a megabyte goes down the tree
    assert nccl_choice(A100, "all_reduce", 1 << 20, wide).algorithm == "tree"
    tiny = nccl_choice(A100, "all_reduce", 8, wide)
    assert (tiny.algorithm, tiny.protocol) == ("tree", "LL")
    assert tiny.seconds < 200e-6  # LL's 2 log2(192) network hops, not the Simple tree's 50 us each
    assert nccl_choice(A100, "all_gather", GB, wide).algorithm == "ring"  # gathers and scatters: the ring only


def test_a_ring_costs_its_bus_bandwidth_factor_and_every_hop():
    """Simple ring: ``f S / B`` with nccl-tests' factor ``f`` (``(n-1)/n`` gather, ``2(n-1)/n`` all-reduce) plus
    ``8.4 + (steps - inter) x 3.4 + inter x 9.6`` us (NCCL 2.8's baseLat and hwLat: a hop inside a node is
    NVLink's, each node boundary the network's), times 1.9 for a large multi-node all-reduce (the plateau)."""
    t = A100.nccl
    for group in (NODE, Group(size=64, nodes=8, per_node=8), Group(size=1536, nodes=192, per_node=8)):
        n, nodes, bus = group.size, group.nodes, _bus(group)
        for op, steps, inter, factor in (("all_gather", n - 1, nodes - 1, (n - 1) / n),
                                         ("all_reduce", 2 * (n - 1), 2 * (nodes - 1), 2 * (n - 1) / n)):
            latency = (t.base_latency_us["ring"][2] + (steps - inter) * t.hop_latency_us["nvlink_ring"][2]
                       + inter * t.hop_latency_us["net_ring"][2]) * 1e-6
            plateau = t.ring_plateau if op == "all_reduce" and nodes > 1 else 1.0
            assert predict(t, "ring", "Simple", op, 4 * GB, n, nodes, bus) == pytest.approx(
                factor * 4 * GB / bus + plateau * latency, rel=1e-12)
    # the tree: 0.9 of the bus bandwidth, at most 80 GB/s beyond two nodes, every byte up and down
    wide = Group(size=1536, nodes=192, per_node=8)
    tree_latency = 2 * (7 * t.hop_latency_us["nvlink_tree"][2] + 7 * t.hop_latency_us["net_tree"][2]) * 1e-6
    assert predict(t, "tree", "Simple", "all_reduce", 4 * GB, 1536, 192, _bus(wide)) == pytest.approx(
        2 * 4 * GB / min(0.9 * _bus(wide), 80e9) + tree_latency, rel=1e-12)  # 4 GiB: past the correction table
    # at 1536 ranks the ring's hops alone are milliseconds per gather
    assert predict(t, "ring", "Simple", "all_gather", 0, 1536, 192, _bus(wide)) > 5e-3


def test_each_gpu_has_its_share_of_the_node_s_nics():
    """One rank per node: its own rail (25 GB/s x 0.85); k per node: k rails, up to NVLink; an all-to-all sends
    its off-node bytes through its own rail only."""
    share = A100.inter.bandwidth * A100.inter.efficiency
    one = Group(size=16, nodes=16, per_node=1)
    assert _bus(one) == pytest.approx(share)
    big = 4 * GB
    t = A100.nccl
    assert collective_time(A100, "reduce_scatter", big, one) == predict(t, "ring", "Simple", "reduce_scatter", big,
                                                                        16, 16, share)
    assert collective_time(A100, "reduce_scatter", big, one) == pytest.approx(15 / 16 * big / share, rel=2e-3)
    eight = Group(size=128, nodes=16, per_node=8)
    assert collective_time(A100, "reduce_scatter", big, eight) == predict(t, "ring", "Simple", "reduce_scatter", big,
                                                                          128, 16, 8 * share)
    # all-to-all over 2 nodes of 8: half of each rank's buffer leaves the node, through one rail
    a2a = collective_time(A100, "all_to_all", big, Group(size=16, nodes=2, per_node=8))
    assert a2a == pytest.approx(8 / 16 * big / share, rel=1e-3)
    assert a2a > 5 * collective_time(A100, "all_to_all", big, Group(size=8, nodes=1, per_node=8))


def test_a_profile_names_a_missing_nccl_constant(tmp_path):
    text = Path(A100.source).read_text().replace("ring_plateau = 1.9", "")
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    with pytest.raises(ConfigError, match=r"missing \[network.nccl\] ring_plateau"):
        load_profile(bad)
    opa = load_profile("a100-80gb-opa")  # a profile built on a shipped one, its NICs replaced
    assert opa.inter.bandwidth == pytest.approx(4 * 12.5e9 / 8) and opa.nccl == A100.nccl


def test_zero_3_exposes_what_one_unit_s_compute_cannot_hide():
    """FSDP prefetches the next unit's all-gather while this one computes (in backward, ahead of this unit's
    reduce-scatter): per block, forward exposes ``max(0, ag - fwd)`` and backward ``max(0, ag + rs - bwd)``.
    A 1.3B GPT at one sequence per rank over 1024 ranks is comm-bound: the simulated exposure is that sum within
    10% (the root unit and the first gather aside); eight sequences per rank on one node hide nearly all of it."""
    shape = gpt_shape(24, 2048, 16, 1024, 51200)
    for gpus, mb in ((1024, 1), (8, 8)):
        work = Workload(shape, Layout(dp=gpus, zero=3, micro_batch_size=mb), gpus * mb, precision="bf16")
        cluster = Cluster.of(A100, gpus)
        sim = simulate(work, cluster)
        block = StageModel(work, cluster).block(0)
        group = Group(size=gpus, nodes=max(1, gpus // 8), per_node=min(gpus, 8))
        ag = collective_time(A100, "all_gather", shape.block_params() * 2, group)
        rs = collective_time(A100, "reduce_scatter", shape.block_params() * 4, group)
        expected = shape.n_layer * (max(0.0, ag - block.fwd) + max(0.0, ag + rs - block.bwd))
        exposed = sim.exposed()["fsdp"]
        if mb == 1:
            assert expected > 0.5 * sim.step_s
            assert exposed == pytest.approx(expected, rel=0.10), (exposed, expected)
        else:
            assert expected == 0.0 and exposed < 0.02 * sim.step_s, (exposed, sim.step_s)


def test_without_nccl_constants_the_alpha_beta_model_is_kept():
    plain = replace(A100, nccl=None)
    assert nccl_choice(plain, "all_reduce", GB, NODE) is None
    assert collective_time(plain, "all_gather", GB, NODE) == pytest.approx(
        7 / 8 * GB / _bus(NODE) + A100.intra.latency_s)
    assert math.isfinite(collective_time(A100, "broadcast", GB, Group(size=16, nodes=2, per_node=8)))
