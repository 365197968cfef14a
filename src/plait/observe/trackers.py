"""Experiment trackers: every ``metrics.jsonl`` record and the resolved config, from rank 0, to TensorBoard,
Weights & Biases and MLflow through each library's own client (``observe.trackers``).

One small interface (``Tracker``: ``log(metrics, step)``, ``close()``) with one implementation per library,
made by ``open_trackers`` from the names in the config. A record is flattened into scalar metrics first: a
number keeps its key, a list or table becomes one metric per entry (``rank_step_s/0``, ``moe/0/aux_loss``).

Resuming continues the same tracker runs: their ids live in ``RUN_DIR/trackers.json``. A resumed run redoes
the steps after its checkpoint, and the trainer cuts ``metrics.jsonl`` back to that checkpoint
(``rewind_trackers``). TensorBoard then drops its own events after that step (a new event file written with
``purge_step``), so it shows the new timeline as ``metrics.jsonl`` does. W&B and MLflow histories are
append-only: a step a run already holds is not sent again (``trackers.json`` keeps, per tracker and metric,
the last step delivered), so no step appears twice. After a deterministic resume the redone steps equal the
first ones; after a loss-spike rollback those trackers keep the first values of the redone steps (the
spike stays visible) and continue with the new timeline after them. A rewind to step 0 (a restart with no
checkpoint) starts new tracker runs.

The libraries are imported only when their tracker is asked for; ``check_trackers`` names the missing extra.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from plait.config import ConfigError
from plait.observe.log import get_logger

STATE_FILE = "trackers.json"
# tracker -> (module it needs, pip extra that installs it)
EXTRAS = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
_MLFLOW_KEY = re.compile(r"[^\w\-. /]")


def check_trackers(names: list[str]) -> None:
    """Raise a ``ConfigError`` naming the extra to install when a tracker's library is missing (imports nothing)."""
    for name in names:
        if name in EXTRAS:
            module, extra = EXTRAS[name]
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                raise ConfigError(f"observe.trackers includes {name}, but the {module} package is not installed: "
                                  f"pip install 'plait[{extra}]' (or leave {name} out of observe.trackers)")


def _import(name: str) -> Any:
    module, extra = EXTRAS[name]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"observe.trackers includes {name}, but {module} cannot be imported ({e}): "
                          f"pip install 'plait[{extra}]'") from None


def flatten(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The scalar metrics of one record (``step`` left out): numbers as they are, booleans as 0/1, lists and
    tables entry by entry under ``key/index`` or ``key/name``; text and None are not metrics."""
    out: dict[str, float] = {}
    for k, v in record.items():
        key = f"{prefix}{k}"
        if key == "step":
            continue
        if isinstance(v, bool | int | float):
            out[key] = float(v)
        elif isinstance(v, dict):
            out.update(flatten(v, key + "/"))
        elif isinstance(v, list | tuple):
            out.update(flatten({str(i): x for i, x in enumerate(v)}, key + "/"))
    return out


def config_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The resolved config as ``section.key -> text`` (tables as ``section.key.name``), for MLflow params."""
    out: dict[str, str] = {}
    for k, v in config.items():
        if isinstance(v, dict) and v:
            out.update(config_params(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, list | dict) else str(v)
    return out


# What a tracker holds for good after a call: (step, metric names) pairs.
Committed = list[tuple[int, list[str]]]


class Tracker(Protocol):
    """One experiment tracker. ``append_only``: its history cannot be cut back (W&B, MLflow), so a step it
    holds is never sent again; otherwise it drops its own later steps when reopened after a rewind. ``log``
    returns what the tracker now holds for good (an append-only one's ledger); ``close`` sends what it kept."""

    name: str
    append_only: bool
    run_id: str

    def log(self, metrics: dict[str, float], step: int) -> Committed: ...

    def close(self) -> Committed: ...


class TensorBoardTracker:
    """Scalars in ``RUN_DIR/tensorboard`` (``train/<key>``; ``val_<x>`` as ``val/<x>``). ``purge_step``:
    TensorBoard discards the events of earlier files at that step and after (a rewound timeline).

    The event file is flushed at most every ``FLUSH_EVERY_S`` seconds (a clock read per logged record, not a write
    per step), at ``flush`` (the engine calls it when an error ends the run) and at ``close``: a killed process
    loses at most that interval of TensorBoard points, which ``metrics.jsonl`` still holds."""

    name, append_only, run_id = "tensorboard", False, ""
    FLUSH_EVERY_S = 10.0

    def __init__(self, run_dir: Path, purge_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge_step,
                                     flush_secs=int(self.FLUSH_EVERY_S))
        self._flushed = time.monotonic()

    def log(self, metrics: dict[str, float], step: int) -> Committed:
        for k, v in metrics.items():
            self._writer.add_scalar(f"val/{k[4:]}" if k.startswith("val_") else f"train/{k}", v, step)
        if time.monotonic() - self._flushed >= self.FLUSH_EVERY_S:
            self.flush()
        return []

    def flush(self) -> None:
        self._writer.flush()
        self._flushed = time.monotonic()

    def close(self) -> Committed:
        self._writer.close()
        return []


class WandbTracker:
    """A W&B run (``wandb.init`` with ``dir=RUN_DIR``, so offline runs are written to ``RUN_DIR/wandb``),
    resumed by id; the config is its run config. A step's row is committed when a later step arrives (or at
    ``close``): W&B takes a step once, and a record logged later at the same step (the final validation loss)
    joins its row. A process killed before that loses the row; not in the ledger, it is sent again on resume."""

    name, append_only = "wandb", True

    def __init__(self, run_dir: Path, config: dict[str, Any], run_id: str | None, project: str) -> None:
        wandb = _import("wandb")
        try:
            self._run = wandb.init(project=project or None, name=run_dir.resolve().name, id=run_id,
                                   resume="allow" if run_id else None, dir=str(run_dir),
                                   config=None if run_id else config)
        except Exception as e:  # a login, network or settings problem: the message says which
            what = f"resume run {run_id} (named in {run_dir / STATE_FILE})" if run_id else "start a run"
            raise ConfigError(f"observe.trackers: W&B could not {what}: {type(e).__name__}: {_first_line(e)} (log "
                              "in with `wandb login`, or set WANDB_MODE=offline)") from None
        self.run_id = self._run.id
        if run_id:  # resumed: the config of this attempt, which may differ (more steps, another world size)
            self._run.config.update(config, allow_val_change=True)
        self._row: dict[str, float] = {}
        self._row_step = -1

    def _commit(self) -> Committed:
        if not self._row:
            return []
        self._run.log(self._row, step=self._row_step, commit=True)
        done, self._row = [(self._row_step, list(self._row))], {}
        return done

    def log(self, metrics: dict[str, float], step: int) -> Committed:
        done = self._commit() if step != self._row_step else []
        self._row.update(metrics)
        self._row_step = step
        return done

    def close(self) -> Committed:
        done = self._commit()
        self._run.finish()
        return done


class MlflowTracker:
    """An MLflow run through ``MlflowClient`` at ``uri`` (empty: MLflow's own default), resumed by id; the
    config as params (MLflow params never change: a value a resumed run changed is set as tag ``config.<key>``)."""

    name, append_only = "mlflow", True

    def __init__(self, run_dir: Path, config: dict[str, Any], run_id: str | None, experiment: str, uri: str) -> None:
        mlflow = _import("mlflow")
        self._entities = mlflow.entities
        try:
            self._client = mlflow.MlflowClient(tracking_uri=uri or None)
            if run_id:
                run = self._client.get_run(run_id)
                self._client.update_run(run_id, status="RUNNING")
            else:
                run = self._client.create_run(self._experiment(experiment), run_name=run_dir.resolve().name,
                                              tags={"plait.run_dir": str(run_dir.resolve())})
            self.run_id = run.info.run_id
            self._log_config(config_params(config), run.data.params)
        except Exception as e:  # an unreachable server, a store MLflow refuses, a run id it does not hold
            where = uri or mlflow.get_tracking_uri()  # MLFLOW_TRACKING_URI, else MLflow's default, resolved
            what = f"resume run {run_id} (named in {run_dir / STATE_FILE})" if run_id else "start a run"
            # mlflow-skinny alone cannot open MLflow 3's default store (sqlite:///mlflow.db); the extra can
            hint = (" (MLflow's sqlite: store needs sqlalchemy and alembic: pip install 'plait[mlflow]')"
                    if where.startswith("sqlite:") and importlib.util.find_spec("sqlalchemy") is None else "")
            raise ConfigError(f"observe.trackers: MLflow at {where} could not {what}: {type(e).__name__}: "
                              f"{_first_line(e)}{hint}") from None

    def _experiment(self, name: str) -> str:
        name = name or os.environ.get("MLFLOW_EXPERIMENT_NAME", "")
        if not name:
            return os.environ.get("MLFLOW_EXPERIMENT_ID", "0")  # MLflow's Default experiment
        found = self._client.get_experiment_by_name(name)
        return found.experiment_id if found is not None else self._client.create_experiment(name)

    def _log_config(self, params: dict[str, str], existing: dict[str, str]) -> None:
        e = self._entities
        new = [e.Param(k, v[:6000]) for k, v in params.items() if k not in existing]
        changed = [e.RunTag(f"config.{k}", v[:6000]) for k, v in params.items() if k in existing and existing[k] != v]
        for i in range(0, max(len(new), len(changed)), 100):  # MLflow takes at most 100 params per batch
            self._client.log_batch(self.run_id, params=new[i:i + 100], tags=changed[i:i + 100])

    def log(self, metrics: dict[str, float], step: int) -> Committed:
        now = int(time.time() * 1000)
        items = [self._entities.Metric(_MLFLOW_KEY.sub("_", k), v, now, step) for k, v in metrics.items()]
        for i in range(0, len(items), 1000):  # MLflow's batch limit
            self._client.log_batch(self.run_id, metrics=items[i:i + 1000])
        return [(step, list(metrics))]

    def close(self) -> Committed:
        self._client.set_terminated(self.run_id, "FINISHED")
        return []


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _last_step(run_dir: Path) -> int | None:
    """The highest step in ``metrics.jsonl`` (None when it holds none)."""
    path = run_dir / "metrics.jsonl"
    steps = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                steps.append(int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue
    return max(steps) if steps else None


class Trackers:
    """The configured trackers of one run on rank 0, with the ledger of what each append-only one holds.

    ``names``: from ``observe.trackers``; ``config``: the resolved config as a dict; ``experiment`` and
    ``mlflow_uri``: ``observe.experiment`` and ``observe.mlflow_uri``. A tracker that fails while logging is
    left out for the rest of the run with one warning (``metrics.jsonl`` stays complete)."""

    def __init__(self, run_dir: Path, names: list[str], config: dict[str, Any], experiment: str = "",
                 mlflow_uri: str = "") -> None:
        self.run_dir = run_dir
        self.state = _read_state(run_dir)
        self.trackers: list[Tracker] = []
        try:
            for name in names:
                self.trackers.append(self._open(name, config, experiment, mlflow_uri))
        except BaseException:
            self.close()
            raise
        for t in self.trackers:
            if t.append_only:
                self.state.setdefault(t.name, {"logged": {}})["run_id"] = t.run_id
        if any(t.append_only for t in self.trackers):
            _write_state(run_dir, self.state)

    def _open(self, name: str, config: dict[str, Any], experiment: str, mlflow_uri: str) -> Tracker:
        run_id = self.state.get(name, {}).get("run_id")
        if name == "tensorboard":
            last = _last_step(self.run_dir)
            return TensorBoardTracker(self.run_dir, last + 1 if last is not None else None)
        if name == "wandb":
            return WandbTracker(self.run_dir, config, run_id, experiment)
        if name == "mlflow":
            return MlflowTracker(self.run_dir, config, run_id, experiment, mlflow_uri)
        raise ConfigError(f"unknown tracker {name!r}; observe.trackers takes tensorboard, wandb, mlflow")

    def log(self, record: dict[str, Any]) -> None:
        """Send one ``metrics.jsonl`` record (it has ``step``) to every tracker."""
        step, metrics = int(record["step"]), flatten(record)
        for t in list(self.trackers):
            logged = self.state[t.name]["logged"] if t.append_only else {}
            fresh = {k: v for k, v in metrics.items() if step > logged.get(k, -1)}
            if fresh:
                self._call(t, functools.partial(t.log, fresh, step), f"at step {step}")

    def _call(self, t: Tracker, fn: Callable[[], Committed], when: str) -> None:
        """Run one tracker call; note what it committed in the ledger, or leave the tracker out if it failed."""
        try:
            done = fn()
        except Exception as e:
            get_logger().warning("tracker %s failed %s and is left out from now on: %s: %s", t.name, when,
                                 type(e).__name__, _first_line(e))
            self.trackers.remove(t)
            return
        if t.append_only and done:
            logged = self.state[t.name]["logged"]
            for step, names in done:
                logged.update({k: max(step, logged.get(k, -1)) for k in names})
            _write_state(self.run_dir, self.state)

    def flush(self) -> None:
        """Write what the trackers that buffer (TensorBoard) hold, now."""
        for t in self.trackers:
            if hasattr(t, "flush"):
                with contextlib.suppress(Exception):
                    t.flush()

    def close(self) -> None:
        for t in list(self.trackers):
            self._call(t, t.close, "closing")
        self.trackers = []


def rewind_trackers(run_dir: Path, step: int) -> None:
    """The run goes back to ``step`` (``metrics.jsonl`` is cut there): at step 0 the next trackers are new runs;
    otherwise the ledger stands (TensorBoard reads where to purge from ``metrics.jsonl`` when reopened)."""
    if step <= 0:
        (run_dir / STATE_FILE).unlink(missing_ok=True)


def _read_state(run_dir: Path) -> dict[str, Any]:
    path = run_dir / STATE_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        raise ConfigError(f"{path} is damaged (not JSON); delete it to start new tracker runs") from None


def _write_state(run_dir: Path, state: dict[str, Any]) -> None:
    """Atomically: a crash while writing leaves the previous ledger."""
    tmp = run_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, run_dir / STATE_FILE)
