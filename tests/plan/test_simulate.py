"""``plait simulate`` / ``plait plan`` end to end: JSON and trace, --compare, what is derived from the code that
trains (tensor-parallel collectives, buckets), a 400B model through model.factory on the meta device, and bad
input ending in one clear message."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from plait import recipes
from plait.cli import main
from plait.config import ConfigError, load_config, to_toml
from plait.plan import derive, record
from plait.plan.configured import simulate_config
from plait.plan.hardware import load_profile
from plait.plan.ops import BlockOps, Setup
from plait.plan.params import param_list
from plait.plan.shapes import gpt_shape

GPT_1B = ["--model.n_layer=24", "--model.d_model=2048", "--model.n_head=16", "--model.seq_len=2048",
          "--model.vocab_size=51200", "--train.global_batch_size=64", "--train.micro_batch_size=4",
          "--train.precision=bf16"]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_simulate_prints_the_prediction_and_writes_a_trace(tmp_path, capsys):
    trace = tmp_path / "trace.json"
    rc, out, _ = _run(capsys, "simulate", "--hardware", "a100-80gb", "--nodes", "2", "--gpus-per-node", "8",
                      *GPT_1B, "--parallel.tp=4", "--parallel.pp=2", "--parallel.pp_schedule=interleaved",
                      "--parallel.microbatches=4", "--train.activation_checkpointing=full", "--trace", str(trace))
    assert rc == 0
    result = json.loads(out)
    for key in ("step_s", "tokens_per_s", "mfu", "mfu_formula", "hfu", "hfu_formula", "peak_memory_bytes",
                "memory_by_pipeline_rank", "exposed_comm_s", "bubble", "scaling_efficiency"):
        assert key in result, key
    assert result["layout"]["dp"] == 2 and result["layout"]["virtual"] == 2
    assert result["hfu"] > result["mfu"] > 0
    assert set(result["memory_by_pipeline_rank"]["0"]) >= {"params", "grads", "optimizer", "activations", "buffers"}
    assert 0 < result["bubble"]["per_rank"][0] < 0.5
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1} and any(e.get("cat") == "dp" for e in events)


def test_compare_reports_the_error_of_each_figure(tmp_path, capsys):
    cfg = load_config(None, ["--parallel.nproc=2", "--parallel.zero=2"])
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(to_toml(cfg))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "step_s": 0.2, "tokens_per_s": 20000.0})
                                               + "\n" for i in range(1, 11)))
    (run / "summary.json").write_text(json.dumps({"world_size": 2, "memory": {
        "measured_model_state_bytes": [8_424_960, 8_424_960]}}))
    rc, out, _ = _run(capsys, "simulate", "--hardware", "a100-80gb", "--compare", str(run),
                      "--trace", str(tmp_path / "t.json"))
    assert rc == 0
    cmp = json.loads(out)["compare"]
    assert cmp["steps_used"] == 8 and cmp["step_s"]["measured"] == 0.2
    assert cmp["step_s"]["error"] == pytest.approx(cmp["step_s"]["predicted"] / 0.2 - 1, abs=1e-4)
    # ZeRO-2 on two ranks: 4 + 2 + 4 bytes per parameter of plait's default GPT (842,496 parameters)
    assert abs(cmp["model_state_bytes"][0]["error"]) < 0.01


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_collectives_recorded_from_the_real_plan_match_the_op_list(sp):
    cfg = load_config(None, ["--parallel.nproc=2", "--parallel.tp=2", f"--parallel.sequence_parallel={sp}",
                             "--model.n_layer=2"])
    block, _ = record.tp_collectives(cfg, micro_batch=2)
    shape = gpt_shape(2, 128, 4, 128, 256)
    ops = BlockOps(shape, Setup(micro_batch=2, tp=2, sp=sp))
    analytic = sorted((o.comm, int(o.bytes), o.backward) for o in ops.forward().ops + ops.backward().ops
                      if o.kind == "comm")
    assert sorted((c.op, c.nbytes, c.backward) for c in block) == analytic


def test_reducer_and_zero_buckets_come_from_the_training_code():
    shape = gpt_shape(4, 128, 4, 128, 256)
    params = param_list(shape)
    buckets = derive.reducer_buckets(params, 1, 25.0)
    assert sorted(i for b in buckets for i in b) == list(range(len(params)))
    first = sum(params[i].numel() for i in buckets[0]) * 4
    assert len(buckets) >= 2 and first <= 2**20  # the first bucket is capped at 1 MiB
    zero = derive.zero_buckets(params, 1, 25.0, world=4)
    assert all(numel % 4 == 0 for _, numel in zero)


def test_a_400b_model_from_a_factory_simulates_on_the_meta_device():
    pytest.importorskip("transformers")
    cfg = load_config(None, ["--model.factory=plan_factories:llama", "--model.seq_len=8192",
                             "--parallel.tp=8", "--parallel.pp=16", "--parallel.microbatches=16",
                             "--train.micro_batch_size=16", "--train.global_batch_size=1024",
                             "--train.precision=bf16", "--train.activation_checkpointing=full"])
    sim = simulate_config(cfg, load_profile("h100-sxm"), nodes=128, gpus_per_node=8, derive_tp=False, models=recipes)
    assert 400e9 < sim.work.shape.param_count() < 410e9
    assert sim.work.shape.formula_params() == sim.work.shape.param_count()
    assert sim.world == 1024 and sim.step_s > 0 and 0 < sim.mfu < 1


def test_plan_ranks_layouts_and_writes_a_runnable_config(tmp_path, capsys):
    out = tmp_path / "best.toml"
    rc, text, _ = _run(capsys, "plan", "--hardware", "a100-80gb", "--gpus", "16", *GPT_1B, "--top", "3",
                       "--write", str(out))
    assert rc == 0
    result = json.loads(text)
    assert len(result["ranked"]) == 3 and result["screened"] > 3 and result["pruned"]
    from plait.recipes import validate_config as validate

    cfg = load_config(out)
    validate(cfg, cfg.parallel.nproc)
    assert cfg.parallel.nproc == 16


def test_plan_memory_covers_tensor_and_pipeline_layouts(capsys):
    rc, out, _ = _run(capsys, "plan", "memory", "--parallel.nproc=4", "--parallel.tp=2", "--parallel.pp=2")
    assert rc == 0 and "per-rank memory by pipeline rank" in out and "activations" in out


# -- bad input: one line, exit code 2 ------------------------------------------------------------------------
def test_a_profile_missing_a_field_is_named(tmp_path, capsys):
    text = Path(load_profile("a100-80gb").source).read_text().replace("bandwidth = 25e9", "")
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    with pytest.raises(ConfigError, match=r"missing \[network.inter\] bandwidth"):
        load_profile(bad)
    rc, _, err = _run(capsys, "simulate", "--hardware", str(bad))
    assert rc == 2 and "bandwidth" in err and "Traceback" not in err


def test_degrees_that_do_not_divide(capsys):
    rc, _, err = _run(capsys, "simulate", "--hardware", "a100-80gb", "--parallel.nproc=6", "--parallel.tp=4")
    assert rc == 2 and "does not divide" in err
    rc, _, err = _run(capsys, "simulate", "--hardware", "a100-80gb", "--parallel.nproc=4", "--parallel.tp=4",
                      "--model.n_head=6")
    assert rc == 2 and "n_head" in err


def test_a_layout_that_cannot_fit_names_the_smallest_change(capsys):
    rc, _, err = _run(capsys, "simulate", "--hardware", "a100-80gb", "--nodes", "1", "--gpus-per-node", "8",
                      "--model.n_layer=32", "--model.d_model=4096", "--model.n_head=32", "--model.seq_len=2048",
                      "--model.vocab_size=51200", "--train.global_batch_size=8", "--train.micro_batch_size=1")
    assert rc == 2
    assert "GiB usable" in err and "smallest change that fits: --parallel." in err, err


def test_other_bad_input(capsys):
    rc, _, err = _run(capsys, "simulate", "--hardware", "no-such-gpu")
    assert rc == 2 and "a100-80gb" in err
    rc, _, err = _run(capsys, "simulate", "--parallel.nproc=2")
    assert rc == 2 and "--hardware" in err
    rc, _, err = _run(capsys, "simulate", "--hardware", "a100-80gb", "--parallel.nproc=2", "--parallel.ep=2")
    assert rc == 2 and "expert" in err
    rc, _, err = _run(capsys, "simulate", "--hardware", "a100-80gb", "--model.factory=plan_factories:not_a_transformer")
    assert rc == 2 and "transformer" in err
    rc, _, err = _run(capsys, "plan", "--hardware", "a100-80gb", "--gpus", "2", "--model.n_layer=200",
                      "--model.d_model=16384", "--model.n_head=128", "--model.seq_len=2048")
    assert rc == 2 and "Smallest change" in err and "--gpus" in err


def test_plan_chooses_selective_checkpointing_where_it_fits_and_full_recompute_does_not_pay(tmp_path):
    """A 1.3B GPT on one H100 in bf16: at 12 sequences per step keeping every activation does not fit; selective
    checkpointing (matmul and attention outputs kept) fits and recomputes only memory-bound operators, so it
    beats full recomputation (by 14%: full recomputation stops before each block's MLP output projection, torch's
    early stop) and is chosen, and written as ``train.activation_checkpointing = "selective"``. At 10 sequences
    everything fits and nothing is recomputed."""
    from plait.plan.planner import Space, plan, write_config
    from plait.plan.shapes import gpt_shape
    from plait.plan.workload import Layout, Workload

    shape = gpt_shape(24, 2048, 16, 2048, 50304)
    space = Space(zeros=(0,), sequence_parallel=(False,), hybrid=False)
    chosen = {batch: plan(shape, load_profile("h100-sxm"), 1, batch, space=replace(space, micro_batches=(batch,)),
                          base=Workload(shape, Layout(), batch, precision="bf16")) for batch in (10, 12)}
    assert chosen[10].best.work.layout.recompute == "none"
    best = chosen[12].best
    assert best.work.layout.recompute == "selective", [s.work.layout.describe() for s in chosen[12].ranked]
    full = next(s for s in chosen[12].ranked if s.work.layout.recompute == "full")
    assert full.step_s > best.step_s * 1.1 and any("recompute=none" in k for k in chosen[12].pruned)
    write_config(best, load_config(None, []), str(tmp_path / "best.toml"))
    assert load_config(tmp_path / "best.toml").train.activation_checkpointing == "selective"
