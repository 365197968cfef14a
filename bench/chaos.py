"""Goodput under failures, one seeded fault schedule per comparison. Two comparisons (``--compare``):

``recovery`` (the default): how plait recovers from a killed worker, three ways, under the same SIGKILLs.
The default GPT (a step of ~0.3 s on 2 CPU workers) trains on the embedded corpus on 2 local workers, checkpointing
every ``--ckpt-every`` steps (default: plait's own default, ``checkpoint.every`` = 200, ~70 s of training, as a user
meets it; 30 with ``--quick``: the steps since the last save are part of a restart's cost, as they are for a user),
for ``--minutes`` of training per system (default 5), while one worker is SIGKILLed once per ``--mean-gap`` seconds
on average (default 120: one failure per 2 minutes; kill ``i`` at ``(i + 0.5 + u)`` gaps after the first step, ``u``
uniform in [-0.3, 0.3], the victim drawn too; all from
``--seed``):

* ``restart``: ``plait train --parallel.nproc=2``: every worker restarts and reloads the newest checkpoint from disk;
* ``restart_memory``: the same with ``fault.memory_checkpoint=true``: the reload comes from the in-memory copy;
* ``replicas``: ``fault.mode=replicas``: 2 torchft replica groups of 1 worker; the survivor trains on alone (on its
  half of each global batch) while the killed group's agent starts a replacement, which heals from it.

``--replacement-s D`` models a lost machine that takes D seconds to replace: every system runs with
``fault.restart_backoff_s=D``, so restart's launcher starts the group again D seconds after the failure (the job
waits for its missing worker), and replicas' killed group waits D seconds before it joins (the survivor trains on
meanwhile). Without it, a killed worker's replacement is a process started again at once (plait's 1 s backoff).

Reported per system: ``goodput_steps_per_s`` (the steps in the final model's lineage at the end of the window over
the window's length; for replicas the most advanced group's), ``goodput_samples_per_s`` (the same in samples: a step
a replica group took alone counts its half of the global batch, from ``replicas_live`` at the log steps), per kill
``to_next_useful_step_s`` (from the kill until the lineage passes its step count at the kill: the restart, the
reload and the lost steps trained again; for replicas the survivor's next committed step) and for replicas
``rejoin_s`` (until the killed group's replacement has stepped past the kill point: it healed), and for replicas
torchft's per-step cost (``quorum_s_per_step``, ``should_commit_s_per_step``, measured inside the workers) against
the step time. Verdict: ``target_replicas_1.5x_restart``, replicas' goodput in steps at least 1.5x restart's.

``practice``: plait's restarts against the existing practice (a hand-written DDP loop under ``torchrun
--max-restarts``, bench/_chaos_peer.py) under kills, hangs (SIGSTOP) and corrupted checkpoints, checkpointing every
20 steps with a collective timeout of 10 s for ``--minutes`` (default 10; faults every ``--mean-gap`` s on average,
exponential gaps, default 30), and the blocking time of a sync against an async checkpoint. Targets: plait's
goodput at least 1.3x the practice's; async saving blocks at most 20% as long as sync.

Prints JSON (``--out FILE`` also writes it).

    python bench/chaos.py [--quick] [--compare recovery|practice] [--minutes M] [--mean-gap S] [--seed 7]
        [--ckpt-every N] [--replacement-s D] [--systems restart,replicas] [--extra=--SECTION.KEY=V] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import _common  # noqa: F401  (puts src/ on the path)

from plait.config_sections import CheckpointConfig
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


# -- recovery: restart from disk, restart from memory, per-step replicas -------------------------------------------

RECOVERY = ["--train.steps=1000000", "--train.eval_every=0", "--train.log_every=10", "--observe.progress=false",
            "--observe.trackers=[]", "--checkpoint.keep=2", "--comm.timeout_s=10", "--parallel.nproc=2",
            "--fault.max_restarts=1000"]
DEFAULT_EVERY = CheckpointConfig().every  # what a user meets who sets nothing
SYSTEMS = {"restart": ["--fault.memory_checkpoint=false"], "restart_memory": ["--fault.memory_checkpoint=true"],
           "replicas": ["--fault.mode=replicas"]}


def kill_schedule(seed: int, duration: float, mean_gap: float) -> list[tuple[float, int]]:
    """(seconds after the first step, victim) for one kill per ``mean_gap`` seconds of a ``duration`` window."""
    rng = random.Random(seed)
    n = max(1, round(duration / mean_gap))
    return [(round((i + 0.5 + rng.uniform(-0.3, 0.3)) * mean_gap, 2), rng.randrange(2)) for i in range(n)]


def _replica_dirs(run: Path) -> list[Path]:
    return sorted(run.glob("replica*"))


def _lineage_steps(run: Path, replicas: bool) -> int:
    return max([_steps(d) for d in _replica_dirs(run)] or [0]) if replicas else _steps(run)


def _victim(run: Path, replicas: bool, rank: int) -> int | None:
    return _pid(run / f"replica{rank}", 0) if replicas else _pid(run, rank)


def _metrics(run: Path) -> list[dict]:
    f = run / "metrics.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines() if '"loss"' in x] if f.is_file() else []


def _ledger(run: Path, start: float) -> list[tuple[float, int]]:
    """(seconds since ``start``, step) of every step the run's goodput ledger recorded (redone steps included)."""
    f = run / "goodput.jsonl"
    rows = [json.loads(x) for x in f.read_text().splitlines() if '"step"' in x] if f.is_file() else []
    return [(r["t"] - start, int(r["step"])) for r in rows if r.get("event") == "step"]


def _resumes(run: Path, start: float) -> list[tuple[float, int, str]]:
    """(seconds since ``start``, step resumed from, where it was read) of every resume the run's ledger recorded."""
    f = run / "goodput.jsonl"
    rows = [json.loads(x) for x in f.read_text().splitlines()] if f.is_file() else []
    return [(r["t"] - start, int(r["step"]), r.get("source", "disk")) for r in rows if r.get("event") == "resume"]


def _lineage_at(ledgers: dict[str, list[tuple[float, int]]], t: float) -> int:
    """The step the run's lineage had reached at ``t``: each group's latest step by then (after a restart: the
    step it resumed from and went on to), the most advanced group's."""
    return max([max(((u, n) for u, n in v if u <= t), default=(0.0, 0))[1] for v in ledgers.values()] or [0])


def _stop(proc: subprocess.Popen) -> None:
    """End the launcher and everything it started (replica groups' agents: each in a session of its own, which the
    launcher stops on SIGTERM)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()


def run_recovery(name: str, run: Path, kills: list, duration: float, ckpt_every: int,
                 extra: list[str] | None = None) -> dict:
    replicas = name == "replicas"
    cmd = [sys.executable, "-m", "plait.cli", "train", *RECOVERY, *(extra or []), f"--checkpoint.every={ckpt_every}",
           *SYSTEMS[name],
           f"--run.dir={run}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    log = open(run.parent / f"{name}.log", "w")
    launched, load_before = time.time(), os.getloadavg()[0]
    proc = subprocess.Popen(cmd, cwd=run.parent, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    while _lineage_steps(run, replicas) < 1 and proc.poll() is None and time.time() - launched < 300:
        time.sleep(0.05)
    start = time.time()  # the window: from the first step on (start-up is the same for all and not a failure)
    applied = []
    for at, rank in kills:
        while time.time() - start < at and proc.poll() is None:
            time.sleep(0.02)
        pid, note = _victim(run, replicas, rank), ""
        if pid is None:
            note = "no worker to kill"
        else:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                note = "worker already gone"
        applied.append({"at_s": round(time.time() - start, 2), "rank": rank, "note": note})
    while time.time() - start < duration and proc.poll() is None:
        time.sleep(0.05)
    alive = proc.poll() is None
    window = time.time() - start
    load_after = os.getloadavg()[0]
    _stop(proc)
    log.close()
    # Per-step times from each worker group's goodput ledger (a "step" event with its wall time at every step).
    ledgers = {d.name: _ledger(d, start) for d in (_replica_dirs(run) if replicas else [run])}
    final = _lineage_at(ledgers, window)
    for f in applied:
        at = f["at_s"]
        before = f["steps_at_kill"] = _lineage_at(ledgers, at)
        nxt = [t for steps_ in ledgers.values() for t, n in steps_ if t > at and n > before]
        f["to_next_useful_step_s"] = round(min(nxt) - at, 2) if nxt else None
        if replicas:
            back = [t for t, n in ledgers.get(f"replica{f['rank']}", []) if t > at and n > before]
            f["rejoin_s"] = round(min(back) - at, 2) if back else None
        else:  # a restart's cost in two parts: until the workers resumed, and the steps they had to take again
            # the resume of this restart: before the next kill (none when no checkpoint existed yet: from step 0)
            until = min([g["at_s"] for g in applied if g["at_s"] > at] or [window])
            resumed = [(t, n, src) for t, n, src in _resumes(run, start) if at < t < until]
            if not resumed:
                f.update(restart_s=None, resumed_from_step=0, steps_redone=before, loaded_from="nothing")
            else:
                t, n, src = resumed[0]
                f.update(restart_s=round(t - at, 2), resumed_from_step=n, steps_redone=before - n, loaded_from=src)
    out: dict = {"steps": final, "window_s": round(window, 1), "startup_s": round(start - launched, 1),
                 "load_avg_1m_before_after": [load_before, load_after], "alive_at_end": alive, "kills": applied}
    waits = [f["to_next_useful_step_s"] for f in applied if f["to_next_useful_step_s"] is not None]
    out["mean_to_next_useful_step_s"] = sum(waits) / len(waits) if waits else None
    text = (run.parent / f"{name}.log").read_text(errors="replace")
    if replicas:
        seen: dict[int, int] = {}  # step -> how many groups took it
        for v in ledgers.values():
            for n in {n for t, n in v if t <= window}:
                seen[n] = seen.get(n, 0) + 1
        alone = sum(1 for n, k in seen.items() if k == 1 and n <= final)  # half a global batch each
        # a step whose collectives failed (the kill came during it) counts but updates nothing; the survivor's are in
        # the final lineage (the replacement healed from it): the most any group logged
        uncommitted = max(len(re.findall(rf"replica group {g}: step not committed", text)) for g in range(2))
        out.update(uncommitted_steps=uncommitted, half_batch_steps=alone)
        useful = final - uncommitted
        out["goodput_steps_per_s"] = useful / duration
        out["goodput_samples_per_s"] = (useful - alone / 2) / duration  # in global batches per second
        per = {}
        for d in _replica_dirs(run):
            rs = [r for r in _metrics(d) if "replica_quorum_s_total" in r]
            inc = [((b["replica_quorum_s_total"] - a["replica_quorum_s_total"]) / (b["step"] - a["step"]),
                    (b["replica_commit_s_total"] - a["replica_commit_s_total"]) / (b["step"] - a["step"]))
                   for a, b in zip(rs[1:], rs[2:], strict=False) if b["step"] > a["step"]
                   and b["replica_quorum_s_total"] >= a["replica_quorum_s_total"]]
            if inc:  # per log interval (10 steps), the median: steady state, not the waits at a kill
                per[d.name] = {"quorum_s_per_step_median": sorted(q for q, _ in inc)[len(inc) // 2],
                               "should_commit_s_per_step_median": sorted(c for _, c in inc)[len(inc) // 2],
                               "quorum_s_per_step_max": max(q for q, _ in inc)}
        out["torchft_cost"] = per
    else:
        out["goodput_steps_per_s"] = final / duration
        out["goodput_samples_per_s"] = out["goodput_steps_per_s"]
        out["restarts"] = len(re.findall(r'"event": "failed"', (run / "goodput.jsonl").read_text()))
    rows = _metrics(run if not replicas else max(_replica_dirs(run), key=_steps))
    out["median_step_s"] = sorted(r["step_s"] for r in rows)[len(rows) // 2] if rows else None
    return out


def recovery(args: argparse.Namespace) -> dict:
    duration = 100.0 if args.quick else args.minutes * 60
    gap = 40.0 if args.quick else args.mean_gap
    kills = kill_schedule(args.seed, duration, gap)
    root = Path(tempfile.mkdtemp(prefix="plait-chaos-recovery-"))
    results = {}
    for name in args.systems:
        results[name] = run_recovery(name, root / name, kills, duration, args.ckpt_every, args.extra)
        print(f"{name}: {results[name]['steps']} steps, goodput {results[name]['goodput_steps_per_s']:.3f} steps/s",
              file=sys.stderr, flush=True)
    base = max(results["restart"]["goodput_steps_per_s"], 1e-9)
    ratios = {f"{k}_over_restart": v["goodput_steps_per_s"] / base for k, v in results.items() if k != "restart"}
    if "replicas" in results:
        ratios["replicas_over_restart_samples"] = results["replicas"]["goodput_samples_per_s"] / max(
            results["restart"]["goodput_samples_per_s"], 1e-9)
    return {"bench": "chaos", "compare": "recovery", "machine": _common.machine_info(), "quick": args.quick,
            "config": {"model": "default GPT (plait train defaults)", "workers": 2, "checkpoint_every_steps":
                       args.ckpt_every, "window_s": duration, "mean_gap_s": gap, "seed": args.seed,
                       "comm_timeout_s": 10, "log_every": 10, "kills": kills,
                       "replacement_s": args.replacement_s if args.replacement_s is not None else "plait's backoff",
                       "settings": RECOVERY + args.extra + [f"--checkpoint.every={args.ckpt_every}"],
                       "systems": SYSTEMS},
            "results": results, "ratios": ratios,
            "target_replicas_1.5x_restart": (ratios["replicas_over_restart"] >= 1.5) if "replicas" in results else None,
            "target_replicas_1.5x_restart_samples": (ratios["replicas_over_restart_samples"] >= 1.5
                                                     if "replicas" in results else None),
            "load_avg_1m": os.getloadavg()[0], "work_dir": str(root)}


def practice(args: argparse.Namespace) -> dict:
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
    return {"bench": "chaos", "compare": "practice", "machine": _common.machine_info(), "seed": args.seed,
            "duration_s": duration, "mean_gap_s": gap, "schedule": faults, "results": results,
            "goodput_ratio_plait_over_practice": ratio, "target_goodput_1.3x": ratio >= 1.3, "saves": saves,
            "target_async_within_20pct": saves["async_over_sync"] <= 0.2, "work_dir": str(root)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", choices=("recovery", "practice"), default="recovery")
    ap.add_argument("--quick", action="store_true",
                    help="recovery: 100 s per system, a kill per ~40 s; practice: 1.5 minutes, a fault per ~15 s")
    ap.add_argument("--minutes", type=float, default=None, help="per system (default: recovery 5, practice 10)")
    ap.add_argument("--mean-gap", type=float, default=None, help="seconds (default: recovery 120, practice 30)")
    ap.add_argument("--ckpt-every", type=int, default=None,
                    help=f"recovery: checkpoint every N steps (default plait's, {DEFAULT_EVERY}; --quick: 30)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--extra", action="append", default=[], metavar="--SECTION.KEY=VALUE",
                    help="recovery: a plait train setting for every system (repeat it), e.g. a larger model: the "
                         "model's step time sets how many seconds a checkpoint interval of steps is")
    ap.add_argument("--replacement-s", type=float, default=None, metavar="D",
                    help="recovery: a killed worker's replacement starts D seconds after the failure in every system "
                         "(fault.restart_backoff_s=D: restart waits for it, replicas' survivor trains on), as when a "
                         "lost machine must be replaced; default: plait's backoff (1 s), a process restarted at once")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="recovery: which systems (restart is required)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.replacement_s is not None:
        args.extra.append(f"--fault.restart_backoff_s={args.replacement_s:g}")
    args.systems = [x for x in args.systems.split(",") if x]
    if "restart" not in args.systems or set(args.systems) - set(SYSTEMS):
        ap.error(f"--systems: a comma list of {list(SYSTEMS)} that includes restart")
    rec = args.compare == "recovery"
    args.minutes = args.minutes if args.minutes is not None else (5.0 if rec else 10.0)
    args.mean_gap = args.mean_gap if args.mean_gap is not None else (120.0 if rec else 30.0)
    args.ckpt_every = args.ckpt_every if args.ckpt_every is not None else (30 if args.quick else DEFAULT_EVERY)
    report = recovery(args) if rec else practice(args)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
