"""The simulator on plait's mixture-of-experts GPT (``[moe]``, ``parallel.ep``): parameters equal the real
model's, each rank holds its ``E / ep`` experts, and every MoE layer prices the dispatcher's all-to-alls
over the expert-parallel group: forward the per-expert counts and the two token-sized ones, backward the two
token-sized ones again: ``tokens x top_k x d_model x bytes`` each with variable splits
(``moe.dispatcher=alltoall_split``), the static buffer's bound with the default static all-to-all
(here ``min(ep, E/k) = 2`` times that). Exact. Imbalance: the experts' activations priced at the busiest rank's
rows, given (``moe.imbalance``) or measured from a run directory's logged loads (``plait plan memory --run-dir``).
"""

from __future__ import annotations

import pytest
import torch

from plait.config import load_config
from plait.models.gpt import GPT
from plait.plan.configured import simulate_config
from plait.plan.hardware import load_profile
from plait.plan.network import collective_time, group_span
from plait.plan.ops import BlockOps, Setup
from plait.plan.params import param_list
from plait.plan.record import shape_from_config
from plait.plan.shapes import count_params

pytestmark = pytest.mark.skipif(not hasattr(load_config(None, []), "moe"), reason="no [moe] section in this build")
MOE = ["--moe.num_experts=4", "--parallel.nproc=4", "--parallel.ep=2", "--train.micro_batch_size=8"]


@pytest.mark.parametrize("extra", [[], ["--moe.shared_experts=1", "--moe.every=2", "--moe.top_k=1"]])
def test_moe_parameters_equal_the_real_model_and_shard_over_ep(extra):
    cfg = load_config(None, MOE + extra)
    shape = shape_from_config(cfg)
    with torch.device("meta"):
        model = GPT(cfg.model, cfg.moe)
    assert shape.param_count() == count_params(model) == sum(p.numel() for p in param_list(shape))
    local = sum(p.numel() for p in param_list(shape, ep=2))
    assert local == shape.param_count() - shape.moe_blocks * shape.expert_params() // 2


@pytest.mark.parametrize("dispatcher, factor", [("alltoall", 2), ("alltoall_split", 1)])
def test_each_moe_layer_prices_two_all_to_alls_forward_and_two_backward(dispatcher, factor):
    cfg = load_config(None, MOE + [f"--moe.dispatcher={dispatcher}"])
    shape = shape_from_config(cfg)
    setup = Setup(micro_batch=8, ep=2)
    ops = BlockOps(shape, setup, moe=True)
    tokens = factor * 8 * shape.seq_len * shape.top_k * shape.d_model * 4
    fwd = [(o.name, o.bytes) for o in ops.forward().ops if o.comm == "all_to_all"]
    bwd = [(o.name, o.bytes) for o in ops.backward().ops if o.comm == "all_to_all"]
    assert [b for _, b in fwd] == [shape.num_experts * 8, tokens, tokens]
    assert [b for _, b in bwd] == [tokens, tokens]
    assert not [o for o in BlockOps(shape, Setup(micro_batch=8, ep=1), moe=True).forward().ops if o.kind == "comm"]

    profile = load_profile("a100-80gb")
    sim = simulate_config(cfg, profile)
    group = group_span([0, 1], profile.devices_per_node)
    per_layer = sum(collective_time(profile, "all_to_all", b, group) for _, b in fwd + bwd)
    steps = sim.work.accumulation
    assert sim.exposed()["ep"] == pytest.approx(shape.moe_blocks * per_layer * steps, abs=1e-6)  # rounded to 1 us
    dense = simulate_config(load_config(None, MOE[1:2] + MOE[3:]), profile)
    assert "ep" not in dense.exposed() and sim.step_s > dense.step_s


def test_plan_enumerates_expert_parallelism_and_writes_it(tmp_path, capsys):
    import json

    from plait.cli import main
    from plait.recipes import validate_config as validate

    out = tmp_path / "best.toml"
    assert main(["plan", "--hardware", "a100-80gb", "--gpus", "8", "--moe.num_experts=8", "--model.n_layer=4",
                 "--train.global_batch_size=64", "--top", "40", "--write", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert any("ep=" in r["layout"] for r in result["ranked"])
    assert any("MoE" in reason for reason in result["pruned"].values())
    cfg = load_config(out)
    validate(cfg, cfg.parallel.nproc)


def test_experts_under_zero_are_priced_and_planned_as_sharded_over_their_replicas(capsys):
    """ep=2 of dp=4: ranks 0 and 2 hold the same experts. Without ZeRO their gradients take one all-reduce
    there; under ZeRO-1 a reduce-scatter and the weights' all-gather, under ZeRO-3 a second all-gather."""
    import json

    from plait.cli import main

    profile = load_profile("a100-80gb")
    shape = shape_from_config(load_config(None, MOE))
    experts = 4 * sum(p.numel() for p in param_list(shape, ep=2) if p.expert)
    group = group_span([0, 2], profile.devices_per_node)
    rs, ag = (collective_time(profile, op, experts, group) for op in ("reduce_scatter", "all_gather"))
    expect = {0: collective_time(profile, "all_reduce", experts, group), 1: rs + ag, 3: rs + 2 * ag}
    for zero, seconds in expect.items():
        sim = simulate_config(load_config(None, MOE + [f"--parallel.zero={zero}"]), profile)
        (span,) = [s for s in sim.timelines[0].spans if s.name.startswith("expert gradients")]
        assert span.end - span.start == pytest.approx(seconds, rel=1e-9), zero
    assert main(["plan", "--hardware", "a100-80gb", "--gpus", "8", "--moe.num_experts=8", "--model.n_layer=4",
                 "--train.global_batch_size=64", "--top", "60"]) == 0
    ranked = [r["layout"] for r in json.loads(capsys.readouterr().out)["ranked"]]
    assert any("ep=2" in r and "zero=1" in r for r in ranked) and any("ep=2" in r and "zero=3" in r for r in ranked)


def _saved(overrides: list[str]) -> int:
    """Bytes one MoE layer's forward saves for backward on one rank."""
    shape = shape_from_config(load_config(None, MOE + overrides))
    ops = BlockOps(shape, Setup(micro_batch=8, ep=2), moe=True).forward().ops
    return sum(b for o in ops for _, b in o.saves)


def test_imbalance_grows_the_busiest_ranks_activations_only_where_the_buffers_follow_the_routing():
    from plait.plan.ops_moe import expert_rows, rank_imbalance

    split = ["--moe.dispatcher=alltoall_split"]
    assert _saved(split + ["--moe.imbalance=1.5"]) > _saved(split)  # variable splits: the busiest rank's rows
    assert _saved(["--moe.imbalance=1.5"]) == _saved([])  # static buffers: already at their bound
    shape = shape_from_config(load_config(None, MOE + split + ["--moe.imbalance=1.5"]))
    a = 8 * shape.seq_len * shape.top_k
    assert expert_rows(shape, 8 * shape.seq_len, 2) == (1.5 * a, 1.5 * a)
    # a capacity bounds every expert, so the static buffer shrinks to about capacity_factor x the balanced share
    capped = shape_from_config(load_config(None, MOE + ["--moe.capacity_factor=1.25"]))
    assert expert_rows(capped, 8 * capped.seq_len, 2)[0] == 2 * 2 * -(-int(1.25 * a) // 4)
    assert rank_imbalance([30, 10, 10, 10], 2) == pytest.approx(40 / 30)  # ranks hold experts {0, 1} and {2, 3}


def test_plan_memory_measures_the_imbalance_from_a_run_directory(tmp_path, capsys):
    import json

    from plait.cli import main
    from plait.config import to_toml

    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(None, MOE + ["--moe.dispatcher=alltoall_split", "--model.n_layer=2"])
    (run / "config.toml").write_text(to_toml(cfg))
    loads = [{"tokens_per_expert": [10, 10, 10, 10]}, {"tokens_per_expert": [25, 15, 5, 5]}]  # layer 1: 40 vs 25
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "moe": loads}) + "\n" + json.dumps({"step": 2}) + "\n")
    assert main(["plan", "memory", "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "imbalance 1.600 from measured in" in out and "(MoE layer 1)" in out, out
    assert main(["plan", "memory", "--run-dir", str(run), "--moe.imbalance=1.0"]) == 0  # the measurement wins
    assert "imbalance 1.600" in capsys.readouterr().out


def test_imbalance_raises_the_predicted_peak_by_the_busiest_ranks_extra_expert_rows():
    """The per-rank prediction ``plait plan memory`` prints: under variable splits the activations grow by exactly
    the busiest rank's extra rows times what each saves (its input, fc and GELU outputs) in every MoE layer, and
    nothing else moves; the static all-to-all is priced at its bound, which variable splits reach at an imbalance
    of ``min(ep, E / k)`` = 2."""
    profile = load_profile("a100-80gb")

    def rank0(extra: list[str]):
        return simulate_config(load_config(None, MOE + extra), profile, memory_only=True).memory[0]

    split = ["--moe.dispatcher=alltoall_split"]
    base, hot = rank0(split), rank0(split + ["--moe.imbalance=1.5"])
    shape = shape_from_config(load_config(None, MOE + split))
    balanced = 8 * shape.seq_len * shape.top_k  # assignments per rank and micro-batch
    per_row = (shape.d_model + 2 * shape.expert_hidden) * 4  # fp32 x_recv, fc, hidden
    assert hot.activations - base.activations == shape.moe_blocks * (int(1.5 * balanced) - balanced) * per_row
    assert (hot.params, hot.grads, hot.optimizer) == (base.params, base.grads, base.optimizer)
    static = {f: rank0([f"--moe.imbalance={f}"]).activations for f in (1.0, 2.0)}
    assert static[1.0] == static[2.0] == rank0(split + ["--moe.imbalance=2.0"]).activations > hot.activations
