"""DiLoCo (``parallel.sync = "diloco"``) through ``plait.Plait`` on 2 gloo ranks, against per-step data parallelism
and against a single-process DiLoCo written in plain PyTorch (two model copies, torch's own ``SGD`` as the outer
Nesterov optimizer).

Tolerances: H = 1 with outer SGD at learning rate 1 and no momentum averages the replicas' weights after each
SGD step, which is data parallelism's SGD update in another summation order: losses and parameters within 1e-6
(measured ~1e-8). The H = 4 run with inner AdamW and DiLoCo's outer Nesterov against the plain-PyTorch reference:
the same maths, the mean of the pseudo-gradients taken in another order: within 1e-5 (a missed synchronisation,
a wrong sign or a missing momentum term moves parameters by >1e-3). Replicas' weights after a synchronisation:
bit-identical. Bytes: exact, from plait's own accounting (``StepInfo.comm_bytes``).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import run_ranks
from torch import nn

from plait.config import ConfigError

WORLD, BATCH = 2, 8


def _toy() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _batch(step: int, rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch of a learnable regression, or replica ``rank``'s half of it."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH if step >= 0 else 256, 8, generator=g)
    y = x[:, :4].sum(1, keepdim=True) * 0.5
    if rank is None:
        return x, y
    share = BATCH // WORLD
    return x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]


def _sgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def _adamw(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=1e-2)


def _adamw_decay(m: nn.Module) -> torch.optim.Optimizer:
    """plait's default AdamW settings (betas 0.9/0.95, weight decay 0.1)."""
    return torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


SCHEDULE_STEPS, CLIP = 30, 0.05


def _lr_factor(step: int) -> float:
    """Linear warm-up over 3 steps, then cosine to 0.1 at step SCHEDULE_STEPS (counted in inner steps)."""
    if step < 3:
        return (step + 1) / 3
    progress = min(1.0, (step - 3) / (SCHEDULE_STEPS - 3))
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


def _warmup_cosine(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, _lr_factor)


def _train(rank: int, root: str, name: str, steps: int, optimizer, parallel: dict, save_at: int = 0,
           comm: dict | None = None, scheduler=None, optim: dict | None = None) -> dict:
    import plait

    p = plait.Plait(run={"dir": f"{root}/{name}"}, observe={"progress": False, "trackers": []},
                    train={"global_batch_size": BATCH, "micro_batch_size": BATCH // WORLD, "steps": steps},
                    parallel=parallel, comm=comm or {}, optim=optim or {})
    model, _ = p.setup(_toy(), optimizer=optimizer, scheduler=scheduler)
    held_out = _batch(-1)  # one fixed batch no step trains on (the generator's seed 999)
    with torch.no_grad():
        start = float(nn.functional.mse_loss(model(held_out[0]), held_out[1]))
    losses, sent, weights, lrs = [], [], {}, []
    for step in range(steps):
        x, y = _batch(step, p.dp_rank)
        loss = nn.functional.mse_loss(model(x), y)
        p.backward(loss)
        info = p.step(log=False)  # no agreement collective: comm_bytes are the synchronisation's alone
        losses.append(float(loss))
        sent.append(info.comm_bytes)
        lrs.append(float(info.lr))
        weights[step + 1] = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        end = float(nn.functional.mse_loss(model(held_out[0]), held_out[1]))
    with p.evaluation():  # what an evaluation loop scores
        scored = {k: v.clone() for k, v in model.state_dict().items()}
        scored_loss = float(p.evaluate(model, held_out, nn.functional.mse_loss))
    after = {k: v.clone() for k, v in model.state_dict().items()}
    out = {"scored": scored, "scored_loss": scored_loss, "after_evaluation": after, "losses": losses, "bytes": sent,
           "weights": weights, "held_out": (start, end), "lrs": lrs,
           "params": sum(q.numel() for q in model.parameters())}
    if save_at:
        p.save(f"{root}/{name}/ckpt", model=model)
        p.load(f"{root}/{name}/ckpt", model=model)
        out["loaded"] = {k: v.clone() for k, v in model.state_dict().items()}
    p.close()
    return out


def _plait_train(root: str) -> list[dict]:
    """``plait train``'s loop (the gpt recipe on the tiny model), 4 steps, a synchronisation every 2."""
    import json
    from pathlib import Path

    from helpers import TINY_CLI

    from plait.recipes import build_trainer, load_recipe_config, validate_config

    args = [a for a in TINY_CLI if not a.startswith("--parallel.nproc")]
    cfg = validate_config(load_recipe_config(overrides=args + [
        "--train.steps=4", "--parallel.sync=diloco", "--parallel.diloco_inner_steps=2", "--checkpoint.every=2",
        "--train.eval_every=1",
        f"--run.dir={root}/trainer"]), WORLD)
    Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
    build_trainer(cfg).fit()
    return [json.loads(line) for line in (Path(cfg.run.dir) / "metrics.jsonl").read_text().splitlines()]


def _runs(rank: int, world: int, root: str) -> dict:
    h1 = {"sync": "diloco", "diloco_inner_steps": 1, "diloco_outer_lr": 1.0, "diloco_outer_momentum": 0.0,
          "diloco_nesterov": False}
    return {
        "dp_sgd": _train(rank, root, "dp_sgd", 6, _sgd, {}),
        "diloco_h1": _train(rank, root, "diloco_h1", 6, _sgd, h1),
        # DiLoCo's defaults (outer lr 0.7, Nesterov momentum 0.9); saved and reloaded 2 steps into a period
        "diloco_h4": _train(rank, root, "diloco_h4", 10, _adamw, {"sync": "diloco", "diloco_inner_steps": 4},
                            save_at=10),
        "dp_16": _train(rank, root, "dp_16", 16, _adamw, {}),
        "diloco_h8": _train(rank, root, "diloco_h8", 16, _adamw, {"sync": "diloco", "diloco_inner_steps": 8}),
        "diloco_h4_f2": _train(rank, root, "diloco_h4_f2", 8, _adamw, {"sync": "diloco", "diloco_inner_steps": 4,
                                                                      "diloco_fragments": 2}),
        "diloco_h4_int8": _train(rank, root, "diloco_h4_int8", 8, _adamw, {"sync": "diloco", "diloco_inner_steps": 4},
                                 comm={"compress": "int8"}),
        # H = 10 over 3 periods with what a training run adds: a warm-up + cosine LR schedule stepped per inner
        # step, gradient clipping (optim.grad_clip), AdamW with weight decay
        "diloco_h10_sched": _train(rank, root, "diloco_h10_sched", SCHEDULE_STEPS, _adamw_decay,
                                   {"sync": "diloco", "diloco_inner_steps": 10}, scheduler=_warmup_cosine,
                                   optim={"grad_clip": CLIP}),
        "trainer": _plait_train(root),
    }


def _reference(steps: int, inner_steps: int, fragments: tuple[list[str], ...] | None = None,
               optimizer=_adamw, scheduler=None, clip: float = 0.0, reset_inner: bool = False
               ) -> tuple[dict[int, list[dict[str, torch.Tensor]]], list[float]]:
    """DiLoCo in one process: two replicas with their own inner optimizer (``optimizer``, default AdamW), each with
    its own LR scheduler (``scheduler``, stepped every inner step) and gradient clipping at ``clip`` (0: none), torch's
    Nesterov SGD (0.7, 0.9) outside; the inner optimizers keep their state across synchronisations (``reset_inner``:
    a fresh optimizer after each, to show the comparison tells them apart). With ``fragments`` (parameter names per
    fragment, streaming DiLoCo), fragment f synchronises at step (f + 1) x H / F of each period, with its own outer
    SGD. Returns the replicas' weights after each step, and the inner gradient norms before clipping."""
    base = _toy()
    replicas = [copy.deepcopy(base) for _ in range(WORLD)]
    inner = [optimizer(m) for m in replicas]
    schedules = [scheduler(o) for o in inner] if scheduler is not None else []
    outer_model = copy.deepcopy(base)
    names = fragments or ([n for n, _ in base.named_parameters()],)
    params = dict(outer_model.named_parameters())
    outers = [torch.optim.SGD([params[n] for n in group], lr=0.7, momentum=0.9, nesterov=True) for group in names]
    weights, norms = {}, []
    for step in range(steps):
        for r, (m, opt) in enumerate(zip(replicas, inner, strict=True)):
            x, y = _batch(step, r)
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            if clip:
                norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), clip)))
            opt.step()
        for sched in schedules:
            sched.step()
        for f, (group, outer) in enumerate(zip(names, outers, strict=True)):
            if (step + 1) % inner_steps != (f + 1) * inner_steps // len(names) % inner_steps:
                continue
            with torch.no_grad():
                for n in group:
                    q = params[n]
                    q.grad = q - torch.stack([dict(m.named_parameters())[n] for m in replicas]).mean(0)
                outer.step()
                for m in replicas:
                    for n in group:
                        dict(m.named_parameters())[n].copy_(params[n])
        if reset_inner and (step + 1) % inner_steps == 0:
            for r, m in enumerate(replicas):
                lr = inner[r].param_groups[0]["lr"]
                inner[r] = optimizer(m)
                inner[r].param_groups[0]["lr"] = lr
        weights[step + 1] = [{k: v.clone() for k, v in m.state_dict().items()} for m in replicas]
    return weights, norms


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    return run_ranks(_runs, WORLD, str(tmp_path_factory.mktemp("diloco")), timeout=240)


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=0, atol=atol) for k in a)


def test_one_inner_step_at_outer_lr_1_is_data_parallelism(runs: list[dict]) -> None:
    for rank in range(WORLD):
        dp, h1 = runs[rank]["dp_sgd"], runs[rank]["diloco_h1"]
        assert h1["losses"] == pytest.approx(dp["losses"], abs=1e-6)
        for step in dp["weights"]:
            assert _close(h1["weights"][step], dp["weights"][step], 1e-6), step
    assert all(b > 0 for b in runs[0]["diloco_h1"]["bytes"])  # it did communicate, every step


def test_matches_single_process_diloco_and_replicas_agree_after_each_sync(runs: list[dict]) -> None:
    ref, _ = _reference(10, 4)
    for rank in range(WORLD):
        got = runs[rank]["diloco_h4"]["weights"]
        for step in range(1, 11):
            assert _close(got[step], ref[step][rank], 1e-5), (rank, step)
    a, b = runs[0]["diloco_h4"]["weights"], runs[1]["diloco_h4"]["weights"]
    for step in (4, 8):
        assert all(torch.equal(a[step][k], b[step][k]) for k in a[step])
    assert not all(torch.equal(a[10][k], b[10][k]) for k in a[10])  # between synchronisations they drift apart


def test_checkpoint_holds_the_synchronised_weights(runs: list[dict]) -> None:
    # saved 2 steps into a period: what is saved, and loaded on every replica, is the weights of step 8's sync
    for rank in range(WORLD):
        run = runs[rank]["diloco_h4"]
        assert all(torch.equal(run["loaded"][k], runs[0]["diloco_h4"]["weights"][8][k]) for k in run["loaded"])


def test_h8_trains_and_sends_an_eighth_of_data_parallel_bytes(runs: list[dict]) -> None:
    dp, dl = runs[0]["dp_16"], runs[0]["diloco_h8"]
    params = dp["params"]
    assert dp["bytes"] == [params * 4] * 16  # world 2: a ring all-reduce sends the buffer's size once per step
    assert dl["bytes"] == ([0] * 7 + [params * 4]) * 2  # nothing on inner steps, one all-reduce every 8th
    assert sum(dl["bytes"]) * 8 == sum(dp["bytes"])
    for rank in range(WORLD):  # after step 16's synchronisation, on 256 samples no step trained on
        start, end = runs[rank]["diloco_h8"]["held_out"]
        assert end < 0.7 * start, (start, end, runs[rank]["dp_16"]["held_out"])


@pytest.mark.parametrize("overrides, message", [
    ({"parallel": {"diloco_inner_steps": 0}}, "diloco_inner_steps must be at least 1"),
    ({"parallel": {"diloco_outer_lr": 0.0}}, "diloco_outer_lr must be above 0"),
    ({"parallel": {"diloco_outer_momentum": 1.0}}, "diloco_outer_momentum must be in [0, 1)"),
    ({"parallel": {"diloco_outer_momentum": 0.0}}, "diloco_nesterov needs a momentum"),
    ({"parallel": {"diloco_fragments": 3, "diloco_inner_steps": 2}}, "diloco_fragments must lie in 1..diloco_inner"),
    ({"parallel": {"zero": 2}}, "a replica here has one: set parallel.dp_shard=N"),
    ({"parallel": {"impl": "torch"}}, "set parallel.impl=plait"),
    ({"comm": {"compress": "auto"}}, "name a compressor for the pseudo-gradient"),
    ({"parallel": {"mode": "ps"}}, "parameter server"),
])
def test_bad_settings_are_one_clear_error(overrides: dict, message: str) -> None:
    from plait.config import from_sections
    from plait.validate import validate

    sections = {"train": {"global_batch_size": 8}, **overrides}
    sections["parallel"] = {"sync": "diloco", **overrides.get("parallel", {})}
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        validate(from_sections(sections), 2)


def test_plait_train_synchronises_every_h_steps(runs: list[dict]) -> None:
    records = [r for r in runs[0]["trainer"] if "diloco_synced" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["diloco_synced"] for r in records] == [False, True, False, True]
    # inner steps send only the log step's agreement (a few numbers); a synchronisation sends every weight
    assert all(r["comm_bytes"] < 100 for r in records[::2])
    assert all(r["comm_bytes"] > 100_000 for r in records[1::2])


def test_compressed_pseudo_gradient(runs: list[dict]) -> None:
    # int8 with per-chunk scales: a quarter of float32's bytes and a little more, at the synchronisations only
    plain, packed = runs[0]["diloco_h4"]["bytes"][:8], runs[0]["diloco_h4_int8"]["bytes"]
    assert [b > 0 for b in packed] == [False, False, False, True] * 2
    assert 0.2 * plain[3] < packed[3] < 0.5 * plain[3]
    a, b = runs[0]["diloco_h4_int8"]["weights"], runs[1]["diloco_h4_int8"]["weights"]
    assert all(torch.equal(a[8][k], b[8][k]) for k in a[8])  # the compressed mean is the same on every replica
    # close to the uncompressed run (int8 rounding of the pseudo-gradient, error feedback), not equal to it
    ref = runs[0]["diloco_h4"]["weights"][8]
    assert _close(a[8], ref, 5e-3) and not _close(a[8], ref, 1e-7)


def test_streaming_fragments_match_single_process_and_split_the_bytes(runs: list[dict]) -> None:
    from plait.parallel.data.diloco import split_fragments

    # the toy's 161 values: 0.weight (128) alone, then the other three (33); fragment 0 syncs at step 2 of 4, 1 at 4
    assert split_fragments([128, 16, 16, 1], 2) == [(0, 1, 0, 128), (1, 4, 128, 161)]
    ref, _ = _reference(8, 4, (["0.weight"], ["0.bias", "2.weight", "2.bias"]))
    for rank in range(WORLD):
        got = runs[rank]["diloco_h4_f2"]["weights"]
        for step in range(1, 9):
            assert _close(got[step], ref[step][rank], 1e-5), (rank, step)
    assert runs[0]["diloco_h4_f2"]["bytes"] == [0, 128 * 4, 0, 33 * 4] * 2  # world 2: one buffer's size per sync
    a, b = runs[0]["diloco_h4_f2"]["weights"], runs[1]["diloco_h4_f2"]["weights"]
    assert torch.equal(a[2]["0.weight"], b[2]["0.weight"]) and not torch.equal(a[2]["2.weight"], b[2]["2.weight"])
    assert all(torch.equal(a[4][k], b[4][k]) for k in ("0.bias", "2.weight", "2.bias"))


def test_h10_with_schedule_clipping_and_weight_decay_matches_single_process_diloco(runs: list[dict]) -> None:
    """What a training run adds to the inner steps, over 3 periods of H = 10: the LR schedule is counted in inner steps
    (warm-up and cosine per replica, the outer step at its constant 0.7), each replica clips its own gradients, the
    inner AdamW keeps its state across synchronisations, the outer momentum carries over."""
    ref, norms = _reference(SCHEDULE_STEPS, 10, optimizer=_adamw_decay, scheduler=_warmup_cosine, clip=CLIP)
    assert sum(n > CLIP for n in norms) > len(norms) // 2  # clipping is active on most inner steps
    for rank in range(WORLD):
        run = runs[rank]["diloco_h10_sched"]
        assert run["lrs"] == pytest.approx([1e-2 * _lr_factor(s) for s in range(SCHEDULE_STEPS)], rel=1e-6)
        for step in range(1, SCHEDULE_STEPS + 1):
            assert _close(run["weights"][step], ref[step][rank], 1e-5), (rank, step)
    a, b = runs[0]["diloco_h10_sched"]["weights"], runs[1]["diloco_h10_sched"]["weights"]
    for step in (10, 20, 30):
        assert all(torch.equal(a[step][k], b[step][k]) for k in a[step])
    # the comparison can fail: without clipping, or with the inner state reset at each synchronisation, the
    # reference moves by far more than the tolerance
    for other in (_reference(SCHEDULE_STEPS, 10, optimizer=_adamw_decay, scheduler=_warmup_cosine),
                  _reference(SCHEDULE_STEPS, 10, optimizer=_adamw_decay, scheduler=_warmup_cosine, clip=CLIP,
                             reset_inner=True)):
        assert not _close(other[0][SCHEDULE_STEPS][0], ref[SCHEDULE_STEPS][0], 1e-3)


def test_evaluation_scores_the_synchronised_weights(runs: list[dict]) -> None:
    # the H = 4 run ends 2 steps into a period: the replicas' own weights differ, an evaluation scores step 8's
    # synchronised weights on every rank (the ones saved), and the replica's own come back after it
    for rank in range(WORLD):
        run = runs[rank]["diloco_h4"]
        assert all(torch.equal(run["scored"][k], runs[0]["diloco_h4"]["weights"][8][k]) for k in run["scored"])
        assert all(torch.equal(run["after_evaluation"][k], run["weights"][10][k]) for k in run["weights"][10])
    assert runs[0]["diloco_h4"]["scored_loss"] == runs[1]["diloco_h4"]["scored_loss"]
    # the trainer evaluates in it: at step 3 (one step into a period) it scores step 2's synchronised weights again
    val = {r["step"]: r["val_loss"] for r in runs[0]["trainer"] if "val_loss" in r}
    assert val[3] == val[2] and val[1] != val[2], val
    # data parallelism: the model's own weights
    assert all(torch.equal(runs[0]["dp_16"]["scored"][k], runs[0]["dp_16"]["weights"][16][k])
               for k in runs[0]["dp_16"]["scored"])
