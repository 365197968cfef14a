"""Restarting from the in-memory copy (``fault.memory_checkpoint``) against restarting from disk.

A GPT of ``--d-model`` x ``--layers`` trains on 2 local workers (``plait train``, checkpoint every 10 steps); after
step 12 worker 1 is SIGKILLed and the launcher restarts both. Three runs: ``memory`` (the holder keeps the copies),
``disk`` (memory checkpoints on, but the holder SIGKILLed with the worker: the fallback) and ``off`` (the setting
off: today's restart). Reported per run: the restart's load time as the log states it, the time from the kill
to the first step past the kill point (the workers' start, the load, the steps lost), and the mean blocking
time of a save (from the goodput ledger: the memory copy is paid there). Target: the memory load at least 2x
faster than the disk load (on a machine whose checkpoint sits in the page cache it can come out false: the
disk is then memory too). Prints JSON.

    python bench/memory_checkpoint.py [--quick] [--d-model 384] [--layers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common  # noqa: F401  (puts src/ on the path)

from plait.fault.restart import read_progress, worker_pids

REPO = Path(__file__).resolve().parents[1]
KILL_AT = 12


def _steps(run: Path) -> int:
    return int(read_progress(run).get("steps") or 0)


def run(name: str, root: Path, model: list[str], memory: bool, kill_holder: bool) -> dict:
    run_dir = root / name
    cmd = [sys.executable, "-m", "plait.cli", "train", *model, "--train.steps=20", "--checkpoint.every=10",
           "--train.eval_every=0", "--train.log_every=2", "--observe.progress=false", "--observe.trackers=[]",
           "--parallel.nproc=2", "--fault.max_restarts=2", "--fault.restart_backoff_s=0.1", "--comm.timeout_s=10",
           f"--fault.memory_checkpoint={memory}", f"--run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    log = open(root / f"{name}.log", "w+")
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
    while _steps(run_dir) < KILL_AT and proc.poll() is None:
        time.sleep(0.02)
    killed_at = time.time()
    if kill_holder:
        os.kill(int((run_dir / "workers" / "holder.pid").read_text()), signal.SIGKILL)
    os.kill(worker_pids(run_dir)[1][0], signal.SIGKILL)
    back = None
    while proc.poll() is None:
        progress = read_progress(run_dir)
        if back is None and int(progress.get("steps") or 0) > KILL_AT and int(progress.get("start") or 0) > 0:
            back = time.time() - killed_at  # the restarted attempt's progress, past the kill point
        time.sleep(0.02)
    log.seek(0)
    err = log.read()
    log.close()
    memory_load = re.search(r"from host memory \(.*?\) in ([\d.]+)s", err)
    disk_load = re.search(r"resumed from \S+ at step \d+ in ([\d.]+)s \(disk\)", err)
    saves = [json.loads(x) for x in (run_dir / "goodput.jsonl").read_text().splitlines() if '"save"' in x]
    blocking = [e["blocking_s"] for e in saves if e.get("event") == "save"]
    return {"exit": proc.returncode, "load_s": float((memory_load or disk_load).group(1)) if (memory_load or disk_load)
            else None, "loaded_from": "memory" if memory_load else "disk" if disk_load else None,
            "kill_to_next_step_s": round(back, 2) if back is not None else None,
            "save_blocking_s": round(sum(blocking) / len(blocking), 4) if blocking else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small model (d_model 128, 4 layers)")
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args()
    d, layers = (128, 4) if a.quick else (a.d_model, a.layers)
    model = [f"--model.d_model={d}", f"--model.n_layer={layers}", f"--model.n_head={max(1, d // 64)}",
             "--model.seq_len=128", "--train.global_batch_size=8"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        out = {name: run(name, root, model, memory, kill) for name, memory, kill in
               (("memory", True, False), ("disk", True, True), ("off", False, False))}
    m, k = out["memory"]["load_s"], out["disk"]["load_s"]
    ratio = k / m if m and k else None
    print(json.dumps({"model": {"d_model": d, "n_layer": layers}, "runs": out,
                      "disk_over_memory_load": round(ratio, 2) if ratio else None,
                      "verdict_memory_load_2x_faster": bool(ratio and ratio >= 2.0
                                                            and out["memory"]["loaded_from"] == "memory")}, indent=1))


if __name__ == "__main__":
    main()
