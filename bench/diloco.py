"""Time to the all-reduce run's validation loss: DiLoCo (``parallel.sync=diloco``) against per-step all-reduce
data parallelism, two ranks over a 1 Gbit/s link.

The network is bench/compress.py's ``netns``: one network namespace per rank joined by a veth pair, each end
shaped to 1 Gbit/s with ``tc tbf`` (burst 256 kB, latency 10 ms): real TCP between two "hosts". Each rank runs
under its own ``torchrun`` agent (``--nnodes=2``). The model and data are compress.py's (``MODEL``, ``COMMON``: a
4-layer d=256 GPT, 3.2M parameters, 12.9 MB of fp32 gradients per step, ~0.1 s per all-reduce on this link,
about twice the compute of a step on one core).

Runs: ``dp`` (plait's reducer, an all-reduce every step) for ``--steps`` steps; then DiLoCo for every H of
``--inner-steps`` and every outer setting of ``--outer`` (``LR:MOMENTUM`` pairs; momentum above 0 is Nesterov's) for
``--diloco-factor`` times as many steps, evaluated every H steps (right after each synchronisation, when the replicas
agree); then ``dp`` again (``dp-again``: the same seeded curve, timed a second time, so a change in the shared
machine's load between the first and the last run shows; the verdict takes the faster of the two dp times). The
target is the dp run's final validation loss, smoothed (bench/_ttq.py: trailing mean over ``--window``
evaluations); each run's time to target is bench/_ttq.py's stays-below rule on the sum of per-step ``step_s`` (data,
compute, exposed communication, optimizer; evaluation and start-up excluded). Also reported: ``comm_bytes`` (plait's
own accounting, bytes one rank sent) per step, the bytes the link carried, median step time and its parts (the
share of dp's step spent waiting for the all-reduce: how much of the step the link costs), the 1-minute load average
before and after each run.

Outer settings (``--outer``, default ``0.7:0.9,1.0:0``): DiLoCo's published outer optimizer (Nesterov SGD, lr 0.7,
momentum 0.9, plait's default) was chosen for H in the hundreds with large per-replica batches (DiLoCo: H = 500;
torchft's DiLoCo example: sync_every 100). With H this small its momentum compounds pseudo-gradients that point the
same way: at steady state Nesterov momentum mu scales the update by lr / (1 - mu) = 7x the mean pseudo-gradient, a
7x larger effective learning rate than the inner AdamW's, and the loss stalls above dp's. ``1.0:0`` is local SGD /
FedAvg (outer SGD at lr 1 without momentum: the replicas' weights are averaged), the classical setting for a few
steps between synchronisations (torchft's LocalSGD and Accelerate's LocalSGD average the replicas' weights).

Verdict per DiLoCo run: true when it reached the target and its time to target is below the faster dp run's
(``speedup`` = dp's time / DiLoCo's). A DiLoCo run that never reaches dp's loss within its steps is false.

    python bench/diloco.py [--quick] [--steps 150] [--inner-steps 10,30] [--outer 0.7:0.9,1.0:0]
        [--diloco-factor 2] [--seed 1] [--no-dp-again] [--extra=--model.d_model=512 ...] [--out FILE.json]
        [--keep DIR]                            (as root: it creates network namespaces)

Where namespaces cannot be made (not root, no ``ip``/``tc``, a kernel without them) it prints one JSON object
with ``"skipped"`` and the reason, and exits 0.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ttq as ttq  # noqa: E402
from compress import COMMON, MODEL, REPO, BenchError, Network, launch  # noqa: E402

DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM = 0.7, 0.9  # plait's parallel.diloco_outer_lr / diloco_outer_momentum


def rank_command(net: Network, rank: int, port: int, run_dir: Path, overrides: list[str]) -> list[str]:
    ns, dev, _ = net.hosts[rank]
    env = ["env", f"PYTHONPATH={REPO / 'src'}", f"GLOO_SOCKET_IFNAME={dev}", "OMP_NUM_THREADS=1",
           "PYTHONUNBUFFERED=1"]
    run = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={rank}",
           "--nproc-per-node=1", f"--master-addr={net.hosts[0][2]}", f"--master-port={port}"]
    return ["ip", "netns", "exec", ns, *env, *run, "-m", "plait.cli", "train", *overrides, f"--run.dir={run_dir}"]


def run_one(name: str, extra: list[str], steps: int, eval_every: int, net: Network, index: int, root: Path,
            args: argparse.Namespace) -> dict:
    run_dir = root / name
    run_dir.mkdir(parents=True)
    overrides = MODEL + COMMON + args.extra + [f"--train.steps={steps}", f"--train.eval_every={eval_every}",
                                               f"--train.seed={args.seed}", *extra]
    port = 29600 + index % 300 + os.getpid() % 50
    logs = [run_dir / f"rank{r}.log" for r in range(2)]
    load_before = os.getloadavg()[0]
    tx0, t0 = net.tx_bytes(), time.perf_counter()
    launch([rank_command(net, r, port, run_dir, overrides) for r in range(2)], logs, args.run_timeout)
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step_recs = [r for r in recs if "step_s" in r]
    out = {"run": name, "steps": steps, "eval_every": eval_every, "overrides": extra,
           "wall_s": time.perf_counter() - t0, "wire_bytes": net.tx_bytes() - tx0,
           "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
           "comm_bytes": sum(r.get("comm_bytes", 0) for r in step_recs),
           "step_s_median": statistics.median(r["step_s"] for r in step_recs),
           "step_parts_median": step_parts(step_recs),
           "train_seconds": sum(r["step_s"] for r in step_recs),
           "curve": [[s, round(t, 3), round(v, 4)] for s, t, v in ttq.curve_from_metrics(run_dir / "metrics.jsonl")]}
    out["comm_bytes_per_step"] = out["comm_bytes"] / steps
    print(f"[diloco] {name:24s} steps={steps} step={out['step_s_median']:.3f}s comm={out['comm_bytes'] / 1e6:.1f}MB "
          f"wire={out['wire_bytes'] / 1e6:.1f}MB final={out['curve'][-1][2]:.3f} wall={out['wall_s']:.0f}s "
          f"load={out['load_avg_1m']}", file=sys.stderr)
    return out


def step_parts(step_recs: list[dict]) -> dict:
    """Median seconds of each part of a step (the trainer's records), and the median share of the step spent
    waiting for communication after backward (``comm_exposed_s``: the all-reduce overlap did not hide)."""
    parts = {k: statistics.median(r.get(k, 0.0) for r in step_recs)
             for k in ("data_s", "forward_s", "backward_s", "comm_exposed_s", "optimizer_s")}
    parts["comm_exposed_share"] = statistics.median(r.get("comm_exposed_s", 0.0) / r["step_s"] for r in step_recs
                                                    if r["step_s"] > 0)
    return {k: round(v, 4) for k, v in parts.items()}


def outer_settings(text: str) -> list[tuple[float, float]]:
    """``--outer``: comma-separated ``LR:MOMENTUM`` pairs."""
    out = []
    for item in text.split(","):
        lr, _, mom = item.partition(":")
        out.append((float(lr), float(mom or 0)))
    return out


def diloco_run(h: int, lr: float, momentum: float) -> tuple[str, list[str]]:
    """A DiLoCo run's name and overrides: plait's default outer optimizer is named by H alone."""
    nesterov = "true" if momentum else "false"
    extra = ["--parallel.sync=diloco", f"--parallel.diloco_inner_steps={h}", f"--parallel.diloco_outer_lr={lr}",
             f"--parallel.diloco_outer_momentum={momentum}", f"--parallel.diloco_nesterov={nesterov}"]
    default = (lr, momentum) == (DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM)
    return (f"diloco-H{h}" if default else f"diloco-H{h}-outer{lr:g}-m{momentum:g}"), extra


def judge(dps: list[dict], runs: list[dict], window: int) -> dict:
    """The target (dp's final smoothed validation loss), every run's time to it, and each DiLoCo run's verdict
    against the faster of the dp runs (``dps``: the first, and ``dp-again`` where it ran)."""
    curve = [tuple(p) for p in dps[0]["curve"]]
    target = ttq.smooth([v for _, _, v in curve], window)[-1]
    for dp in dps:
        dp.update(ttq.time_to_target([tuple(p) for p in dp["curve"]], target, window))
    dp = min(dps, key=lambda d: d["time_to_target_s"] if d["reached"] else float("inf"))
    verdicts = {}
    for r in runs:
        r.update(ttq.time_to_target([tuple(p) for p in r["curve"]], target, window))
        speedup = (dp["time_to_target_s"] / r["time_to_target_s"]) if r["reached"] and r["time_to_target_s"] else None
        verdicts[r["run"]] = {
            "reached": r["reached"], "speedup": speedup,
            "bytes_per_step_ratio": r["comm_bytes_per_step"] / dp["comm_bytes_per_step"],
            "step_s_ratio": r["step_s_median"] / dp["step_s_median"],
            "steps_to_target_ratio": (r["step_at_target"] / dp["step_at_target"]) if r["reached"] else None,
            "final_val_loss": r["final_val_loss"],
            "verdict": bool(r["reached"] and speedup is not None and speedup > 1.0)}
    same = all(d["curve"][i][2] == dps[0]["curve"][i][2] for d in dps for i in range(len(dps[0]["curve"])))
    return {"target_val_loss": target, "dp_reference": dp["run"], "dp_time_to_target_s": dp["time_to_target_s"],
            "dp_comm_exposed_share": dp["step_parts_median"]["comm_exposed_share"],
            "dp_curves_identical": same, "runs": verdicts}


def environment_problem() -> str | None:
    if os.geteuid() != 0:
        return "bench/diloco.py creates network namespaces and must run as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' not found: install iproute2"
    probe = f"plait-diloco-probe-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode:
        return f"network namespaces cannot be made here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="40 dp steps, H=10, DiLoCo up to 80 steps")
    ap.add_argument("--steps", type=int, default=None, help="dp's steps (default 150; 40 with --quick)")
    ap.add_argument("--inner-steps", default=None, help="comma-separated H values, one DiLoCo run each (default 10)")
    ap.add_argument("--outer", default=f"{DEFAULT_OUTER_LR}:{DEFAULT_OUTER_MOMENTUM},1.0:0",
                    help="comma-separated outer LR:MOMENTUM pairs, one DiLoCo run per H each (momentum > 0: Nesterov)")
    ap.add_argument("--no-dp-again", action="store_true", help="skip the second dp run after the DiLoCo runs")
    ap.add_argument("--extra", action="append", default=[], metavar="--SECTION.KEY=VALUE",
                    help="an override for every run, after the bench's model (e.g. --extra=--model.d_model=512 for a "
                         "model whose all-reduce outweighs its compute more); repeatable")
    ap.add_argument("--diloco-factor", type=float, default=2.0, help="DiLoCo runs this many times dp's steps")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--window", type=int, default=ttq.DEFAULT_WINDOW)
    ap.add_argument("--run-timeout", type=float, default=1200.0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--keep", type=Path, default=None)
    args = ap.parse_args()
    args.steps = args.steps or (40 if args.quick else 150)
    args.inner_steps = [int(h) for h in (args.inner_steps or "10").split(",")]
    args.outer = outer_settings(args.outer)
    return args


def main() -> int:
    args = parse_args()
    report: dict = {"bench": "diloco", "network": "netns 1 Gbit/s (tc tbf, burst 256kb, latency 10ms), 2 ranks",
                    "model_overrides": MODEL + COMMON + args.extra, "dp_steps": args.steps, "seed": args.seed,
                    "smoothing_window": args.window, "outer_settings": args.outer}
    problem = environment_problem()
    if problem:
        report["skipped"] = problem
        print(json.dumps(report, indent=1))
        return 0
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    t_start = time.perf_counter()
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="plait-diloco-", dir=args.keep))
    net = Network("netns", str(os.getpid()))
    try:
        net.setup()
        dps = [run_one("dp", [], args.steps, 10, net, 0, root, args)]
        runs = []
        for h in args.inner_steps:
            steps = int(round(args.steps * args.diloco_factor / h)) * h  # whole periods: it ends synchronised
            for lr, momentum in args.outer:
                name, extra = diloco_run(h, lr, momentum)
                runs.append(run_one(name, extra, steps, h, net, len(runs) + 1, root, args))
        if not args.no_dp_again:  # the same curve timed again: the load may have changed since the first
            dps.append(run_one("dp-again", [], args.steps, 10, net, len(runs) + 1, root, args))
    except KeyboardInterrupt:
        print("diloco.py: interrupted; namespaces and ranks removed", file=sys.stderr)
        return 130
    except (BenchError, RuntimeError) as e:
        print(f"diloco.py: error: {e}", file=sys.stderr)
        return 2
    finally:
        net.close()
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    report["verdict"] = judge(dps, runs, args.window)
    report["results"] = [*dps, *runs]
    report["bench_seconds"] = time.perf_counter() - t_start
    report["machine"] = {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
