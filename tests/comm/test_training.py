"""The comm layer in the training path: algorithms, compression, auto-compression, resume, hang guard.

Every test drives plait's ``Trainer`` on 2 gloo ranks: the quality, algorithm, resume and auto-compression
checks share one spawn (``group``: each runs its configurations one after another in its own directory);
the hang test, which ends a rank on purpose, and the command line run have processes of their own.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers import run_ranks

from plait.recipes import load_recipe_config as load_config  # plait train's config: the gpt recipe's defaults
from plait.recipes import validate_config as validate

SMALL = ["--model.n_layer=2", "--model.d_model=32", "--model.n_head=2", "--model.seq_len=32",
         "--train.global_batch_size=16", "--train.micro_batch_size=8", "--train.eval_sequences=32",
         "--train.eval_every=0", "--train.log_every=1", "--optim.warmup_steps=2", "--optim.lr=1e-2",
         "--observe.progress=false", "--observe.trackers=[]", "--checkpoint.every=0",
         "--parallel.nproc=2", "--parallel.bucket_mb=0.02"]  # ~5k-element buckets: several per step

TRAIN_STEPS = 120
# The quality comparison runs where training is stable enough to compare single runs: a global batch of
# 32, lr 3e-3, 64 evaluation sequences, 120 steps. (At 30 steps and lr 1e-2, the regime this test used
# before, the final loss of uncompressed runs alone spread over +-8% across seeds, and a change of data
# order moved compressed runs from +3% to +11% of uncompressed: single runs could not be compared.)
QUALITY_REGIME = ["--train.global_batch_size=32", "--train.micro_batch_size=16", "--optim.lr=3e-3",
                  "--train.eval_sequences=64"]
# Compressed runs (all with error feedback) must not end more than 5% above the uncompressed final
# loss from the same seed (topk at ratio 0.1: 10%). Ending lower is no loss of quality.
LOSS_TOLERANCE = {"topk-0.1": 0.10}
DEFAULT_TOLERANCE = 0.05
# plait's algorithms sum in another order than gloo: fp32 rounding only, amplified a little by Adam.
ALGORITHM_ATOL = 1e-4

# Each compressor with its documented defaults (128-element quantization blocks), all with error
# feedback. Measured here (final val loss vs uncompressed, same seed): fp16 +0.0%, bf16 -0.0%, int8 -0.5%
# (round to nearest) / -0.2% (stochastic), int4 +0.3%, powersgd +0.3%, zero2+powersgd +2.1%, topk at
# ratio 0.1 +4.9%. The sparsifiers at small ratios learn markedly slower with AdamW and are not held to
# a bound: topk at its default ratio 0.01 +39% and randomk at ratio 0.5 +17% (without error feedback
# +28% and +13%: error feedback does not close the gap under Adam's normalisation).
QUALITY = {
    "none": [],
    "fp16": ["--comm.compress=fp16"],
    "bf16": ["--comm.compress=bf16"],
    "int8": ["--comm.compress=int8"],
    "int8-stochastic": ["--comm.compress=int8", "--comm.stochastic_rounding=true"],
    "int4": ["--comm.compress=int4"],
    "topk-0.1": ["--comm.compress=topk", "--comm.compress_ratio=0.1"],
    "powersgd": ["--comm.compress=powersgd", "--comm.powersgd_rank=4"],
    "zero2+powersgd": ["--parallel.zero=2", "--comm.compress=powersgd", "--comm.powersgd_rank=4"],
}
ALGORITHMS = {
    "ring": ["--comm.allreduce=ring"],
    "halving_doubling": ["--comm.allreduce=halving_doubling"],
    "hierarchical": ["--comm.allreduce=hierarchical", "--comm.ranks_per_node=1"],
    "ring+int8": ["--comm.allreduce=ring", "--comm.compress=int8"],
}


def _trainer(root: str, name: str, extra: list[str]):
    from plait.recipes import build_trainer

    cfg = validate(load_config(overrides=SMALL + extra + [f"--run.dir={root}/{name}"]), 2)
    Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
    return build_trainer(cfg)


def _train(rank: int, world: int, root: str, runs: dict[str, list[str]], steps: int) -> dict:
    out = {}
    for name, extra in runs.items():
        t = _trainer(root, name, extra + [f"--train.steps={steps}"])
        recs = [t.train_step() for _ in range(steps)]
        out[name] = {"val_loss": t.evaluate(), "bytes": [r["comm_bytes"] for r in recs],
                     "params": {k: v.clone() for k, v in t.model.state_dict().items()}}
        t.comm.close()
    return out


RESUME_CASES = {"powersgd": ["--comm.compress=powersgd"], "zero2-int8": ["--parallel.zero=2", "--comm.compress=int8"]}


def _group(rank: int, world: int, root: str) -> dict:
    """The checks that share one spawn of 2 ranks, each in a directory of its own under ``root``."""
    return {"quality": _train(rank, world, f"{root}/quality", {k: QUALITY_REGIME + v for k, v in QUALITY.items()},
                              TRAIN_STEPS),
            "algorithms": _train(rank, world, f"{root}/algorithms", {"backend": [], **ALGORITHMS}, 4),
            **{f"resume-{name}": _resume(rank, world, f"{root}/resume-{name}", extra)
               for name, extra in RESUME_CASES.items()},
            "auto": _auto(rank, world, f"{root}/auto")}


@pytest.fixture(scope="module")
def group(tmp_path_factory) -> tuple[list[dict], Path]:
    root = tmp_path_factory.mktemp("comm-training")
    return run_ranks(_group, 2, str(root), timeout=600), root


def test_compressed_training_reaches_uncompressed_loss(group) -> None:
    results = [r["quality"] for r in group[0]]
    r0 = results[0]
    base = r0["none"]["val_loss"]
    print({name: round(r["val_loss"], 4) for name, r in r0.items()})
    assert base < 3.5, f"the uncompressed run did not train ({base})"  # starts at ln(256) = 5.5
    for name in QUALITY:
        assert results[0][name]["val_loss"] == results[1][name]["val_loss"]
        if name == "none":
            continue
        loss = r0[name]["val_loss"]
        tolerance = LOSS_TOLERANCE.get(name, DEFAULT_TOLERANCE)
        assert loss <= (1 + tolerance) * base, f"{name}: {loss} vs uncompressed {base}"
        # comm_bytes counts the compressed payloads: fewer bytes than the fp32 reduction
        assert sum(r0[name]["bytes"]) < sum(r0["none"]["bytes"]), name
        for k, v in r0[name]["params"].items():  # every rank applied the same averaged gradients
            assert torch.equal(v, results[1][name]["params"][k]), (name, k)


def test_reducer_algorithms_match_backend(group) -> None:
    r0 = group[0][0]["algorithms"]
    for name in ("ring", "halving_doubling", "hierarchical"):
        for k, v in r0[name]["params"].items():
            torch.testing.assert_close(v, r0["backend"]["params"][k], rtol=0, atol=ALGORITHM_ATOL, msg=name)
        assert r0[name]["bytes"] == r0["backend"]["bytes"]  # same ring-model byte count
    assert sum(r0["ring+int8"]["bytes"]) < sum(r0["backend"]["bytes"])
    assert abs(r0["ring+int8"]["val_loss"] - r0["backend"]["val_loss"]) < 0.05


# -- resume ------------------------------------------------------------------------------------------
RESUME = ["--train.deterministic=true", "--optim.decay_steps=6", "--train.steps=6"]


def _resume(rank: int, world: int, root: str, extra: list[str]) -> dict:
    straight = _trainer(root, "straight", RESUME + extra)
    for _ in range(6):
        straight.train_step()
    split = _trainer(root, "split", RESUME + extra)
    for _ in range(3):
        split.train_step()
    split.save()
    residual = split.comm.compressors[0].residual(0)
    resumed = _trainer(root, "split", RESUME + extra)
    resumed.resume()
    for _ in range(3):
        resumed.train_step()
    # Negative control: the same resume without the compressor state must differ, or the test
    # would not show that the residuals are restored.
    blind = _trainer(root, "split", RESUME + extra)
    blind.resume()
    for c in blind.comm.compressors:
        c.load_state_dict(type(c)(**_ctor(c)).state_dict())
    for _ in range(3):
        blind.train_step()
    for t in (straight, split, resumed, blind):
        t.comm.close()
    return {"residual_norm": float(residual.norm()), "straight": straight.model.state_dict(),
            "resumed": resumed.model.state_dict(), "blind": blind.model.state_dict()}


def _ctor(c) -> dict:
    """Constructor arguments that rebuild compressor ``c`` with fresh state (same seed)."""
    kw = {"error_feedback": c.error_feedback, "seed": c.seed}
    if c.name == "powersgd":
        kw["rank"] = c.rank
    elif c.name.startswith("int"):
        kw.update(bits=c.bits, block=c.block, stochastic_rounding=c.stochastic)
    return kw


@pytest.mark.parametrize("name", list(RESUME_CASES))
def test_resume_with_error_feedback_equals_uninterrupted(group, name: str) -> None:
    for r in (ranks[f"resume-{name}"] for ranks in group[0]):
        assert r["residual_norm"] > 0  # error feedback really carried state across the checkpoint
        for k, v in r["straight"].items():
            assert torch.equal(v, r["resumed"][k]), k
        assert any(not torch.equal(v, r["blind"][k]) for k, v in r["straight"].items())


# -- auto ----------------------------------------------------------------------------------------------
def _auto(rank: int, world: int, root: str) -> dict:
    from plait.comm.auto import AutoCompress
    from plait.comm.collectives import Comm

    # Decision from forced measurements: only rank 1 waits, and both ranks must still agree.
    forced = AutoCompress(first=1, last=1)
    comm = Comm()
    comm.compression = {"name": "powersgd"}
    assert forced.observe(1, 0.5 if rank == 1 else 0.0, 1.0, 1000, 0.5)
    forced_decision = forced.decide(comm, None)
    # Through the trainer: whatever the loaded machine measures, the record must be complete.
    t = _trainer(root, "auto", ["--comm.compress=auto", "--train.steps=8"])
    summary = t.fit()
    bytes_ = []
    if rank == 0:
        lines = (Path(root) / "auto/metrics.jsonl").read_text().splitlines()
        bytes_ = [r["comm_bytes"] for r in map(json.loads, lines) if "comm_bytes" in r]
    t.comm.close()
    return {"forced": forced_decision, "forced_active": comm.compress_active, "summary": summary,
            "active": t.comm.compress_active, "bytes": bytes_}


def test_auto_compression_decides_once_and_records_why(group) -> None:
    r0, r1 = (ranks["auto"] for ranks in group[0])
    assert r0["forced"] == r1["forced"] and r0["forced"]["decision"] == "on"
    assert r0["forced"]["exposed_fraction"] == pytest.approx(0.25)  # (0.5 + 0) / (1 + 1)
    assert r0["forced_active"] and r1["forced_active"]
    auto0, auto1 = r0["summary"]["comm_auto"], r1["summary"]["comm_auto"]
    assert auto0 == auto1 and auto0["decision"] in ("on", "off") and auto0["steps"] == [2, 6]
    expected = "communication is exposed" if auto0["decision"] == "on" else "communication is hidden"
    assert auto0["reason"].startswith(expected) and "threshold 10%" in auto0["reason"]
    assert r0["active"] == r1["active"] == (auto0["decision"] == "on")
    summary_file = (group[1] / "auto/auto/summary.json").read_text()
    assert '"comm_auto"' in summary_file
    if auto0["decision"] == "on":  # steps 7-8 send PowerSGD factors instead of fp32 buckets
        assert r0["bytes"][-2] < r0["bytes"][4] / 4
    else:
        assert r0["bytes"][-2] == r0["bytes"][4]


# -- hang guard ---------------------------------------------------------------------------------------
HANG_TIMEOUT_S = 3.0


class _Skipped(Exception):
    pass


class _Ended(Exception):
    pass


def _hang(rank: int, world: int, root: str, extra: list[str]) -> dict:
    from plait.comm.guard import CollectiveTimeout

    t = _trainer(root, "hang", extra + [f"--comm.timeout_s={HANG_TIMEOUT_S}", "--train.steps=4"])
    t.train_step()
    if rank == 1:  # this rank skips its gradient collectives in step 2 and stays stuck (the step's others run)
        all_reduce_async, run_async = t.comm.all_reduce_async, t.comm.run_async

        def stuck() -> None:
            time.sleep(HANG_TIMEOUT_S + 6)
            raise _Skipped

        def skip_all_reduce(tensor, group, name="all_reduce"):
            return stuck() if name.startswith("gradient") else all_reduce_async(tensor, group, name)

        def skip_run(name, group, fn):
            return stuck() if name.startswith("gradient") else run_async(name, group, fn)

        def ended(signum, frame):  # rank 0, having named this rank, ends it (hang escalation)
            raise _Ended

        signal.signal(signal.SIGTERM, ended)
        t.comm.all_reduce_async, t.comm.run_async = skip_all_reduce, skip_run
    start = time.monotonic()
    try:
        t.train_step()
    except CollectiveTimeout as e:
        return {"error": str(e), "elapsed": time.monotonic() - start}
    except _Skipped:
        return {"skipped": True}
    except _Ended:
        return {"ended_by_peer": True, "elapsed": time.monotonic() - start}
    return {"error": None}


def test_skipped_compressed_collective_on_comm_thread_names_the_missing_rank(tmp_path) -> None:
    """The comm-thread path (plait's ring carrying int8 payloads): the waiter's guard still fires."""
    r0, r1 = run_ranks(_hang, 2, str(tmp_path), ["--comm.allreduce=ring", "--comm.compress=int8"], timeout=60)
    # Rank 0 names rank 1 and ends it (SIGTERM to the pid it published) before it would give up by itself.
    assert r1.get("ended_by_peer"), r1
    assert r1["elapsed"] < HANG_TIMEOUT_S + 6
    msg = r0["error"]
    assert msg is not None, "rank 0 finished a step its peer never communicated in"
    assert "collective 'gradient bucket" in msg and "at step 2" in msg, msg
    assert "ranks [1] did not arrive" in msg, msg
    assert r0["elapsed"] <= HANG_TIMEOUT_S + 5


# Loaded into every Python process of the CLI run below (via PYTHONPATH): makes rank 1 stall before
# issuing its step-2 gradient all-reduces, as a rank stuck in a divergent code path would.
_SKIP_HOOK = """
import os
import time

from plait.comm import collectives

_orig = collectives.Comm.all_reduce_async


def _skipping(self, tensor, group, name="all_reduce"):
    if os.environ.get("RANK") == "1" and self.step == 2 and name.startswith("gradient"):
        time.sleep(120)
    return _orig(self, tensor, group, name)


collectives.Comm.all_reduce_async = _skipping
"""


def test_cli_run_with_a_stalled_rank_exits_with_one_named_error(tmp_path) -> None:
    import os
    import subprocess
    import sys

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_SKIP_HOOK)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])}
    args = [a for a in SMALL if not a.startswith("--parallel.bucket_mb")]
    start = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "plait.cli", "train", *args, "--train.steps=4",
                        f"--comm.timeout_s={HANG_TIMEOUT_S}", "--fault.max_restarts=0", f"--run.dir={tmp_path}/run"],
                       env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 1, p.stderr[-2000:]
    line = [x for x in p.stderr.splitlines() if x.startswith("plait: error:")]
    assert len(line) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "rank 0 failed: CollectiveTimeout: collective 'gradient bucket 0'" in line[0], line[0]
    assert "at step 2" in line[0] and "ranks [1] did not arrive" in line[0], line[0]
    assert time.monotonic() - start < 200  # not the 120 s stall plus a hang


@pytest.mark.parametrize(("args", "message"), [
    (["--comm.timeout_s=0"], "comm.timeout_s must be positive"),
    (["--comm.compress=topk", "--comm.compress_ratio=0"], "comm.compress_ratio is the kept fraction"),
    (["--comm.compress=powersgd", "--comm.powersgd_rank=0"], "comm.powersgd_rank must be at least 1"),
    (["--comm.compress=powersgd", "--comm.stochastic_rounding=true"], "applies to comm.compress=int8 or int4"),
    (["--parallel.impl=torch", "--comm.compress=int8"], "set parallel.impl=plait"),
    (["--parallel.impl=torch", "--comm.allreduce=ring"], "set parallel.impl=plait"),
    (["--parallel.zero=3", "--comm.compress=powersgd"], "use parallel.zero=0, 1 or 2"),
    (["--observe.count_torch_collectives=always"], "choose first_step, every_step or off"),
])
def test_comm_config_errors_say_what_to_do(args: list[str], message: str) -> None:
    from plait.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        validate(load_config(overrides=SMALL + args), 2)
