"""Restarting a failed worker group: when to, how often, and when to stop trying.

Workers note how far they got (rank 0 writes ``progress.json`` in the run's state directory at log steps,
saves, loads, errors, the first step after a load and at least every 30 s: steps done, newest checkpoint step,
where the attempt started; ``plait.engine.stepper``) and their pids (``workers/rank<r>.pid``,
for the hang watchdog and for tests). After an attempt fails, ``decide`` reads the error reports and
the progress:

* no restart for an error a restart cannot fix: a configuration, data or checkpoint error (every
  ``ConfigError``), or a failure before the first attempt completed one step;
* no restart when the budget ``fault.max_restarts`` is spent (one budget for the whole job: the
  launcher counts attempts, not each worker);
* a stop with ``NO_PROGRESS_EXIT`` when an attempt after a restart failed without moving the newest
  checkpoint or the step count past where the previous attempt got: a failure that recurs at the
  same place would loop forever;
* otherwise a restart after ``restart_backoff_s`` (doubling over failures in quick succession, at most
  60 s; an attempt that ran for a minute resets it), resuming from the newest good checkpoint.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

PROGRESS = "progress.json"


def write_progress(state_dir: Path, *, steps: int, saved: int | None, start: int = 0) -> None:
    """Atomically record how far this attempt got (rank 0): the step reached, the last step saved, and the
    step it resumed from."""
    state_dir = Path(state_dir)
    tmp = state_dir / (PROGRESS + f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"steps": steps, "saved": saved, "start": start}))
        os.replace(tmp, state_dir / PROGRESS)
    except OSError:  # the run's directory is gone or full: progress is advisory
        pass


def read_progress(state_dir: Path) -> dict[str, int | None]:
    try:
        return json.loads((Path(state_dir) / PROGRESS).read_text())
    except (OSError, ValueError):
        return {"steps": 0, "saved": None}


def clear_progress(state_dir: Path) -> None:
    (Path(state_dir) / PROGRESS).unlink(missing_ok=True)


def write_pid(state_dir: Path, rank: int) -> None:
    """``workers/rank<r>.pid`` holds "pid host" of this worker."""
    d = Path(state_dir) / "workers"
    try:
        d.mkdir(parents=True, exist_ok=True)
        (d / f"rank{rank}.pid").write_text(f"{os.getpid()} {socket.gethostname()}")
    except OSError:
        pass


def worker_pids(state_dir: Path) -> dict[int, tuple[int, str]]:
    """rank -> (pid, host) of the workers that wrote a pid file."""
    out = {}
    for f in (Path(state_dir) / "workers").glob("rank*.pid"):
        try:
            pid, host = f.read_text().split()
            out[int(f.stem[4:])] = (int(pid), host)
        except (OSError, ValueError):
            continue
    return out


# Errors whose cause a restart does not remove: the configuration, the data, a damaged checkpoint.
UNFIXABLE = ("ConfigError", "DataError", "CheckpointError", "LossError", "TensorParallelError",
             "PipelineConfigError", "OptimizerError", "PlaitError", "ZeroConfigError", "LayoutError",
             "TrainingDiverged")


@dataclass
class Decision:
    restart: bool
    reason: str
    no_progress: bool = False
    wait_s: float = 0.0


def decide(first_line: str, attempt: int, max_restarts: int, progress: dict, previous: dict | None,
           backoff_s: float, streak: int = 0) -> Decision:
    """Whether to restart after attempt ``attempt`` (0-based) failed with ``first_line``."""
    kind = first_line.split(":", 1)[0].strip()
    if kind in UNFIXABLE:
        return Decision(False, f"{kind} is not something a restart can fix")
    steps, saved = int(progress.get("steps") or 0), progress.get("saved")
    if attempt == 0 and steps == 0:
        return Decision(False, "it failed before completing one step")
    # No progress: this attempt started where the previous one did, saved nothing new and failed no later.
    # An attempt that had to start earlier (its newer checkpoint was damaged) is not compared with the one
    # before: it is recomputing lost steps, and a new fault there is not a lack of progress.
    if (previous is not None and steps <= int(previous.get("steps") or 0) and saved == previous.get("saved")
            and progress.get("start", 0) == previous.get("start", 0)):
        return Decision(False, f"the attempt after restart {attempt} failed again at step {steps} without new "
                        "progress", no_progress=True)
    if attempt >= max_restarts:
        return Decision(False, f"the {max_restarts} restarts allowed (fault.max_restarts) are spent")
    return Decision(True, "restarting", wait_s=min(60.0, backoff_s * 2 ** max(0, streak - 1)))
