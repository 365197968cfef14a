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

from dataclasses import replace

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


# 18.4B (an expected failure until the stacks' model states were told apart): tp=4 pp=1 needs 70 of the 74 GiB
# usable once Megatron-LM's model states are its own (2 + 2 + 12 bytes per parameter, no DTensor gradient bucket
# copies); plait's accounting (4 + 4 + 8 plus a 4-byte bucket copy) put it over, and tp=8 pp=1 is predicted 17%
# slower than tp=4 pp=2 (its all-reduces over NVLink against a 3% bubble), so the planner pipelined.
PLAN_ROWS = NARAYANAN_TABLE_1


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


# -- beyond Megatron-LM's own runs: FSDP with tensor parallelism, DeepSpeed's ZeRO-1 under pipelining, one model
# at three scales. Each row states the settings its paper leaves out and what was assumed for them.
RUN_SPACE = Space(zeros=(0, 1, 3), recomputes=("full",), schedules=("1f1b",), micro_batches=(1, 2),
                  sequence_parallel=(False,))


def opt_175b(mb: int = 8) -> tuple:
    """OPT-175B (Zhang et al. 2022, section 2.4 and Table 1; metaseq's launcher): 96 layers, 96 heads, hidden 12288,
    sequence 2048, GPT-2 vocabulary (50272), dropout 0.1, fp16 with fp16 gradients (memory-efficient fp16), fully
    sharded data parallelism (fairscale FSDP) with Megatron tensor parallelism 8 on 992 A100-80GB (dp 124),
    activation checkpointing. Batch: 2M tokens, which metaseq's launcher turns into (2^21 // 124) // 2048 = 8
    sequences per data-parallel rank, no accumulation: 992 sequences. FLOPs as the paper's own count: 4.30e23 for
    300B tokens on 175B parameters, i.e. Megatron's eq. (3) with recomputation, at 147 TFLOP/s per GPU.
    Assumed (unpublished): FSDP reshards after forward (metaseq's baseline script sets --no-reshard-after-forward;
    the simulator predicts the same step either way, the re-gather hiding behind backward; only memory differs)."""
    shape = gpt_shape(96, 12288, 96, SEQ, 50272, dropout=0.1)
    lay = Layout(dp=124, tp=8, zero=3, micro_batch_size=mb, recompute="full")
    return shape, Workload(shape, lay, 992, precision="fp16", attention="unfused", stack="metaseq",
                           fused_optimizer=True)


def bloom_176b(mb: int = 2) -> tuple:
    """BLOOM-176B (BigScience 2022; the tr11-176B-ml README and slurm script): 70 layers, 112 heads, hidden 14336,
    sequence 2048, vocabulary padded to 250880, ALiBi (no position table), tied embeddings, dropout 0.1, bf16
    (Megatron-DeepSpeed with DeepSpeed's bf16 optimizer: ZeRO-1), tp 4 x pp 12 x dp 8 on 384 A100-80GB of Jean
    Zay (4 Omni-Path 100 Gb/s links per node: the a100-80gb-opa profile), micro-batch 2, global batch 2048,
    full activation checkpointing, DeepSpeed's 1F1B. Published: about 150 TFLOP/s per GPU counted as
    8 x 176B x tokens (the README's formula) and 105 s per iteration (its days-left arithmetic).
    Assumed: stages split by layer count (BigScience counts each embedding as a layer, giving the end stages 5
    blocks; the count split gives the last stage 6 blocks and the head)."""
    shape = replace(gpt_shape(70, 14336, 112, SEQ, 250880, dropout=0.1), learned_positions=False)
    lay = Layout(dp=8, tp=4, pp=12, zero=1, schedule="1f1b", microbatches=256 // mb, micro_batch_size=256,
                 recompute="full", pp_balance="count")
    return shape, Workload(shape, lay, 2048, precision="bf16", attention="unfused", stack="megatron",
                           fused_optimizer=True)


# (DGX A100 nodes, seconds per iteration, TFLOP/s per GPU)
MT_NLG = [(280, 60.1, 126), (350, 50.2, 121), (420, 44.4, 113)]


def mt_nlg_530b(nodes: int, mb: int = 2) -> tuple:
    """MT-NLG 530B (Smith et al. 2022, sections 2.3-2.4): 105 layers, 128 heads, hidden 20480, sequence 2048, bf16,
    tp 8 inside a DGX A100 node, pp 35 across nodes, data parallelism over the rest (dp 8, 10, 12 on 280, 350,
    420 nodes), global batch 1920, DeepSpeed's pipeline (1F1B) and ZeRO-1, Megatron's kernels, full
    recomputation; TFLOP/s are Megatron's eq. (3) (60.1 s on 2240 GPUs is 126 by it). Vocabulary: GPT-2's
    padded to 51200 (Megatron's rule for tp 8). Assumed: the micro-batch, unpublished, is 2: with 1 the 1F1B
    bubble grows from 12.4% to 17.5% between 280 and 420 nodes (a 6% drop per GPU against the published 10%),
    with 2 from 22% to 30% (a 10% drop, the published one); stages split by layer count (3 per stage)."""
    shape = gpt_shape(105, 20480, 128, SEQ, VOCAB, dropout=0.1)
    dp = nodes * 8 // 280
    per = 1920 // dp
    lay = Layout(dp=dp, tp=8, pp=35, zero=1, schedule="1f1b", microbatches=per // mb, micro_batch_size=per,
                 recompute="full", pp_balance="count")
    return shape, Workload(shape, lay, 1920, precision="bf16", attention="unfused", stack="megatron",
                           fused_optimizer=True)


OPA = load_profile("a100-80gb-opa")


def test_opt_175b_fsdp_with_tensor_parallelism():
    shape, work = opt_175b()
    assert shape.param_count() == pytest.approx(175e9, rel=0.005)
    sim = simulate(work, Cluster.of(A100, 992), traffic=MEGATRON_OPTIMIZER)
    tflops = megatron_flops(992, SEQ, 96, 12288, 50272) / (992 * sim.step_s) / 1e12
    assert tflops == pytest.approx(147, rel=TOLERANCE), tflops
    assert sim.fits()


def test_bloom_176b_pipeline_with_zero_1_on_omni_path():
    shape, work = bloom_176b()
    assert shape.param_count() == pytest.approx(176.247e9, rel=0.001)
    sim = simulate(work, Cluster.of(OPA, 384), traffic=MEGATRON_OPTIMIZER)
    assert sim.step_s == pytest.approx(105.0, rel=TOLERANCE), sim.step_s
    tflops = 8 * shape.param_count() * SEQ * 2048 / (384 * sim.step_s) / 1e12  # the README's formula
    assert tflops == pytest.approx(150, rel=TOLERANCE), tflops
    assert sim.fits()


@pytest.fixture(scope="module")
def mt_nlg_runs():
    out = {}
    for nodes, _, _ in MT_NLG:
        _, work = mt_nlg_530b(nodes)
        out[nodes] = simulate(work, Cluster.of(A100, nodes * 8), traffic=MEGATRON_OPTIMIZER)
    return out


@pytest.mark.parametrize("row", MT_NLG, ids=[f"{r[0]}nodes" for r in MT_NLG])
def test_mt_nlg_530b_iteration_time_and_throughput(row, mt_nlg_runs):
    nodes, seconds, tflops = row
    sim = mt_nlg_runs[nodes]
    assert sim.step_s == pytest.approx(seconds, rel=TOLERANCE), sim.step_s
    predicted = megatron_flops(1920, SEQ, 105, 20480, VOCAB) / (nodes * 8 * sim.step_s) / 1e12
    assert predicted == pytest.approx(tflops, rel=TOLERANCE), predicted
    assert sim.fits()


def test_mt_nlg_530b_reproduces_the_drop_per_gpu(mt_nlg_runs):
    """Per-GPU throughput falls as the same batch spreads over more pipelines (fewer micro-batches each, a larger
    bubble): published 126 -> 121 -> 113 TFLOP/s; the predicted ratios to 280 nodes within 0.03 of 0.960, 0.897."""
    per_gpu = {n: 1 / (n * mt_nlg_runs[n].step_s) for n, _, _ in MT_NLG}
    published = {n: t for n, _, t in MT_NLG}
    assert per_gpu[280] > per_gpu[350] > per_gpu[420]
    for n in (350, 420):
        assert per_gpu[n] / per_gpu[280] == pytest.approx(published[n] / published[280], abs=0.03), n


# The planner at these scales: each published layout (its degrees and ZeRO stage; the micro-batch, unpublished for
# most, at its best among the planner's choices) within TOLERANCE of the planner's best pick. The planner searches
# its own space (plait's layouts: ZeRO with tp only at stage 3, no ZeRO under pipelining) with the run's software.
RANKING = {
    "OPT-175B": (lambda mb: opt_175b(mb), A100, 992, (1, 2, 4, 8)),
    "BLOOM-176B": (lambda mb: bloom_176b(mb), OPA, 384, (1, 2)),
    "MT-NLG-280": (lambda mb: mt_nlg_530b(280, mb), A100, 2240, (1, 2)),
    "MT-NLG-420": (lambda mb: mt_nlg_530b(420, mb), A100, 3360, (1, 2)),
}
RANKED = [pytest.param(k, marks=pytest.mark.xfail(strict=True, reason=(
    "predicted 20% slower than plain ZeRO-3 (tp 1, dp 992, one sequence per GPU: 15.0 s against 18.0 s): the "
    "simulator hides every unit's gathers behind one unit's compute at 992 ranks (NCCL ring, 8 rails per node); "
    "the OPT row itself is predicted 11% faster than measured"))) if k == "OPT-175B" else k for k in RANKING]


@pytest.mark.parametrize("name", RANKED)
def test_plan_puts_the_published_layout_within_tolerance_of_its_best(name):
    factory, profile, gpus, micro_batches = RANKING[name]
    shape, work = factory(micro_batches[-1])
    space = replace(RUN_SPACE, micro_batches=micro_batches, zeros=(0, 3) if work.layout.pp == 1 else (0,),
                    even_stages=name.startswith("MT-NLG"))
    result = plan(shape, profile, gpus, work.global_batch, base=replace(work, layout=Layout()), top=1, space=space,
                  traffic=MEGATRON_OPTIMIZER)
    cluster = Cluster.of(profile, gpus)
    published = min(simulate(factory(mb)[1], cluster, traffic=MEGATRON_OPTIMIZER).step_s for mb in micro_batches
                     if work.global_batch // work.layout.dp % mb == 0)
    assert result.best.fits()
    assert published <= result.best.step_s * (1 + TOLERANCE), (name, published, result.best.work.layout.describe(),
                                                               result.best.step_s)


def test_plan_at_1536_gpus_does_not_pick_zero_3_over_a_faster_tensor_or_pipeline_layout():
    """The 175B GPT of the issue (96 layers, hidden 12288, sequence 2048, bf16, global batch 1536) on 1536 A100s: a
    ZeRO-3 layout is picked only if no layout with tensor or pipeline parallelism is predicted faster."""
    shape = gpt_shape(96, 12288, 96, SEQ, VOCAB)
    result = plan(shape, A100, 1536, 1536, base=Workload(shape, Layout(), 1536, precision="bf16"), top=6,
                  space=Space(recomputes=("full",), micro_batches=(1, 2), schedules=("1f1b", "interleaved")))
    best = result.best
    assert best.fits()
    faster = [s for s in result.ranked if s.step_s < best.step_s and (s.work.layout.tp > 1 or s.work.layout.pp > 1)]
    assert best.work.layout.zero != 3 or not faster, (best.work.layout.describe(), [s.work.layout.describe()
                                                                                     for s in faster])
    # and a ZeRO-3 layout within the band but slower than a tp/pp one ranks after it
    zero3 = [s for s in result.ranked if s.work.layout.zero == 3]
    tp_pp = [s for s in result.ranked if s.work.layout.zero != 3]
    for z in zero3:
        for t in tp_pp:
            if t.step_s < z.step_s:
                assert result.ranked.index(t) < result.ranked.index(z), (t.work.layout.describe(),
                                                                         z.work.layout.describe())
