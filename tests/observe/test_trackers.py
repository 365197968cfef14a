"""Experiment trackers (``observe.trackers``) end to end, read back with each library's own reader.

One run of ``plait train`` on 2 gloo ranks with TensorBoard, W&B (``WANDB_MODE=offline``, as a user without an
account runs it) and MLflow as a user meets it after ``pip install 'plait[mlflow]'`` (no tracking URI, no
``MLFLOW_*`` variable: MLflow's own default store in the working directory, read back from there by a client given
no URI either) fails at step 4 on its first attempt (a model factory that raises once), restarts by itself,
resumes from the checkpoint of step 2 (as ``plait train --resume`` does), redoes step 3 and finishes at step 5.
Checked against ``metrics.jsonl``:

* MLflow, through ``MlflowClient``: one run in the experiment (rank 0 alone logs; the resumed attempt appends
  to it) holding every metric of every record, each step once, with the value of ``metrics.jsonl``, except that
  the redone step 3 keeps the values first logged (MLflow histories are append-only): its loss, learning rate
  and gradient norm are the same (deterministic training); its timings are those of the first attempt. Params
  hold the resolved config.
* W&B, through wandb's own reader of offline runs, ``wandb leet inspect --json`` (wandb-core reading each run
  directory's ``run-<id>.wandb`` transaction log; its ``history`` records): one run id over the two offline
  run directories (one per attempt), the same history as MLflow.
* TensorBoard, through its ``EventAccumulator``: the redone step replaced (``purge_step``), so every scalar
  equals ``metrics.jsonl``.

Bad input: a tracker whose library is missing ends ``plait train`` with one line naming the extra, exit 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers import TINY_CLI

FLAKY = """
    import os

    from plait.config import ModelConfig
    from plait.models.gpt import GPT


    class Flaky(GPT):
        '''plait's GPT that raises in one training forward pass of rank 0's first attempt (a testing aid).'''

        def __init__(self, cfg, fail_call):
            super().__init__(cfg)
            self.fail_call, self.count = fail_call, 0

        def forward(self, idx, targets=None):
            if self.training:
                self.count += 1
                first = os.environ.get("PLAIT_ATTEMPT") == "0" and os.environ.get("RANK") == "0"
                if first and self.count == self.fail_call:
                    raise RuntimeError("injected failure")
            return super().forward(idx, targets)


    def build(fail_step, accumulation=2):
        return Flaky(ModelConfig(n_layer=2, d_model=32, n_head=2, seq_len=32), (fail_step - 1) * accumulation + 1)
"""
ARGS = ["--model.factory=flaky:build", "--model.args.fail_step=4", "--data.name=text", "--model.seq_len=32",
        "--train.global_batch_size=8", "--train.micro_batch_size=2", "--train.eval_sequences=8",
        "--train.eval_every=0", "--train.log_every=1", "--optim.warmup_steps=2",
        "--observe.progress=false", "--parallel.nproc=2", "--train.deterministic=true", "--checkpoint.every=2",
        "--fault.max_restarts=1", "--fault.restart_backoff_s=0", "--observe.trackers=[tensorboard, wandb, mlflow]",
        "--observe.experiment=plait-test"]
REDONE = 3  # logged by the failed attempt, then again after the restart from step 2
DETERMINISTIC = ("loss", "global_loss", "lr", "grad_norm")


def _env(tmp: Path) -> dict[str, str]:
    """This environment without ``MLFLOW_*`` (no tracking URI, no opt-in to a store a fresh install lacks)."""
    user = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    return {**user, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
            "PYTHONPATH": os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")])}


def _plait(tmp: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "plait.cli", "train", *args], cwd=tmp, env=env or _env(tmp),
                          capture_output=True, text=True, timeout=300)


def _expected(run: Path) -> dict[str, dict[int, float]]:
    """metrics.jsonl as {metric: {step: value}}: numbers by key, lists entry by entry as key/index."""
    out: dict[str, dict[int, float]] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        for k, v in rec.items():
            items = [(f"{k}/{i}", x) for i, x in enumerate(v)] if isinstance(v, list) else [(k, v)]
            for name, x in items:
                if k != "step" and isinstance(x, int | float):
                    assert rec["step"] not in out.setdefault(name, {}), (name, rec["step"])
                    out[name][rec["step"]] = float(x)
    return out


def _mlflow() -> tuple[str, dict[str, list[tuple[int, float]]], dict[str, str]]:
    """The run in MLflow's default store, as ``MlflowClient()`` finds it from the working directory."""
    from mlflow import MlflowClient

    client = MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name("plait-test").experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]  # rank 0 alone; the restart and resume reuse it
    run = runs[0]
    history = {k: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, k))
               for k in run.data.metrics}
    return run.info.run_id, history, run.data.params


def _wandb(run: Path) -> tuple[set[str], dict[str, list[tuple[int, float]]]]:
    ids, history = set(), {}
    dirs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(dirs) == 2, dirs  # the failed attempt and the resumed one
    for d in dirs:
        out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(d)],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        for rec in map(json.loads, out.splitlines()):
            if rec["type"] == "run":
                ids.add(rec["run"]["run_id"])
            if rec["type"] == "history":
                item = rec["history"]["item"]
                for k, v in item.items():
                    if not k.startswith("_"):
                        history.setdefault(k, []).append((int(item["_step"]), float(v)))
    return ids, {k: sorted(v) for k, v in history.items()}


def _tensorboard(run: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _check_append_only(history: dict[str, list[tuple[int, float]]], expected: dict[str, dict[int, float]],
                       tracker: str) -> None:
    assert set(history) == set(expected), (tracker, set(history) ^ set(expected))
    for name, points in history.items():
        steps = [s for s, _ in points]
        assert steps == sorted(expected[name]), (tracker, name, steps)  # every step once, none missing
        for step, value in points:
            if step != REDONE or name in DETERMINISTIC:
                assert value == expected[name][step], (tracker, name, step, value, expected[name][step])


def test_trackers_hold_metrics_jsonl_across_a_restart_and_a_resume(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    for name in [k for k in os.environ if k.startswith("MLFLOW_")]:  # read back as the run wrote: MLflow's default
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)  # where the run was started, so where MLflow's default store is
    (tmp_path / "flaky.py").write_text(textwrap.dedent(FLAKY))
    run = tmp_path / "run"
    p = _plait(tmp_path, *ARGS, "--train.steps=5", f"--run.dir={run}")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "injected failure" in p.stderr and "restart 1 of 1" in p.stderr and "resumed from" in p.stderr

    expected = _expected(run)
    assert sorted(expected["loss"]) == [1, 2, 3, 4, 5] and sorted(expected["val_loss"]) == [5]
    mlflow_id, mlflow_history, params = _mlflow()
    assert mlflow_id == json.loads((run / "trackers.json").read_text())["mlflow"]["run_id"]
    _check_append_only(mlflow_history, expected, "mlflow")
    assert params["train.deterministic"] == "True" and params["parallel.nproc"] == "2"
    assert params["observe.trackers"] == '["tensorboard", "wandb", "mlflow"]'

    wandb_ids, wandb_history = _wandb(run)
    assert wandb_ids == {json.loads((run / "trackers.json").read_text())["wandb"]["run_id"]}
    _check_append_only(wandb_history, expected, "wandb")

    scalars = _tensorboard(run)
    names = {f"val/{k[4:]}" if k.startswith("val_") else f"train/{k}": k for k in expected}
    assert set(scalars) == set(names), set(scalars) ^ set(names)
    for tag, points in scalars.items():
        want = expected[names[tag]]
        assert [s for s, _ in points] == sorted(want), (tag, points)
        assert all(np.float32(want[s]) == np.float32(v) for s, v in points), tag  # TensorBoard keeps float32


def test_missing_tracker_library_is_one_line(tmp_path: Path) -> None:
    """wandb hidden from the interpreter (sys.modules entry None): the CLI names the extra before any worker."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None\n")
    p = _plait(tmp_path, "--observe.trackers=[wandb]", "--parallel.nproc=1", f"--run.dir={tmp_path}/r")
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip() == ("plait: error: observe.trackers includes wandb, but the wandb package is not "
                                "installed: pip install 'plait[wandb]' (or leave wandb out of observe.trackers)")


def test_mlflow_client_alone_names_the_extra(tmp_path: Path, monkeypatch) -> None:
    """mlflow-skinny without sqlalchemy (hidden from the interpreter), as the extra once installed it: MLflow's
    default store cannot be opened, and the one line says where and what to install."""
    mlflow = pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    for name in [k for k in os.environ if k.startswith("MLFLOW_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    default = mlflow.get_tracking_uri()
    if not default.startswith("sqlite:"):
        pytest.skip(f"MLflow {mlflow.__version__}'s default store is {default}, which needs no sqlalchemy")
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['sqlalchemy'] = None\n")
    p = _plait(tmp_path, *TINY_CLI, "--parallel.nproc=1", "--train.steps=1", "--observe.trackers=[mlflow]",
               f"--run.dir={tmp_path}/r")
    assert p.returncode == 2, p.stderr[-2000:]
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith(f"plait: error: observe.trackers: MLflow at {default} could not start a run"), line
    assert line.endswith("(MLflow's sqlite: store needs sqlalchemy and alembic: pip install 'plait[mlflow]')"), line


def test_replaced_tensorboard_key_names_trackers(tmp_path: Path) -> None:
    p = _plait(tmp_path, "--observe.tensorboard=false", f"--run.dir={tmp_path}/r")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "config key 'observe.tensorboard' was replaced by observe.trackers" in p.stderr
