"""Time to a target validation loss with gradient compression: plait's compressors against uncompressed
plait, plain PyTorch DDP and DDP with its ``powerSGD_hook``, on loopback and on a 1 Gbit/s link.

Two ranks train the small GPT with data parallelism, each under its own ``torchrun`` agent
(``--nnodes=2``, one process per node), on two networks, each built here with network namespaces:
  loopback  both ranks in one fresh namespace, talking over its own ``lo`` (127.0.0.1);
  netns     one namespace per rank ("host"), joined by a veth pair whose two ends are shaped to
            1 Gbit/s with ``tc tbf``: real TCP between 10.77.0.1 and 10.77.0.2.
The namespaces carry this process's id in their names and are removed at the end, also on Ctrl-C.

Per run the JSON reports:
  time_to_target_s  sum of per-step ``step_s`` (data, forward, backward, exposed communication,
                    optimizer) up to the first evaluation at or below the target; evaluation, startup
                    and checkpoint time are excluded. null ("reached": false) when never reached.
  comm_bytes        sum of ``comm_bytes`` over the steps in metrics.jsonl: bytes one rank sends, as
                    plait's communication layer counts them; for DDP computed by bench/ddp_peer.py from
                    the gradient size (or the PowerSGD hook's element count), see its docstring.
  wire_bytes        bytes the network devices transmitted during the whole run, both ranks together
                    (both veth ends, or the namespace's lo), read from /sys/class/net/*/statistics:
                    TCP/IP headers, rendezvous, evaluation and final checkpoint traffic included.
  step_s_median     median ``step_s``: the per-step cost without the luck of where the curve crosses.
  final_val_loss, steps, wall_s (whole run including startup and evaluation).
Ratios: for each plait run, DDP's (and DDP+PowerSGD's) time to target divided by the run's
(``speedup_vs_*``), and the same for the median step time (``step_speedup_vs_*``). With one 16-token
sequence per rank the validation curve is noisy (spikes of +1 nat that every method shares), so a
time-to-target ratio is only trusted where the per-step ratio agrees with it.

    sudo python bench/compress.py [--quick] [--networks loopback,netns] [--target 2.6] [--steps 200]
        [--methods plait-none,plait-int8,ddp,ddp-powersgd] [--out FILE.json] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMPRESSORS = ["fp16", "bf16", "int8", "int4", "topk", "randomk", "powersgd"]
QUICK_METHODS = ["plait-none", "plait-powersgd", "plait-int8", "ddp", "ddp-powersgd"]
# ~12.7M parameters (51 MB of fp32 gradients: ~0.4 s per all-reduce at 1 Gbit/s) and one 16-token
# sequence per rank per step (~0.1 s of forward and backward on one core; the fused AdamW kernel,
# the same for every method, keeps the optimizer step small, where the per-parameter loop took ~0.16 s):
# communication dominates on the slow link, which is the regime where compression can pay; on
# loopback it mostly does not. lr 1e-3: at 3e-3 this small batch diverged after warmup (validation
# loss above its initial value); 128 evaluation sequences make the target crossing less noisy.
# PowerSGD rank 8 for plait and for DDP's hook alike.
MODEL = ["--model.n_layer=4", "--model.d_model=512", "--model.n_head=8", "--model.seq_len=16",
         "--train.global_batch_size=2", "--train.micro_batch_size=1", "--comm.powersgd_rank=8"]
COMMON = ["--train.log_every=1", "--train.eval_sequences=128", "--optim.fused=true", "--optim.warmup_steps=20",
          "--optim.lr=1e-3", "--checkpoint.every=0", "--observe.progress=false", "--observe.tensorboard=false"]
ADDRS = ("10.77.0.1", "10.77.0.2")


class BenchError(ValueError):
    """The benchmark cannot run here; the message says what to do."""


def sh(*cmd: str) -> str:
    """Run an ``ip``/``tc`` command; raise with its stderr when it fails."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise BenchError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")
    return r.stdout


class Network:
    """Namespaces for one network; ``hosts[r]`` = (namespace, device, address) of rank r."""

    def __init__(self, kind: str, tag: str) -> None:
        self.kind, self.tag, self.namespaces, self.hosts = kind, tag, [], []

    def setup(self) -> None:
        """Create the namespaces (recorded one by one, so ``close`` removes whatever was made)."""
        kind, tag = self.kind, self.tag
        if kind == "loopback":
            ns = f"plait-bench-lo-{tag}"
            self._add_ns(ns)
            self.hosts = [(ns, "lo", "127.0.0.1")] * 2
            return
        a, b = f"plait-bench-a-{tag}", f"plait-bench-b-{tag}"
        va, vb = f"pba{tag}"[:15], f"pbb{tag}"[:15]
        self._add_ns(a)
        self._add_ns(b)
        sh("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
        for ns, dev, addr in ((a, va, ADDRS[0]), (b, vb, ADDRS[1])):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            # Each end shapes its egress, so both directions of the full-duplex link carry 1 Gbit/s.
            sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", "1gbit", "burst", "256kb",
               "latency", "10ms")
            self.hosts.append((ns, dev, addr))

    def _add_ns(self, ns: str) -> None:
        sh("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")

    def tx_bytes(self) -> int:
        """Bytes transmitted so far by the devices the ranks talk over (each device counted once)."""
        total = 0
        for ns, dev, _ in dict.fromkeys(self.hosts):
            total += int(sh("ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/tx_bytes"))
        return total

    def kill_leftovers(self) -> None:
        """SIGKILL any process still inside this network's namespaces: all of them were started here
        (torchrun puts its workers in their own sessions, so ending an agent can orphan its worker)."""
        for ns in self.namespaces:
            r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in r.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def close(self) -> None:
        self.kill_leftovers()
        for ns in self.namespaces:  # deleting a namespace also deletes the veth end inside it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces = []


def rank_command(method: str, net: Network, rank: int, port: int, run_dir: Path, overrides: list[str]) -> list[str]:
    ns, dev, _ = net.hosts[rank]
    master = net.hosts[0][2]
    env = ["env", f"PYTHONPATH={REPO / 'src'}", f"GLOO_SOCKET_IFNAME={dev}", "OMP_NUM_THREADS=1",
           "PYTHONUNBUFFERED=1"]
    run = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={rank}",
           "--nproc-per-node=1", f"--master-addr={master}", f"--master-port={port}"]
    if method.startswith("ddp"):
        hook = "powersgd" if method == "ddp-powersgd" else "none"
        target = [str(REPO / "bench" / "ddp_peer.py"), f"--hook={hook}"]
    else:
        target = ["-m", "plait.cli", "train", f"--comm.compress={method.removeprefix('plait-')}"]
    return ["ip", "netns", "exec", ns, *env, *run, *target, *overrides, f"--run.dir={run_dir}"]


def launch(cmds: list[list[str]], logs: list[Path], timeout_s: float) -> None:
    """Start both ranks, wait for them; on failure, timeout or Ctrl-C end both process groups."""
    procs = []
    try:
        for cmd, log in zip(cmds, logs, strict=True):
            with open(log, "w") as f:
                procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    bad = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
    if bad:
        rank, rc = bad[0]
        tail = logs[rank].read_text()[-2000:]
        raise RuntimeError(f"rank {rank} exited with {rc} (timeout {timeout_s:.0f} s?); log tail:\n{tail}")


def summarize(metrics: Path, target: float) -> dict:
    """Time to target, bytes and final loss from one metrics.jsonl (rank 0's)."""
    recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    elapsed, comm_bytes, steps, hit, step_times = 0.0, 0, 0, None, []
    final_val = float("nan")
    for r in recs:
        if "step_s" in r:
            elapsed += r["step_s"]
            step_times.append(r["step_s"])
            comm_bytes += r.get("comm_bytes", 0)
            steps = r["step"]
        if "val_loss" in r:
            final_val = r["val_loss"]
            if hit is None and r["val_loss"] <= target:
                hit = {"time_to_target_s": elapsed, "step_at_target": r["step"]}
    out = {"reached": hit is not None, "time_to_target_s": None, "step_at_target": None, **(hit or {})}
    out.update(final_val_loss=final_val, steps=steps, train_seconds=elapsed,
               step_s_median=statistics.median(step_times) if step_times else None, comm_bytes=comm_bytes,
               comm_bytes_per_step=comm_bytes / max(1, steps))
    return out


def run_one(method: str, net: Network, index: int, root: Path, args: argparse.Namespace) -> dict:
    run_dir = root / f"{net.kind}-{method}"
    run_dir.mkdir(parents=True)
    overrides = MODEL + COMMON + [f"--train.steps={args.steps}", f"--train.eval_every={args.eval_every}"]
    port = 29500 + index
    cmds = [rank_command(method, net, r, port, run_dir, overrides) for r in range(2)]
    logs = [run_dir / f"rank{r}.log" for r in range(2)]
    tx0, t0 = net.tx_bytes(), time.perf_counter()
    try:
        launch(cmds, logs, args.run_timeout)
    except RuntimeError as e:
        net.kill_leftovers()
        print(f"[compress] {net.kind} {method}: FAILED: {e}", file=sys.stderr)
        return {"method": method, "network": net.kind, "error": str(e).splitlines()[0]}
    res = {"method": method, "network": net.kind, "wall_s": time.perf_counter() - t0,
           "wire_bytes": net.tx_bytes() - tx0, **summarize(run_dir / "metrics.jsonl", args.target)}
    print(f"[compress] {net.kind:8s} {method:14s} reached={res['reached']!s:5s} "
          f"t={res['time_to_target_s'] or float('nan'):7.1f}s final={res['final_val_loss']:.3f} "
          f"comm={res['comm_bytes'] / 1e6:8.1f}MB wire={res['wire_bytes'] / 1e6:8.1f}MB", file=sys.stderr)
    return res


def annotate(results: list[dict]) -> dict:
    """Ratios against DDP, whether compression was applied at all, and whether the issue's target was met."""
    by = {r["method"]: r for r in results if "error" not in r}
    none_bytes = by.get("plait-none", {}).get("comm_bytes_per_step")
    for r in by.values():
        if r["method"].startswith("plait-") and r["method"] != "plait-none" and none_bytes:
            # A compressor plait ignores sends as much as uncompressed plait: say so instead of ranking it.
            r["bytes_vs_uncompressed"] = r["comm_bytes_per_step"] / none_bytes
            r["compression_applied"] = r["bytes_vs_uncompressed"] < 0.9
        for peer in ("ddp", "ddp-powersgd"):
            mine, theirs = r.get("time_to_target_s"), by.get(peer, {}).get("time_to_target_s")
            if r["method"].startswith("plait-"):
                r[f"speedup_vs_{peer}"] = theirs / mine if mine and theirs else None
                # The same ratio per step: free of where a noisy validation curve first crosses the target.
                mine, theirs = r.get("step_s_median"), by.get(peer, {}).get("step_s_median")
                r[f"step_speedup_vs_{peer}"] = theirs / mine if mine and theirs else None
    compressed = [r for r in by.values() if r.get("compression_applied")]
    best = max(compressed, key=lambda r: r.get("speedup_vs_ddp") or 0.0, default=None)
    return {
        "compressors_applied": [r["method"] for r in compressed],
        "best_compressor": best["method"] if best else None,
        "best_speedup_vs_ddp": best.get("speedup_vs_ddp") if best else None,
        "best_step_speedup_vs_ddp": best.get("step_speedup_vs_ddp") if best else None,
        "target_2x_vs_ddp_met": bool(best and (best.get("speedup_vs_ddp") or 0.0) >= 2.0),
        "ddp_reached_target": by.get("ddp", {}).get("reached"),
    }


def conclusion(report: dict) -> str:
    """One honest sentence on the issue's target: a compressor 2x faster to target than DDP on 1 Gbit/s."""
    net = report["networks"].get("netns")
    if net is None:
        return "not evaluated: the netns (1 Gbit/s) network was not run"
    v = net["verdict"]
    if not v["compressors_applied"]:
        return ("not met: no plait compressor changed the bytes sent (none run, or comm.compress is not "
                "wired into the reducer in this build)")
    if v["best_speedup_vs_ddp"] is None:
        by = {r["method"]: r for r in net["results"] if "error" not in r}
        hits = [by[m] for m in v["compressors_applied"] if by[m]["reached"]]
        if not hits or "ddp" not in by:
            return "not met: every compressed run missed the target loss within the step cap (or DDP failed)"
        best = min(hits, key=lambda r: r["time_to_target_s"])
        bound = by["ddp"]["train_seconds"] / best["time_to_target_s"]
        return (f"{'met' if bound >= 2 else 'undecided'}: DDP missed the target within the step cap; "
                f"{best['method']} reached it at least {bound:.2f}x faster than DDP's whole run")
    verb = "met" if v["target_2x_vs_ddp_met"] else "not met"
    per_step = v.get("best_step_speedup_vs_ddp")
    return (f"{verb}: the best compressor, {v['best_compressor']}, reached the target "
            f"{v['best_speedup_vs_ddp']:.2f}x faster than DDP"
            + (f" (median step {per_step:.2f}x faster)" if per_step else ""))


def print_table(report: dict) -> None:
    """Time to target and DDP's time divided by it, per network and run (stderr, for people)."""
    for kind, net in report["networks"].items():
        print(f"[compress] {kind}: method, time to target (s), final val loss, comm MB/step, "
              "DDP time / time, DDP+PowerSGD time / time, median step (s), DDP step / step", file=sys.stderr)
        for r in net["results"]:
            if "error" in r:
                print(f"  {r['method']:14s} FAILED: {r['error']}", file=sys.stderr)
                continue
            ratio = [f"{x:.2f}" if x else "-" for x in (r.get("speedup_vs_ddp"), r.get("speedup_vs_ddp-powersgd"),
                                                       r.get("step_s_median"), r.get("step_speedup_vs_ddp"))]
            t = f"{r['time_to_target_s']:.1f}" if r["reached"] else "not reached"
            note = "" if r.get("compression_applied", True) else "  (compression not applied)"
            print(f"  {r['method']:14s} {t:>11s} {r['final_val_loss']:6.3f} {r['comm_bytes_per_step'] / 1e6:8.2f} "
                  f"{ratio[0]:>6s} {ratio[1]:>6s} {ratio[2]:>6s} {ratio[3]:>6s}{note}", file=sys.stderr)
    print(f"[compress] issue target (2x faster than DDP on 1 Gbit/s): {report['issue_target']}", file=sys.stderr)


def check_environment(networks: list[str]) -> None:
    if os.geteuid() != 0:
        raise BenchError("bench/compress.py creates network namespaces and must run as root (sudo)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise BenchError(f"'{tool}' not found: install iproute2 (apt-get install iproute2)")
    unknown = set(networks) - {"loopback", "netns"}
    if unknown:
        raise BenchError(f"unknown network(s) {sorted(unknown)}; choose from loopback, netns")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"{', '.join(QUICK_METHODS)} on netns only, 60 steps, target 3.0")
    ap.add_argument("--networks", default=None, help="comma-separated: loopback,netns (default both)")
    ap.add_argument("--methods", default=None, help="comma-separated subset, e.g. plait-none,ddp")
    ap.add_argument("--target", type=float, default=None,
                    help="target validation loss in nats/token (default 2.6; 3.0 with --quick)")
    ap.add_argument("--steps", type=int, default=None, help="step cap per run (default 200; 60 with --quick)")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--run-timeout", type=float, default=900.0, help="seconds before a run is killed")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    ap.add_argument("--keep", type=Path, default=None, help="keep run directories under this folder")
    args = ap.parse_args()
    all_methods = ["plait-none"] + [f"plait-{c}" for c in COMPRESSORS] + ["ddp", "ddp-powersgd"]
    args.networks = (args.networks or ("netns" if args.quick else "loopback,netns")).split(",")
    args.methods = args.methods.split(",") if args.methods else (QUICK_METHODS if args.quick else all_methods)
    args.steps = args.steps or (60 if args.quick else 200)
    args.target = args.target or (3.0 if args.quick else 2.6)
    bad = set(args.methods) - set(all_methods)
    if bad:
        raise BenchError(f"unknown method(s) {sorted(bad)}; choose from {', '.join(all_methods)}")
    return args


def main() -> int:
    try:
        args = parse_args()
        check_environment(args.networks)
    except BenchError as e:
        print(f"compress.py: error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM cleans up like Ctrl-C
    tag, t_start = str(os.getpid()), time.perf_counter()
    report: dict = {"bench": "compress", "target_val_loss": args.target, "steps_cap": args.steps,
                    "eval_every": args.eval_every, "model_overrides": MODEL + COMMON, "networks": {}}
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="plait-compress-", dir=args.keep))
    try:
        for kind in args.networks:
            net = Network(kind, tag)
            try:
                net.setup()
                results = [run_one(m, net, i, root, args) for i, m in enumerate(args.methods)]
            finally:
                net.close()
            report["networks"][kind] = {"results": results, "verdict": annotate(results)}
    except KeyboardInterrupt:
        print("compress.py: interrupted; namespaces and ranks removed", file=sys.stderr)
        return 130
    except BenchError as e:
        print(f"compress.py: error: {e}", file=sys.stderr)
        return 2
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    report["bench_seconds"] = time.perf_counter() - t_start
    report["issue_target"] = conclusion(report)
    print_table(report)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
