"""Restarting from the in-memory copy (``fault.memory_checkpoint``) against restarting from disk.

A GPT of ``--d-model`` x ``--layers`` trains on 2 local workers (``plait train``, checkpoint every 10 steps); after
step 12 worker 1 is SIGKILLed and the launcher restarts both. Three runs: ``memory`` (the holder keeps the copies),
``disk`` (memory checkpoints on, but the holder SIGKILLed with the worker: the fallback) and ``off`` (the setting
off: today's restart). Reported per run: the restart's load time as the log states it, the time from the kill
to the first step past the kill point (the workers' start, the load, the steps lost), and the mean blocking
time of a save (from the goodput ledger: the memory copy is paid there). Target: the memory load at least 2x
faster than the disk load (on a machine whose checkpoint sits in the page cache it can come out false: the
disk is then memory too). Prints JSON.

``--link``: the second copy's transfer on several machines, alone: a holder in one network namespace, a client in
another, over bench/compress.py's link (veth, each end shaped to 1 Gbit/s, 10 ms), against a holder on loopback;
``--mb`` megabytes (default 172: the 8 x 384 GPT's model and optimizer state), a put then a get, timed. Verdict:
the put over the link within 2x the link's line-rate time (it can come out false: a holder slower than the
link). Needs root (``"skipped"`` with the reason otherwise).

    python bench/memory_checkpoint.py [--quick] [--d-model 384] [--layers 8]
    python bench/memory_checkpoint.py --link [--mb 172]
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


# A client in the other namespace: one put and one get of argv[2] random bytes, timed; JSON on stdout.
CLIENT = """
import json, os, sys, time
from plait.fault.holder import Client
c = Client(sys.argv[1], os.environ["PLAIT_MEMORY_TOKEN"], timeout_s=300)
payload = os.urandom(int(sys.argv[2]))
t0 = time.perf_counter(); ok = c.put(0, 1, 1, payload); put = time.perf_counter() - t0
t0 = time.perf_counter(); got = c.get(0); get = time.perf_counter() - t0
whole = ok and got is not None and got[1] == payload
print(json.dumps({"put_s": round(put, 3), "get_s": round(get, 3), "whole": whole}))
"""


def link(mb: int) -> dict:
    """The peer copy's transfer over the shaped link, against loopback (see the module docstring)."""
    import secrets

    from compress import ADDRS, BenchError, Network

    if os.geteuid() != 0:
        return {"skipped": "--link creates network namespaces and must run as root"}
    size, token = mb * 1_000_000, secrets.token_hex(16)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src"), "PLAIT_MEMORY_TOKEN": token}
    net = Network("netns", f"mc{os.getpid() % 10000}")
    try:
        net.setup()
    except BenchError as e:
        net.close()
        return {"skipped": str(e)}
    out: dict = {"mb": mb}
    try:
        for name, holder_ns, client_ns, host in (("loopback", None, None, "127.0.0.1"),
                                                 ("link_1gbit", net.hosts[0][0], net.hosts[1][0], ADDRS[0])):
            wrap = ["ip", "netns", "exec", holder_ns] if holder_ns else []
            holder = subprocess.Popen([*wrap, sys.executable, "-m", "plait.fault.holder", str(os.getpid()), host],
                                      env=env, stdout=subprocess.PIPE, text=True)
            try:
                port = int(holder.stdout.readline().split()[1])
                wrap = ["ip", "netns", "exec", client_ns] if client_ns else []
                r = subprocess.run([*wrap, sys.executable, "-c", CLIENT, f"{host}:{port}", str(size)], env=env,
                                   capture_output=True, text=True, timeout=600)
                out[name] = json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr[-2000:]}
            finally:
                holder.kill()
                holder.wait()
    finally:
        net.close()
    line_rate_s = size * 8 / 1e9
    put = out.get("link_1gbit", {}).get("put_s")
    out.update(line_rate_s=round(line_rate_s, 3), verdict_put_within_2x_line_rate=bool(
        put is not None and out["link_1gbit"].get("whole") and put <= 2 * line_rate_s))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small model (d_model 128, 4 layers)")
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--link", action="store_true", help="the peer copy's transfer over a 1 Gbit/s link (root)")
    ap.add_argument("--mb", type=int, default=172, help="--link: megabytes per copy")
    a = ap.parse_args()
    if a.link:
        print(json.dumps(link(a.mb), indent=1))
        return
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
