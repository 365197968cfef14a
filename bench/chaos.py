"""Goodput under failures: plait's restarts against the existing practice, one seeded fault schedule.

Both train the default GPT on the embedded corpus on 2 local workers for the same wall time
(``--minutes``, default 10), checkpointing every 20 steps, with a collective timeout of 10 s, under
the same seeded schedule of faults (exponential gaps, mean ``--mean-gap`` s, default 30):
``kill`` (SIGKILL a worker), ``stop`` (SIGSTOP a worker: a hang) and ``corrupt`` (truncate the newest
checkpoint's largest file, then SIGKILL a worker), at the same offsets from each run's start.

* plait: ``plait train`` with ``fault.max_restarts`` high (its restarts, hang escalation, checkpoint
  manifests and fallback to the previous good checkpoint);
* practice: a hand-written DDP loop (bench/_chaos_peer.py) under ``torchrun --max-restarts``, saving with
  ``torch.save`` at the same interval and resuming from the newest file, the same timeout.

Reported per system: goodput (seconds of steps in the final model's lineage / wall time, from the
ledger both write), steps reached, and per fault the recovery time (from the fault until the step
count passes its value at the fault). Also the blocking time of a checkpoint of the default model,
synchronous against ``checkpoint.async``. Targets: plait's goodput at least 1.3x the practice's; async
saving blocks at most 20% as long as sync. Prints JSON.

    python bench/chaos.py [--quick] [--minutes 10] [--mean-gap 30] [--seed 7]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import _common  # noqa: F401  (puts src/ on the path)

from plait.fault.goodput import goodput
from plait.fault.restart import read_progress, worker_pids

REPO = Path(__file__).resolve().parents[1]
COMMON = ["--train.steps=1000000", "--train.eval_every=0", "--train.log_every=50", "--observe.progress=false",
          "--observe.trackers=[]", "--checkpoint.every=20", "--checkpoint.keep=3", "--comm.timeout_s=10",
          "--parallel.nproc=2"]
KINDS = (("kill", 0.5), ("stop", 0.3), ("corrupt", 0.2))


def schedule(seed: int, duration: float, mean_gap: float) -> list[tuple[float, str, int]]:
    rng = random.Random(seed)
    out, t = [], 20.0
    while True:
        t += rng.expovariate(1.0 / mean_gap)
        if t > duration - 20:
            return out
        kind = rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]
        out.append((round(t, 2), kind, rng.randrange(2)))


def _steps(run: Path) -> int:
    """Steps the run has finished (its progress file; 0 before the first)."""
    return int(read_progress(run).get("steps") or 0)


def _pid(run: Path, rank: int) -> int | None:
    """The process id worker ``rank`` recorded, None before it has."""
    return worker_pids(run).get(rank, (None, ""))[0]


def _truncate_newest(run: Path) -> str:
    files = sorted(run.glob("checkpoints/step_*/*.distcp")) or list(run.glob("peer.pt"))
    if not files:
        return "no checkpoint yet"
    newest = max(files, key=lambda f: f.stat().st_mtime)
    if newest.suffix == ".distcp":
        newest = max(newest.parent.glob("*.distcp"), key=lambda f: f.stat().st_size)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    return str(newest.relative_to(run))


def run_system(name: str, cmd: list[str], run: Path, faults: list, duration: float) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    log = open(run.parent / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, cwd=run.parent, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    start = time.time()
    samples: list[tuple[float, int]] = []
    applied = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.time() - start, _steps(run)))
            time.sleep(0.2)

    threading.Thread(target=sample, daemon=True).start()
    for at, kind, rank in faults:
        while time.time() - start < at and proc.poll() is None:
            time.sleep(0.05)
        pid = _pid(run, rank)
        note = ""
        if pid is not None:
            if kind == "corrupt":
                note = _truncate_newest(run)
            try:
                os.kill(pid, signal.SIGSTOP if kind == "stop" else signal.SIGKILL)
            except ProcessLookupError:
                note += " (worker already gone)"
        applied.append({"at_s": round(time.time() - start, 2), "kind": kind, "rank": rank, "steps": _steps(run),
                        "note": note.strip()})
    while time.time() - start < duration and proc.poll() is None:
        time.sleep(0.1)
    end = time.time()
    stop.set()
    os.killpg(proc.pid, signal.SIGKILL)  # the window is over: end the launcher and every worker it started
    proc.wait()
    log.close()
    for f in applied:  # recovery: until the step count passes its value at the fault
        after = [t for t, s in samples if t > f["at_s"] and s > f["steps"]]
        f["recovery_s"] = round(after[0] - f["at_s"], 2) if after else None
    g = goodput(run, end_time=end)
    return {"goodput": g.get("goodput"), "steps": _steps(run), "wall_s": round(end - start, 1), "ledger": g,
            "faults": applied, "alive_at_end": proc.returncode is None}


def blocking_saves(root: Path) -> dict:
    """Blocking seconds of a default-model checkpoint, sync against async (median of 6 saves each)."""
    import statistics

    out = {}
    for mode in ("sync", "async"):
        run = root / f"save-{mode}"
        cmd = [sys.executable, "-m", "plait.cli", "train", "--train.steps=61", "--checkpoint.every=10",
               "--train.eval_every=0", "--observe.progress=false", "--observe.trackers=[]",
               f"--checkpoint.async={'true' if mode == 'async' else 'false'}", f"--run.dir={run}"]
        subprocess.run(cmd, cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, check=True)
        events = [json.loads(x) for x in (run / "goodput.jsonl").read_text().splitlines()]
        # A save's blocking time, plus for an asynchronous one the wait at the step that completed it.
        saves: list[float] = []
        for e in events:
            if e["event"] == "save":
                saves.append(float(e["blocking_s"]))
            elif e["event"] == "save_done" and saves:
                saves[-1] += float(e["blocking_s"])
        saves = saves[:6]
        out[mode] = {"median_blocking_s": statistics.median(saves), "saves": saves}
    out["async_over_sync"] = out["async"]["median_blocking_s"] / out["sync"]["median_blocking_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1.5 minutes per system, a fault every ~15 s")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--mean-gap", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    duration = 90.0 if args.quick else args.minutes * 60
    gap = 15.0 if args.quick else args.mean_gap
    faults = schedule(args.seed, duration, gap)
    root = Path(tempfile.mkdtemp(prefix="plait-chaos-"))
    systems = {
        "plait": [sys.executable, "-m", "plait.cli", "train", *COMMON, "--fault.max_restarts=1000",
                  f"--run.dir={root / 'plait'}"],
        "torchrun_practice": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                              "--max-restarts=1000", str(REPO / "bench" / "_chaos_peer.py"), *COMMON,
                              f"--run.dir={root / 'practice'}"],
    }
    results = {name: run_system(name, cmd, root / ("plait" if name == "plait" else "practice"), faults, duration)
               for name, cmd in systems.items()}
    saves = blocking_saves(root)
    ratio = (results["plait"]["goodput"] or 0) / max(results["torchrun_practice"]["goodput"] or 1e-9, 1e-9)
    print(json.dumps({
        "bench": "chaos", "machine": _common.machine_info(), "seed": args.seed, "duration_s": duration,
        "mean_gap_s": gap, "schedule": faults, "results": results, "goodput_ratio_plait_over_practice": ratio,
        "target_goodput_1.3x": ratio >= 1.3, "saves": saves,
        "target_async_within_20pct": saves["async_over_sync"] <= 0.2, "work_dir": str(root)}, indent=1))


if __name__ == "__main__":
    main()
