"""Goodput under failures: per-step replica groups on torchft (``fault.mode=replicas``) against restart-based recovery
(``fault.mode=restart``, today's default), under one seeded schedule of SIGKILLs.

Both train bench/chaos.py's setup (the default GPT on the embedded corpus, 2 workers, a checkpoint every 20 steps,
a collective timeout of 10 s) for the same wall time (``--minutes``, default 10), with the same kills at the same
offsets from each run's start (exponential gaps, mean ``--mean-gap`` s, default 120: one failure per 2 minutes):

* restart: ``plait train --parallel.nproc=2``: a killed worker makes the whole group restart from the newest
  checkpoint (the steps since it are trained again);
* replicas: ``plait train --parallel.nproc=2 --fault.mode=replicas``: 2 torchft replica groups of 1 worker; the
  survivor keeps training with its own gradients while the killed group's agent starts a replacement, which heals
  from it.

Reported per system: ``goodput_steps_per_s`` (the step count the run ends at, i.e. the steps in the final model's
lineage, over the whole window, also where the run gave up before its end: ``ended_at_s``, ``alive_at_end``; for
replicas the most advanced group's), and per kill the recovery time (from the
kill until the step count passes its value at the kill). While a replica group is away the survivor's steps use
its half of each global batch: ``half_batch_steps`` counts them (from ``replicas_live`` at the log steps, every 10th
step) so the comparison can be read in samples as well. Verdict: replicas' goodput at least 1.5x restart's. JSON.

    python bench/replicas.py [--quick] [--minutes 10] [--mean-gap 120] [--seed 7]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import _common  # noqa: F401  (puts src/ on the path)
from chaos import COMMON, schedule

from plait.fault.restart import read_progress, worker_pids

SETTINGS = [a for a in COMMON if not a.startswith("--train.log_every")] + ["--train.log_every=10",
                                                                           "--fault.max_restarts=1000"]


def _steps(run: Path, replicas: bool) -> int:
    dirs = sorted(run.glob("replica*")) if replicas else [run]
    return max([int(read_progress(d).get("steps") or 0) for d in dirs] or [0])


def _victim(run: Path, replicas: bool, rank: int) -> int | None:
    """The pid of worker ``rank`` (restart), or of replica group ``rank``'s worker (replicas)."""
    if replicas:
        return worker_pids(run / f"replica{rank}").get(0, (None, ""))[0]
    return worker_pids(run).get(rank, (None, ""))[0]


def _half_batch_steps(run: Path) -> int:
    """Steps the most advanced group took without the other (x10: one log step stands for ten)."""
    best = 0
    for d in run.glob("replica*"):
        lines = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] if (
            d / "metrics.jsonl").is_file() else []
        best = max(best, 10 * sum(1 for r in lines if r.get("replicas_live") == 1))
    return best


def run_system(name: str, replicas: bool, run: Path, faults: list, duration: float) -> dict:
    cmd = [sys.executable, "-m", "plait.cli", "train", *SETTINGS, f"--run.dir={run}"]
    if replicas:
        cmd.append("--fault.mode=replicas")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    log = open(run.parent / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, cwd=run.parent, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    start, samples, applied, stop = time.time(), [], [], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.time() - start, _steps(run, replicas)))
            time.sleep(0.2)

    threading.Thread(target=sample, daemon=True).start()
    for at, _, rank in faults:
        while time.time() - start < at and proc.poll() is None:
            time.sleep(0.05)
        pid, note = _victim(run, replicas, rank), ""
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                note = "worker already gone"
        applied.append({"at_s": round(time.time() - start, 2), "rank": rank, "steps": _steps(run, replicas),
                        "note": note})
    while time.time() - start < duration and proc.poll() is None:
        time.sleep(0.1)
    end = time.time()
    stop.set()
    os.killpg(proc.pid, signal.SIGTERM)  # the launcher stops its agents (replicas: each in its own session)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log.close()
    for f in applied:
        after = [t for t, s in samples if t > f["at_s"] and s > f["steps"]]
        f["recovery_s"] = round(after[0] - f["at_s"], 2) if after else None
    steps = _steps(run, replicas)
    # over the whole window: a run that gave up (its restarts stopped) earns nothing for the rest of it
    out = {"steps": steps, "wall_s": round(duration, 1), "ended_at_s": round(end - start, 1),
           "goodput_steps_per_s": steps / duration, "faults": applied, "alive_at_end": proc.returncode is None}
    if replicas:
        out["half_batch_steps"] = _half_batch_steps(run)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 minutes per system, a kill every ~40 s")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--mean-gap", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    duration = 120.0 if args.quick else args.minutes * 60
    gap = 40.0 if args.quick else args.mean_gap
    faults = schedule(args.seed, duration, gap)
    root = Path(tempfile.mkdtemp(prefix="plait-replicas-"))
    results = {name: run_system(name, name == "replicas", root / name, faults, duration)
               for name in ("restart", "replicas")}
    ratio = results["replicas"]["goodput_steps_per_s"] / max(results["restart"]["goodput_steps_per_s"], 1e-9)
    report = {"bench": "replicas", "machine": _common.machine_info(), "seed": args.seed, "duration_s": duration,
              "mean_gap_s": gap, "schedule": faults, "results": results,
              "goodput_ratio_replicas_over_restart": ratio, "target_1.5x": ratio >= 1.5, "work_dir": str(root),
              "load_avg_1m": os.getloadavg()[0]}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
