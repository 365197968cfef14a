"""The simulator against published measurements on A100 clusters, with the numbers written in.

Narayanan et al. 2021 (Megatron-LM, "Efficient Large-Scale Language Model Training on GPU Clusters"),
Table 1: GPT models (vocabulary 51200, sequence 2048, full recomputation), throughput per GPU from
F = 96 B s l h^2 (1 + s/6h + V/16lh) per iteration. Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models"), Table 5: iteration times without data parallelism, full
recomputation against sequence parallelism with selective recomputation.

Both papers ran Megatron-LM (fp16, dropout 0.1, its fused kernels and unfused attention): the workloads
below say so (``stack="megatron"``, ``attention="unfused"``). What is not in the tables is fixed once for
every row, never per row: micro-batch 1 (one sequence per pipeline micro-batch, one schedule step per
iteration), the 1F1B schedule unless the paper names interleaving (Korthikanti: 175B and 530B with 3
chunks), every stage the same number of layers. Target: every row within 15%, parameter counts within
0.5% (Table 1 gives them to one decimal: within that rounding for the smallest two rows).
"""

from __future__ import annotations

import pytest

from plait.plan.flops import megatron_flops
from plait.plan.hardware import load_profile
from plait.plan.planner import Space, plan
from plait.plan.shapes import gpt_shape
from plait.plan.simulate import simulate
from plait.plan.stages import Cluster
from plait.plan.workload import Layout, Workload

# (params B, heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s per GPU)
NARAYANAN_TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
# (name, heads, hidden, layers, tp, pp, chunks, GPUs, batch, seconds full recompute, seconds sp + selective)
KORTHIKANTI_TABLE_5 = [
    ("22B", 64, 6144, 48, 8, 1, 1, 8, 4, 1.42, 1.10), ("175B", 96, 12288, 96, 8, 8, 3, 64, 64, 18.13, 13.75),
    ("530B", 128, 20480, 105, 8, 35, 3, 280, 280, 49.05, 37.83),
    ("1T", 160, 25600, 128, 8, 64, 1, 512, 512, 94.42, 71.49),
]
SEQ, VOCAB, TOLERANCE = 2048, 51200, 0.15
A100 = load_profile("a100-80gb")
MEGATRON_OPTIMIZER = (1.0, 32.0)  # its fused Adam: one kernel per tensor, read p, g, m, v and write p, m, v


def _megatron(shape, layout: Layout, batch: int) -> Workload:
    return Workload(shape, layout, batch, precision="fp16", attention="unfused", stack="megatron",
                    fused_optimizer=True)


def _layout(tp: int, pp: int, gpus: int, batch: int, chunks: int = 1, sp: bool = False,
            recompute: str = "full") -> Layout:
    dp = gpus // (tp * pp)
    per_replica = batch // dp
    if pp == 1:
        return Layout(dp=dp, tp=tp, sp=sp, micro_batch_size=1, recompute=recompute)
    return Layout(dp=dp, tp=tp, pp=pp, sp=sp, schedule="interleaved" if chunks > 1 else "1f1b", virtual=chunks,
                  microbatches=per_replica, micro_batch_size=per_replica, recompute=recompute, pp_balance="count")


@pytest.mark.parametrize("row", NARAYANAN_TABLE_1, ids=[f"{r[0]}B" for r in NARAYANAN_TABLE_1])
def test_narayanan_table_1(row):
    params, heads, hidden, layers, tp, pp, gpus, batch, tflops = row
    shape = gpt_shape(layers, hidden, heads, SEQ, VOCAB, dropout=0.1)
    published = round(params * 1e9)
    assert shape.param_count() == pytest.approx(published, rel=0.005, abs=0.05e9)
    sim = simulate(_megatron(shape, _layout(tp, pp, gpus, batch), batch), Cluster.of(A100, gpus),
                   traffic=MEGATRON_OPTIMIZER)
    predicted = megatron_flops(batch, SEQ, layers, hidden, VOCAB) / (gpus * sim.step_s) / 1e12
    assert predicted == pytest.approx(tflops, rel=TOLERANCE), (predicted, tflops)


@pytest.mark.parametrize("row", KORTHIKANTI_TABLE_5, ids=[r[0] for r in KORTHIKANTI_TABLE_5])
def test_korthikanti_table_5(row):
    _, heads, hidden, layers, tp, pp, chunks, gpus, batch, full_s, selective_s = row
    shape = gpt_shape(layers, hidden, heads, SEQ, VOCAB, dropout=0.1)
    cluster = Cluster.of(A100, gpus)
    for recompute, sp, published in (("full", False, full_s), ("selective", True, selective_s)):
        lay = _layout(tp, pp, gpus, batch, chunks, sp=sp, recompute=recompute)
        sim = simulate(_megatron(shape, lay, batch), cluster, traffic=MEGATRON_OPTIMIZER)
        assert sim.step_s == pytest.approx(published, rel=TOLERANCE), (recompute, sim.step_s, published)
        assert sim.fits()


# Megatron-LM's choices: no ZeRO (it had none), full recomputation, 1F1B, micro-batch 1, even stages.
MEGATRON_SPACE = Space(zeros=(0,), recomputes=("full",), schedules=("1f1b",), micro_batches=(1,),
                       sequence_parallel=(False,), even_stages=True)


# 18.4B: tp=8 pp=1 fits (the paper's layout) but the simulator predicts tp=4 pp=2 17% faster (its tensor-parallel
# all-reduces over NVLink against a 3% bubble), beyond the planner's 15% band, so the planner pipelines.
PLAN_ROWS = [pytest.param(r, marks=pytest.mark.xfail(strict=True, reason="predicted 17% faster with pp=2 at tp=4"))
             if r[0] == 18.4 else r for r in NARAYANAN_TABLE_1]


@pytest.mark.parametrize("row", PLAN_ROWS, ids=[f"{r[0]}B" for r in NARAYANAN_TABLE_1])
def test_plan_keeps_tensor_parallelism_in_a_node_and_the_least_pipeline_that_fits(row):
    """The planner's pick for each Table 1 model, GPU count and batch: tensor parallelism inside a node, and no
    shallower even pipeline fits at any tensor-parallel degree inside a node (checked by simulating each)."""
    _, heads, hidden, layers, _, _, gpus, batch, _ = row
    shape = gpt_shape(layers, hidden, heads, SEQ, VOCAB, dropout=0.1)
    result = plan(shape, A100, gpus, batch, base=_megatron(shape, Layout(), batch), top=3, space=MEGATRON_SPACE,
                  traffic=MEGATRON_OPTIMIZER)
    best = result.best.work.layout
    assert best.tp <= A100.devices_per_node and A100.devices_per_node % best.tp == 0
    assert result.best.fits()
    cluster = Cluster.of(A100, gpus)
    for tp in (1, 2, 4, 8):
        for pp in range(1, best.pp):
            if layers % pp or (gpus // tp) % pp or batch % (gpus // (tp * pp)) or heads % tp:
                continue
            shallower = simulate(_megatron(shape, _layout(tp, pp, gpus, batch), batch), cluster,
                                 traffic=MEGATRON_OPTIMIZER)
            assert not shallower.fits(), (best.describe(), tp, pp)
