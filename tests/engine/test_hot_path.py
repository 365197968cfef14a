"""The hot path (issue 32, DESIGN.md rule 11): a step that does not log costs what the hand-written step costs.

One check per rule, each failing on the engine before issue 32:

- no file written by a non-logging step (the run directory watched: ``progress.json``, ``goodput.jsonl``), by the
  API and by the Trainer; the launcher's ``progress.json`` is written at log steps and at ``close``;
- no device-to-host read on a non-logging step (``aten::_local_scalar_dense`` counted by torch's profiler): the
  same count as the hand-written loop with the same optimizer, at world 1 (a decoder in the API, and the Trainer)
  and world 2 (against DDP); an optimizer that cannot take ``found_inf`` costs exactly one read, the skip decided
  on the host, which the hand loop does not make because it does not skip (shown to be the only extra one);
- no collective beyond the gradients' own at world 2 (every ``c10d`` operator counted): the reducer's buckets;
  reading ``StepInfo.global_loss`` off a log step runs its one agreement then; a stop request reaches every rank
  at the next log step, or, where steps are slow, at the next stop check (every step in the test);
- gradients set to None by ``zero_grad`` (one rank, and DDP); no ``loss * 1.0``; no gradient list for a loss
  scaler that is off; no parameter list built per step; the RNG stream swapped only for a model that draws;
- a non-finite step still skipped on the device (fused AdamW's ``found_inf``): parameters, optimizer state and
  step count untouched, ``skipped`` and ``skipped_steps`` read when asked, the warning at the next log step;
- TensorBoard flushed on a timer, not per record; the spike detector's sorted window equals the medians.

Compilation (``train.compile``): the unit chosen per layout, "model" refused where blocks are needed, and the
whole model compiled with ``backend="aot_eager"`` (no C++ compiler) equal to eager training (losses and parameters
after 3 steps) at one rank and at world 2 under plait's reducer, DDP, ZeRO-1 and ZeRO-2, in one graph without
breaks at one rank. The world-2 checks share one spawned group.
"""

from __future__ import annotations

import copy
import logging
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import CollectiveCounter, run_ranks
from references import reference_training
from torch import nn
from torch.utils.data import TensorDataset

import plait

QUIET = {"observe": {"progress": False, "trackers": []}}
SEQ, GLOBAL, LR, STEPS = 16, 8, 1e-3, 3
NEVER = 10**6


def _plait(root: Any, **sections: Any) -> plait.Plait:
    train = {"global_batch_size": 4, "micro_batch_size": 4, "log_every": NEVER, "steps": NEVER,
             **sections.pop("train", {})}
    return plait.Plait(run={"dir": str(root)}, train=train, **QUIET, **sections)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _syncs(fn: Any, steps: int) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::_local_scalar_dense") / steps


def _ops(fn: Any, name: str) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == name)


def _files(root: Path) -> dict[str, tuple[int, int]]:
    return {str(f.relative_to(root)): (f.stat().st_mtime_ns, f.stat().st_size) for f in root.rglob("*") if f.is_file()}


def _api_loop(p: plait.Plait, model: nn.Module, opt_x: torch.Tensor | None = None) -> Any:
    g = torch.Generator().manual_seed(1)

    def step(log: bool | None = None) -> Any:
        x = torch.randn(4, 4, generator=g) if opt_x is None else opt_x
        p.backward(model(x).pow(2).mean())
        return p.step() if log is None else p.step(log=log)
    return step


def _hand_loop(model: nn.Module, opt: torch.optim.Optimizer) -> Any:
    g = torch.Generator().manual_seed(1)
    params = list(model.parameters())

    def step() -> None:
        model(torch.randn(4, 4, generator=g)).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
    return step


# -- files -----------------------------------------------------------------------------------------------------------
def test_a_non_logging_step_writes_no_file(tmp_path: Path) -> None:
    p = _plait(tmp_path / "api", optim={"grad_clip": 1.0})
    model, _ = p.setup(_mlp())
    step = _api_loop(p, model)
    step()  # step 1 logs: progress.json written
    before = _files(tmp_path / "api")
    assert "progress.json" in before
    for _ in range(4):
        step()
    assert _files(tmp_path / "api") == before
    step(log=True)  # a log step notes the progress
    assert '"steps": 6' in (tmp_path / "api" / "progress.json").read_text()
    for _ in range(2):
        step()
    p.close()  # the exact count at the end
    assert '"steps": 8' in (tmp_path / "api" / "progress.json").read_text()


def test_a_non_logging_trainer_step_writes_no_file(tmp_path: Path) -> None:
    from plait.recipes import build_trainer, load_recipe_config
    from plait.recipes import validate_config as validate

    flags = ["--model.n_layer=1", "--model.d_model=32", "--model.n_head=2", "--model.seq_len=16",
             "--train.global_batch_size=4", "--train.micro_batch_size=4", "--train.eval_every=0",
             "--train.log_every=100", "--train.steps=1000", "--checkpoint.every=0", "--observe.progress=false",
             "--observe.trackers=[]", f"--run.dir={tmp_path}/t"]
    (tmp_path / "t").mkdir()
    trainer = build_trainer(validate(load_recipe_config(overrides=flags), 1))
    trainer.train_step()
    before = _files(tmp_path / "t")
    assert {"progress.json", "goodput.jsonl"} <= set(before)
    recs = [trainer.train_step() for _ in range(3)]
    assert _files(tmp_path / "t") == before
    assert 3.0 < recs[-1]["loss"] < 7.0  # a record's device values are read when looked up
    trainer.p.close()


# -- device reads ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fused", "skip"), [(True, "auto"), (False, "auto"), (False, True)],
                         ids=["fused_adamw", "adamw", "adamw_skip_asked"])
def test_a_non_logging_step_reads_nothing_the_hand_loop_does_not(tmp_path: Path, fused: bool, skip: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A small decoder in the keep-your-loop API at world 1 (``p.backward(cross_entropy(model(x), y))``,
    ``p.step()``, ``optim.grad_clip = 1.0``, plait's AdamW from ``[optim]``) against the same loop by hand with
    ``clip_grad_norm_`` (``aten::_local_scalar_dense``, every read of a tensor's value on the host, counted over two
    steps each; the count is the same at every step). On the CPU both AdamWs read their own step counters (one per
    parameter, fused or not), on both sides. Fused AdamW takes ``found_inf``, so plait skips a non-finite step on the
    device: the same count. The plain AdamW (plait's default on the CPU) does not: with ``optim.skip_nonfinite=auto``
    (the default) plait applies its update as the hand loop does (no skip: the same count); asked to skip it
    (``optim.skip_nonfinite=true``) plait decides on the host, one read of the step's non-finite flag
    (``Layout._step_unless``), and that read is the only difference: with ``_step_unless`` stepping unconditionally the
    counts are equal."""
    hand_model = _gpt()
    hand_opt = torch.optim.AdamW(hand_model.parameters(), lr=LR, fused=fused)
    p = _plait(tmp_path, optim={"grad_clip": 1.0, "lr": LR, "fused": fused, "skip_nonfinite": skip},
               train={"global_batch_size": 8, "micro_batch_size": 8})
    model, _ = p.setup(_gpt())
    data = TensorDataset(torch.randint(0, 256, (64, SEQ)), torch.randint(0, 256, (64, SEQ)))
    x, y = data.tensors[0][:8], data.tensors[1][:8]

    def step() -> Any:
        p.backward(nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()))
        return p.step()
    for _ in range(2):
        _gpt_hand_step(hand_model, hand_opt, data), step()
    hand = _syncs(lambda: _gpt_hand_step(hand_model, hand_opt, data), 2)
    assert hand >= sum(1 for _ in model.parameters())  # the optimizer's own reads, on both sides
    assert _syncs(step, 2) - hand == (1 if skip is True and not fused else 0)
    monkeypatch.setattr(p.layout, "_step_unless", lambda found: p.layout._step())
    assert _syncs(step, 2) == hand  # the one extra read is the skip's decision, nothing else
    monkeypatch.undo()
    info = step()
    assert isinstance(info.__dict__["_loss"], torch.Tensor)  # kept on the device until read
    assert info.loss > 0 and info.grad_norm > 0 and info.skipped is False and info.global_loss == info.loss
    p.close()


def test_a_non_logging_trainer_step_reads_nothing(tmp_path: Path) -> None:
    p = _plait(tmp_path, train={"global_batch_size": 8, "micro_batch_size": 8}, optim={"grad_clip": 1.0},
               checkpoint={"every": 0})
    data = TensorDataset(torch.randint(0, 256, (64, SEQ)), torch.randint(0, 256, (64, SEQ)))
    trainer = plait.Trainer(_gpt(), train_data=data, loss_fn="causal_lm", plait=p,
                            optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=LR, fused=True))
    for _ in range(2):
        trainer.train_step()
    hand_model = _gpt()
    opt = torch.optim.AdamW(hand_model.parameters(), lr=LR, fused=True)
    assert _syncs(trainer.train_step, 3) == _syncs(lambda: _gpt_hand_step(hand_model, opt, data), 3)
    p.close()


def _gpt() -> nn.Module:
    from plait.models.tiny import seeded_gpt, tiny_config

    return seeded_gpt(tiny_config(n_layer=2, d_model=32, n_head=4, seq_len=SEQ))


def _gpt_hand_step(model: nn.Module, opt: torch.optim.Optimizer, data: TensorDataset) -> None:
    x, y = data.tensors[0][:8], data.tensors[1][:8]
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
    opt.step()
    opt.zero_grad()


# -- what a step does not do -------------------------------------------------------------------------------------------
def test_zero_grad_sets_none_and_no_loss_times_one(tmp_path: Path) -> None:
    p = _plait(tmp_path)
    model, _ = p.setup(nn.Linear(4, 2))
    loss = model(torch.ones(4, 4)).sum()  # its backward multiplies nothing
    assert _ops(lambda: p.backward(loss), "aten::mul") == 0  # no loss * 1.0
    p.step()
    assert all(q.grad is None for q in model.parameters())
    p.close()


def test_no_gradient_list_for_a_scaler_that_is_off_and_no_parameter_walk_per_step(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    p = _plait(tmp_path, optim={"grad_clip": 1.0})
    model, _ = p.setup(_mlp())
    step = _api_loop(p, model)
    step(), step()  # the second update measures the model state once (plait.observe.memory)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("walked on a step")
    monkeypatch.setattr(p.strategy, "grads", refuse)
    for name in ("parameters", "named_parameters", "modules", "named_modules"):
        monkeypatch.setattr(model, name, refuse)
    step()
    monkeypatch.undo()
    p.close()


def test_the_rng_stream_is_swapped_only_for_a_model_that_draws(tmp_path: Path) -> None:
    for drop, draws in ((0.0, False), (0.5, True)):
        p = _plait(tmp_path / str(drop))
        torch.manual_seed(0)
        model, _ = p.setup(nn.Sequential(nn.Linear(4, 4), nn.Dropout(drop), nn.Linear(4, 1)))
        user = torch.get_rng_state()
        step = _api_loop(p, model)
        step()
        assert p.rng.draws is draws
        assert ("forward" in model.__dict__) is draws  # a model that does not draw runs without the wrapper
        step()
        assert torch.equal(torch.get_rng_state(), user)  # the user's generator is the user's either way
        p.close()


# -- skipping a non-finite step on the device ----------------------------------------------------------------------
def test_a_non_finite_step_is_skipped_on_the_device(tmp_path: Path, caplog) -> None:
    p = _plait(tmp_path, train={"log_every": 4})
    model, opt = p.setup(_mlp(), optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=LR, fused=True),
                         scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    step = _api_loop(p, model)
    step(), step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = copy.deepcopy(opt.state_dict()["state"])
    handle = model[0].weight.register_hook(lambda g: g * float("nan"))
    with caplog.at_level(logging.WARNING):
        info = step()  # step 3: not a log step
        handle.remove()
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # nothing read yet
        assert info.skipped is True and p.skipped_steps == 1
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        after = opt.state_dict()["state"]
        assert all(torch.equal(state[i][k], after[i][k]) for i in state for k in state[i])  # step counts too
        assert p.scheduler.last_epoch == 3  # the schedule counts the skipped step (the host does not know)
        step()  # step 4 logs: the warning names step 3
    assert any("step 3" in r.getMessage() and "skipped" in r.getMessage() for r in caplog.records)
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert p.skipped_steps == 1
    p.close()


# -- small parts -------------------------------------------------------------------------------------------------------
def test_tensorboard_is_flushed_on_a_timer(tmp_path: Path, monkeypatch) -> None:
    from plait.observe.trackers import TensorBoardTracker

    t = TensorBoardTracker(tmp_path, None)
    flushes = []
    monkeypatch.setattr(t._writer, "flush", lambda: flushes.append(1))
    for step in range(1, 6):
        t.log({"loss": 1.0 / step}, step)
    assert flushes == []
    t.flush()
    assert flushes == [1]
    t.close()


def test_spike_detector_window_equals_the_medians() -> None:
    import random
    import statistics

    from plait.fault.spikes import SpikeDetector

    rng = random.Random(0)
    for window in (4, 5, 10, 50):
        d = SpikeDetector(3.0, window, jump=0.2, after_steps=10)
        for step in range(1, 151):
            x = rng.choice([rng.gauss(5, 1), round(rng.gauss(5, 1), 1), 5.0])
            judged = step > 10 and len(d.losses) >= d.window // 2
            assert d.judging(step) == judged
            if judged:
                m = statistics.median(d.losses)
                dev = 1.4826 * statistics.median(abs(y - m) for y in d.losses)
                limit = d.limit()
                assert abs(limit - max(m + 3.0 * max(dev, 0.01 * abs(m), 1e-12), 1.2 * m)) < 1e-9
                assert (d.observe(x, 1.0, step) == "spike") == (x > limit)
            else:
                assert d.observe(x, 1.0, step) is None
        assert d._sorted == sorted(d.losses)


def test_fused_adamw_on_a_gpu_unless_overridden() -> None:
    from plait.components.optim import use_fused
    from plait.config import OptimConfig

    gpu, cpu = [types.SimpleNamespace(device=torch.device("cuda", 0))], [torch.zeros(1)]
    assert use_fused(OptimConfig(), gpu) and not use_fused(OptimConfig(), cpu)
    assert not use_fused(OptimConfig(fused=False), gpu) and use_fused(OptimConfig(fused=True), cpu)


# -- compilation -------------------------------------------------------------------------------------------------------
def test_compile_unit_per_layout() -> None:
    from plait.config import load_config
    from plait.parallel.compile import CompileError, compile_unit
    from plait.parallel.compose import compile_blocks_because
    from plait.validate import validate

    def unit(*flags: str, world: int = 2) -> str | None:
        cfg = validate(load_config(overrides=list(flags)), world)
        return compile_unit(cfg, compile_blocks_because(cfg))[0]

    assert unit("--train.compile=false") is None
    for flags in ([], ["--parallel.impl=torch"], ["--parallel.zero=1"], ["--parallel.zero=2"]):
        assert unit("--train.compile=true", *flags) == unit("--train.compile=auto", *flags) == "model", flags
    for flags in (["--parallel.zero=3"], ["--parallel.tp=2"], ["--parallel.pp=2"],
                  ["--train.activation_checkpointing=full"]):
        assert unit("--train.compile=auto", *flags) == "blocks", flags
        with pytest.raises(CompileError, match="train.compile=blocks"):
            unit("--train.compile=model", *flags)
    assert unit("--train.compile=blocks") == "blocks"


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (64, SEQ + 1), generator=g)
    return TensorDataset(ids[:, :-1], ids[:, 1:])


def _train_compiled(root: str, parallel: dict, world: int, compile_: Any = "model") -> dict:
    p = plait.Plait(run={"dir": root}, parallel=parallel, optim={"lr": LR, "grad_clip": 1.0}, **QUIET,
                    train={"compile": compile_, "compile_backend": "aot_eager", "global_batch_size": GLOBAL,
                           "micro_batch_size": GLOBAL // world})
    model, _ = p.setup(_gpt(), optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=LR), loss_fn="causal_lm")
    losses = []
    for batch in p.setup_dataloader(_data()):
        p.forward_backward(model, batch)
        info = p.step()
        losses.append(info.global_loss)
        if info.step == STEPS:
            break
    out = {"losses": losses, "state": p.full_state_dict(model),
           "whole": model._compiled_call_impl is not None and getattr(p.loss, "_plait_compiled", False)}
    p.close()
    return out


def _reference() -> tuple[list[float], dict]:
    from plait.components.losses import CausalLMLoss

    return reference_training(_gpt(), _data(), GLOBAL, STEPS, LR, 1337, lambda m, b: CausalLMLoss()(m, b))


def _same_training(got: dict, ref: tuple[list[float], dict], name: str) -> None:
    assert got["whole"], name
    assert got["losses"] == pytest.approx(ref[0], abs=1e-5), name
    assert max((got["state"][k] - v).abs().max().item() for k, v in ref[1].items()) < 1e-4, name


def test_whole_model_compile_equals_eager_in_one_graph(tmp_path: Path) -> None:
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    got = _train_compiled(str(tmp_path), {}, 1)
    _same_training(got, _reference(), "one rank")
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1 and not dynamo_utils.counters["graph_break"]


# -- world 2: one spawned group ----------------------------------------------------------------------------------------
COMPILED = {"dp": {}, "ddp": {"impl": "torch"}, "zero1": {"zero": 1}, "zero2": {"zero": 2}}


def _world2(rank: int, world: int, root: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    out: dict[str, Any] = {}
    hand_model = DistributedDataParallel(_mlp())
    hand = _hand_loop(hand_model, torch.optim.AdamW(hand_model.parameters(), lr=LR, fused=True))
    p = _plait(f"{root}/dp", train={"global_batch_size": 8, "log_every": 5}, optim={"grad_clip": 1.0})
    model, _ = p.setup(_mlp(), optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=LR, fused=True))
    step = _api_loop(p, model)
    hand(), step(), step()  # steps 1 (log) and 2
    out["extra_syncs"] = _syncs(step, 1) - _syncs(hand, 1)  # step 3
    with CollectiveCounter() as c:
        info = step()  # step 4
    out["collectives"], out["buckets"] = c.calls, len(p.layout.policy.engine.buckets)
    with CollectiveCounter() as c:
        out["global_loss"] = info.global_loss  # read off a log step: the agreement now
    out["agreement_calls"] = c.calls
    p.preemption.requested = rank == 1  # a SIGTERM on rank 1 before step 5's end
    info5 = step()
    out["preempted"] = [info.preempted, info5.preempted]
    p.preemption.requested = False
    p.close()
    out["slow"] = _slow_steps(f"{root}/slow", rank)
    ddp = _plait(f"{root}/ddp", parallel={"impl": "torch"}, train={"global_batch_size": 8})
    model, _ = ddp.setup(_mlp())
    _api_loop(ddp, model)()
    out["ddp_grads_none"] = all(q.grad is None for q in model.parameters())
    ddp.close()
    for name, parallel in COMPILED.items():
        out[name] = _train_compiled(f"{root}/{name}", parallel, world)
    return out


def _slow_steps(root: str, rank: int) -> dict:
    """Steps "slower" than STOP_CHECK_S / log_every (the limit patched down): a stop request is checked at every
    step, one all-reduce of one flag beside the gradients', and reaches every rank at the next step."""
    from plait.engine import stepper

    kept, stepper.STOP_CHECK_S = stepper.STOP_CHECK_S, 1e-9
    try:
        p = _plait(root, train={"global_batch_size": 8, "log_every": 100})
        model, _ = p.setup(_mlp())
        step = _api_loop(p, model)
        step(), step()  # step 1 logs and plans the checks from the agreed step time
        with CollectiveCounter() as c:
            info3 = step()
        p.preemption.requested = rank == 1
        info4 = step()
        p.preemption.requested = False
        out = {"collectives": c.calls, "buckets": len(p.layout.policy.engine.buckets),
               "preempted": [info3.preempted, info4.preempted]}
        p.close()
        return out
    finally:
        stepper.STOP_CHECK_S = kept


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> list[dict]:
    return run_ranks(_world2, 2, str(tmp_path_factory.mktemp("hot_path")), timeout=600)


def test_world2_non_logging_step_reads_nothing_the_ddp_loop_does_not(world2) -> None:
    assert [r["extra_syncs"] for r in world2] == [0, 0]


def test_world2_non_logging_step_runs_only_the_gradients_collectives(world2) -> None:
    for r in world2:
        assert r["collectives"] == r["buckets"]  # the gradients' own all-reduces, nothing more
        assert r["agreement_calls"] == 1  # reading global_loss off a log step: its agreement, then
    assert world2[0]["global_loss"] == world2[1]["global_loss"]


def test_world2_a_stop_request_reaches_every_rank_at_the_next_log_step(world2) -> None:
    assert [r["preempted"] for r in world2] == [[False, True], [False, True]]  # step 4 not, step 5 (a log step) yes


def test_world2_slow_steps_check_a_stop_request_at_every_step(world2) -> None:
    for r in world2:
        assert r["slow"]["collectives"] == r["slow"]["buckets"] + 1  # the gradients' and one stop check
        assert r["slow"]["preempted"] == [False, True]


def test_world2_ddp_drops_gradients(world2) -> None:
    assert all(r["ddp_grads_none"] for r in world2)


@pytest.mark.parametrize("name", sorted(COMPILED))
def test_world2_whole_model_compile_equals_eager(world2, name) -> None:
    ref = _reference()
    for r in world2:
        _same_training(r[name], ref, name)


USER_COMPILED = """
    import json, sys
    import torch
    import plait
    from torch.utils.data import TensorDataset
    from plait.models.tiny import seeded_gpt, tiny_config

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (64, 17), generator=g)
    data = TensorDataset(ids[:, :-1], ids[:, 1:])
    model = torch.compile(seeded_gpt(tiny_config(n_layer=2, d_model=32, n_head=4, seq_len=16)), backend="aot_eager")
    p = plait.Plait(run={"dir": "run"}, train={"global_batch_size": 8, "micro_batch_size": 4},
                    optim={"grad_clip": 1.0}, observe={"progress": False, "trackers": []})
    model, _ = p.setup(model, optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), loss_fn="causal_lm")
    losses = []
    for batch in p.setup_dataloader(data):
        p.forward_backward(model, batch)
        losses.append(p.step().global_loss)
        if p.steps == 3:
            break
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    state = {k: v.tolist() for k, v in p.full_state_dict(model).items()}
    if p.is_main:
        json.dump({"losses": losses, "frames": frames, "state": state}, open("out.json", "w"))
    p.close()
"""


def test_a_model_the_user_compiled_keeps_its_backend_under_plait_run_without_a_compiler(tmp_path: Path) -> None:
    """``torch.compile(model, backend="aot_eager")`` under ``plait run --nproc 2`` with no C++ compiler on PATH: plait
    compiles it again with the user's own dynamo context (inductor, plait's default, would need one), and it trains
    like eager one-process training."""
    import json
    import shutil
    import subprocess
    import textwrap

    from helpers import cli_argv, cli_env

    (tmp_path / "train.py").write_text(textwrap.dedent(USER_COMPILED))
    (tmp_path / "bin").mkdir()  # PATH holds nothing: no g++, no c++, no cc
    env = {**cli_env(), "PATH": str(tmp_path / "bin")}
    assert all(shutil.which(cc, path=env["PATH"]) is None for cc in ("g++", "c++", "cc", "clang++"))
    done = subprocess.run(cli_argv("run", "--nproc", "2", "train.py"), cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["frames"] > 0
    ref_losses, ref_state = _reference()
    assert out["losses"] == pytest.approx(ref_losses, abs=1e-5)
    assert max((torch.tensor(out["state"][k]) - v).abs().max().item() for k, v in ref_state.items()) < 1e-4
    assert "the user's torch.compile options" in done.stderr, done.stderr[-2000:]
