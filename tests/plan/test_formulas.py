"""Golden tests of the simulator's formulas: FLOPs, parameters, ZeRO memory, activation memory (plait's GPT
and Korthikanti et al. 2022's Table 2), the bubble of each pipeline schedule, the alpha-beta collectives.

Exact where the maths is identical; a stated bound where a formula leaves out a term (noted per test)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from plait.config import ModelConfig
from plait.models.gpt import GPT
from plait.plan.flops import hardware_flops, megatron_flops, model_flops
from plait.plan.hardware import load_profile
from plait.plan.memory import GPTShape, predict_activation_bytes, predict_model_state_bytes
from plait.plan.network import Group, collective_time
from plait.plan.ops import BlockOps, Setup, embedding_ops, head_ops
from plait.plan.params import param_list
from plait.plan.rank_memory import model_states
from plait.plan.schedule import pipeline_orders, run_pipeline, stage_owner
from plait.plan.shapes import count_params, gpt_shape, shape_from_hf
from plait.plan.workload import Layout, Workload


def _matmul_flops(shape, setup) -> float:
    """Matmul FLOPs of a forward and backward of the whole model from the op lists (attention kernels apart)."""
    b = BlockOps(shape, setup)
    hf, hb = head_ops(shape, setup)
    ops = shape.n_layer * (b.forward().ops + b.backward().ops) + hf.ops + hb.ops
    return sum(op.flops for op in ops if op.kind == "matmul")


def test_matmul_flops_equal_torch_flop_counter_on_the_real_gpt():
    cfg = ModelConfig(n_layer=2, d_model=64, n_head=4, seq_len=32, vocab_size=128)
    model = GPT(cfg)
    ids = torch.randint(0, 128, (3, 32))
    counter = FlopCounterMode(display=False)
    with counter:
        model(ids, ids).backward()
    shape = gpt_shape(2, 64, 4, 32, 128)
    assert _matmul_flops(shape, Setup(micro_batch=3)) == counter.get_total_flops()


def test_matmul_flops_equal_torch_flop_counter_on_a_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (2, 16))
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, labels=ids).loss.backward()
    shape = shape_from_hf(config, 16)
    # the counter also sees rotary's tiny (d/2 x 1) x (1 x T) outer product: a bound of 0.1%
    assert _matmul_flops(shape, Setup(micro_batch=2)) == pytest.approx(counter.get_total_flops(), rel=1e-3)
    assert shape.param_count() == count_params(model)


@pytest.mark.parametrize("layers,hidden,seq", [(24, 2304, 2048), (128, 25600, 2048), (4, 128, 128)])
def test_megatron_formula_is_hardware_flops_with_full_recompute(layers, hidden, seq):
    shape = gpt_shape(layers, hidden, hidden // 64, seq, 51200)
    batch = 8
    assert megatron_flops(batch, seq, layers, hidden, 51200) == pytest.approx(
        hardware_flops(shape, batch * seq, "full"), rel=1e-12)
    # MFU's numerator: 6 N_matmul + 12 L d T per token (PaLM)
    n_mm = layers * 12 * hidden**2 + 51200 * hidden
    assert model_flops(shape, batch * seq) == pytest.approx((6 * n_mm + 12 * layers * hidden * seq) * batch * seq)


@pytest.mark.parametrize("layers,hidden,heads", [(4, 128, 4), (24, 2304, 24), (128, 25600, 160)])
def test_gpt_parameters_equal_the_meta_model_and_megatron_formula(layers, hidden, heads):
    shape = gpt_shape(layers, hidden, heads, 2048 if hidden > 128 else 128, 51200 if hidden > 128 else 256)
    with torch.device("meta"):
        model = GPT(ModelConfig(n_layer=layers, d_model=hidden, n_head=heads, seq_len=shape.seq_len,
                                vocab_size=shape.vocab_size))
    assert shape.param_count() == count_params(model) == sum(p.numel() for p in param_list(shape))
    # Narayanan et al. 2021: P = 12 l h^2 (1 + 13/12h + (V + s)/12lh); plait adds the final norm's 2h
    megatron = 12 * layers * hidden**2 * (1 + 13 / (12 * hidden) + (shape.vocab_size + shape.seq_len)
                                          / (12 * layers * hidden))
    assert shape.param_count() - 2 * hidden == pytest.approx(megatron, rel=1e-12)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dp", [2, 4])
def test_zero_model_states_follow_the_memory_table(stage, dp):
    shape = gpt_shape(4, 128, 4, 128, 256)
    work = Workload(shape, Layout(dp=dp, zero=stage), 32)
    states, _ = model_states(param_list(shape), work, shape.n_layer)
    table = predict_model_state_bytes(shape.param_count(), stage=stage, dp=dp)
    # ZeRO-1/2 pad each bucket to a multiple of dp and FSDP2 each parameter's dim 0: a few elements each
    for key, value in (("params", states.params), ("grads", states.grads), ("optimizer", states.optimizer)):
        assert value == pytest.approx(table[key], rel=2e-3), key


@pytest.mark.parametrize("mode,k", [("none", 1), ("full", 1), ("every_k", 2)])
def test_plait_gpt_activations_equal_the_measured_formula(mode, k):
    """plait.plan.memory's formula is checked against saved tensors in test_memory; the op list must agree."""
    from plait.plan.stages import Cluster, StageModel

    shape = gpt_shape(4, 128, 4, 128, 256)
    recompute = {"none": "none", "full": "full", "every_k": "every_k"}[mode]
    work = Workload(shape, Layout(micro_batch_size=16, recompute=recompute, every_k=k), 16)
    model = StageModel(work, Cluster.of(load_profile("a100-80gb"), 1))
    saved = sum(model.block(i).saved for i in range(4)) + model.head().saved + model.embed().saved
    formula = predict_activation_bytes(GPTShape(16, 128, 128, 4, 4, 256), checkpointing=mode, k=k)["saved"]
    assert saved == pytest.approx(formula, rel=1e-9)


@pytest.mark.parametrize("tp,sp,recompute", [(1, False, "none"), (8, False, "none"), (8, True, "none"),
                                             (8, True, "selective"), (8, False, "full")])
def test_megatron_activations_follow_korthikanti_table_2(tp, sp, recompute):
    """Per layer, bytes: no parallelism sbh(34 + 5as/h); tp sbh(10 + 24/t + 5as/ht); tp+sp sbh/t (34 + 5as/h);
    tp+sp+selective 34 sbh/t; full recompute 2 sbh. The op list also keeps the norms' statistics (8-16 sb
    bytes, which the paper leaves out): within 0.1%."""
    from plait.plan.stages import Cluster, StageModel

    s, b, h, a = 2048, 1, 6144, 48
    shape = gpt_shape(2, h, a, s, 51200, dropout=0.1)
    work = Workload(shape, Layout(tp=tp, sp=sp, recompute=recompute), 1, precision="fp16", attention="unfused",
                    stack="megatron")
    got = StageModel(work, Cluster.of(load_profile("a100-80gb"), tp)).block(0).saved
    sbh, t = s * b * h, tp
    expected = {("none", False): sbh * (10 + 24 / t + 5 * a * s / (h * t)) if t > 1 else sbh * (34 + 5 * a * s / h),
                ("none", True): sbh / t * (34 + 5 * a * s / h), ("selective", True): 34 * sbh / t,
                ("full", False): 2 * sbh}[(recompute, sp)]
    assert got == pytest.approx(expected, rel=1e-3)


def _bubble(schedule: str, p: int, m: int, v: int) -> float:
    owner = stage_owner(p, v, schedule)
    orders = pipeline_orders(schedule, p, m, v)
    n = p * v
    costs = {"F": 1.0 / v, "B": 2.0 / v, "I": 1.0 / v, "W": 1.0 / v}
    events, ends, _ = run_pipeline(orders, owner, lambda a: costs[a.kind], lambda *_: 0.0, lambda s: 1.0)
    span = max(ends.values())
    busy = sum(e.end - e.start for e in events if e.rank == 0)
    assert len(events) == sum(len(o) for o in orders.values()) and n == len(owner)
    return 1 - busy / span


@pytest.mark.parametrize("schedule,p,m", [("gpipe", 4, 8), ("1f1b", 4, 8), ("1f1b", 2, 16), ("gpipe", 8, 8)])
def test_bubble_of_gpipe_and_1f1b_is_the_formula(schedule, p, m):
    assert _bubble(schedule, p, m, 1) == pytest.approx((p - 1) / (m + p - 1), rel=1e-9)


def test_bubble_of_interleaved_and_zbv():
    p, m = 4, 8
    # interleaved: (p-1)/(v m + p-1) with v chunks of 1/v of the work (Narayanan et al. 2021)
    assert _bubble("interleaved", p, m, 2) == pytest.approx((p - 1) / (2 * m + p - 1), rel=1e-9)
    # the zero-bubble V fills most of 1F1B's bubble when F = I = W (Qi et al. 2024)
    assert _bubble("zbv", p, m, 2) < 0.5 * (p - 1) / (m + p - 1)


def test_alpha_beta_collective_times():
    # the alpha-beta model of a profile without NCCL's tuning table (plan/test_network covers NCCL's)
    a100 = replace(load_profile("a100-80gb"), nccl=None)
    nbytes = 1 << 30
    intra = a100.intra.bandwidth * a100.intra.efficiency
    node = Group(size=8, nodes=1, per_node=8)
    assert collective_time(a100, "all_reduce", nbytes, node) == pytest.approx(
        2 * 7 / 8 * nbytes / intra + a100.intra.latency_s)
    assert collective_time(a100, "all_gather", nbytes, node) == pytest.approx(7 / 8 * nbytes / intra
                                                                               + a100.intra.latency_s)
    # one rank per node: every byte crosses its NIC; 8 per node: 8 NICs share the inter-node traffic
    nic = a100.inter.bandwidth * a100.inter.efficiency
    spread = Group(size=16, nodes=16, per_node=1)
    assert collective_time(a100, "all_reduce", nbytes, spread) == pytest.approx(
        2 * 15 / 16 * nbytes / nic + 2 * math.log2(16) * a100.inter.latency_s)
    packed = Group(size=16, nodes=2, per_node=8)
    assert collective_time(a100, "all_reduce", nbytes, packed) == pytest.approx(
        2 * 15 / 16 * nbytes / min(intra, 8 * nic) + a100.intra.latency_s + 2 * a100.inter.latency_s)
    assert collective_time(a100, "all_reduce", nbytes, Group(size=1)) == 0.0


def test_embedding_and_head_ops_save_what_the_gpt_saves():
    shape = gpt_shape(1, 64, 4, 32, 128)
    setup = Setup(micro_batch=2)
    (ef, _), (hf, _) = embedding_ops(shape, setup), head_ops(shape, setup)
    m = 2 * 32
    # ids (int64) on the embedding; final norm in, out, statistics, log-probabilities and targets on the head
    assert ef.saved_bytes() == m * 8
    assert hf.saved_bytes() == 4 * (2 * m * 64 + 2 * m + m * 128) + m * 8
