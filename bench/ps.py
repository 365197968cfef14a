"""Parameter server against all-reduce data parallelism, with and without a slow worker.

    python bench/ps.py [--quick] [--seeds 3] [--steps 60] [--compute-ms 20] [--slow-factor 4] [--out ps.json]
                       [--png ps.png]

Three workers train the same model on the same data through ``plait.Plait`` (the keep-your-loop API):
plait's all-reduce data parallelism (3 ranks) and the parameter server (1 server + 3 workers) in
``sync``, ``async``, ``ssp`` (s = 2), ``backup`` (b = 1) and ``dc`` (DC-ASGD-a, lambda0 = 2), the asynchronous
ones with staleness-aware learning rates (``ps.staleness_scaling = 1``). Each worker
runs ``--steps`` steps of 16 samples; in the straggler scenario worker rank 2 is made ``--slow-factor``
times slower with plait's testing aid (``fault.slow_rank`` / ``fault.slow_factor``: it sleeps
``(factor - 1) x`` its measured forward and backward time). The model is an MLP regression whose forward
also sleeps ``--compute-ms`` (a stand-in for accelerator compute: this benchmark runs on a few shared
CPU cores, where real compute of that size would make the processes contend for the cores and measure
the machine, not the strategy).

Rank 0 (a worker) evaluates its current parameters on a held-out set every 2 of its steps. Time to
target: the wall time at which the moving average of 3 consecutive validation losses first reaches the
target, which is the DP run's (no straggler, seed 0) smoothed validation loss at 60% of its steps.
Reported per mode and scenario: median and min/max over seeds of time to target, throughput (samples of
all workers while rank 0 trained / its training time), updates per second, rank 0's mean step time; the
ratios the issue targets; ``backup``'s mean time per version against the order-statistic prediction (the
(N-b)-th smallest of the workers' compute times per step, plus the sync run's mean communication
overhead); and updates per second of ``async`` against PyTorch's RPC parameter server (``_ps_rpc_peer.py``,
the pattern of its official example) at the benchmark's compute and at none. One JSON document goes to
stdout (and ``--out``); ``--png`` draws loss against iteration, time per iteration, cumulative time and
each worker's step-time distribution for the straggler scenario.

``--quick`` runs every mode, both scenarios and the RPC peer at width 128 once, with one seed, 8 steps and
5 ms of stand-in compute: it checks that the benchmark runs; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import machine_info, spawn_group  # noqa: E402

# The asynchronous modes scale each gradient's learning rate by 1 / (1 + staleness) (ps.staleness_scaling):
# with AdamW at this learning rate, unscaled gradients two versions stale stall training (a single-process
# replay of the server with staleness 2 reaches validation loss 0.75 after 90 updates, 0.26 scaled).
STALE = {"staleness_scaling": 1.0}
MODES = {"dp": {}, "ps-sync": {"mode": "sync"}, "ps-async": {"mode": "async", **STALE},
         "ps-ssp": {"mode": "ssp", "staleness": 2, **STALE}, "ps-backup": {"mode": "backup", "backup_workers": 1},
         "ps-dc": {"mode": "dc", "dc_lambda": 2.0, "dc_adaptive": True, **STALE}}
WORKERS, MICRO, SLOW_RANK, EVAL_EVERY = 3, 16, 2, 2
# --quick: the fewest steps that leave a timed step after the first two (which the summaries skip) and a few
# evaluations for the smoothed curve.
QUICK = {"seeds": 1, "steps": 8, "compute_ms": 5.0, "peer_repeats": 1, "peer_widths": [128]}


class Net(torch.nn.Module):
    """An MLP whose forward also waits ``compute_s`` (stand-in compute, see the module docstring)."""

    def __init__(self, compute_s: float, width: int = 128) -> None:
        super().__init__()
        self.compute_s = compute_s
        self.body = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.Tanh(), torch.nn.Linear(width, width),
                                        torch.nn.Tanh(), torch.nn.Linear(width, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compute_s > 0 and torch.is_grad_enabled():
            time.sleep(self.compute_s)
        return self.body(x)


def data(seed: int) -> tuple[torch.utils.data.Dataset, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + seed)
    teacher = torch.randn(32, 8, generator=g)
    x = torch.randn(8192 + 1024, 32, generator=g)
    y = torch.tanh(x @ teacher) + 0.05 * torch.randn(x.shape[0], 8, generator=g)
    return torch.utils.data.TensorDataset(x[:8192], y[:8192]), (x[8192:], y[8192:])


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


def run(name: str, seed: int, slow: bool, args: argparse.Namespace, run_dir: str) -> dict[str, Any]:
    """One configuration on this rank; returns this rank's record (servers: their statistics)."""
    import plait
    from plait.ps import ServerDone

    sections: dict[str, Any] = {
        "run": {"dir": run_dir}, "observe": {"progress": False, "trackers": []},
        "train": {"global_batch_size": WORKERS * MICRO, "micro_batch_size": MICRO, "seed": seed},
        "optim": {"lr": 0.01, "warmup_steps": 0, "grad_clip": 1.0},
        "fault": {"slow_rank": SLOW_RANK if slow else -1, "slow_factor": args.slow_factor if slow else 1.0}}
    if name != "dp":
        sections.update(parallel={"mode": "ps"}, ps={"servers": 1, **MODES[name]})
    p = plait.Plait(**sections)
    cpu0 = cpu_s()
    torch.manual_seed(seed)
    train, (vx, vy) = data(seed)
    try:
        model, _ = p.setup(Net(args.compute_ms / 1000, getattr(args, "width", 128)), loss_fn=mse)
    except ServerDone as e:
        return {"server": e.stats, "cpu_s": cpu_s() - cpu0}  # setup and serving
    loader = iter(p.setup_dataloader(train))
    p.barrier()
    t0, cpu0 = time.perf_counter(), cpu_s()
    curve, step_s, compute_s = [], [], []
    while p.steps < args.steps:
        ts = time.perf_counter()
        p.forward_backward(model, next(loader))
        info = p.step()
        step_s.append(time.perf_counter() - ts)
        compute_s.append(info.forward_s + info.backward_s)
        if p.rank == 0 and args.eval_every and info.step % args.eval_every == 0:
            with torch.no_grad():
                val = float(mse(model.body(vx), vy))
            version = sum(info.ps["ps_versions"]) if info.ps else info.step
            curve.append((time.perf_counter() - t0, info.step, version, val))
    end, cpu = time.perf_counter() - t0, cpu_s() - cpu0
    p.close()
    return {"curve": curve, "step_s": step_s, "compute_s": compute_s, "end_s": end, "cpu_s": cpu}


def cpu_s() -> float:
    """CPU seconds (user + system, every thread) this process has used."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def group(rank: int, world: int, names: list[str], seeds: list[int], scenarios: list[bool],
          args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for slow in scenarios:
            for seed in seeds:
                for name in names:
                    out[f"{name}|{int(slow)}|{seed}"] = run(name, seed, slow, args, f"{tmp}/{name}{int(slow)}{seed}")
    return out


def smoothed(curve: list[tuple]) -> list[tuple[float, int, int, float]]:
    """Moving average over 3 consecutive evaluations (time, step, version of the last one)."""
    vals = [c[3] for c in curve]
    return [(c[0], c[1], c[2], sum(vals[max(0, i - 2):i + 1]) / len(vals[max(0, i - 2):i + 1]))
            for i, c in enumerate(curve)]


def time_to(curve: list[tuple], target: float) -> float | None:
    for t, _, _, v in smoothed(curve):
        if v <= target:
            return t
    return None


def throughput(workers: list[dict[str, Any]]) -> float:
    """Samples all workers processed while rank 0 (a fast worker) trained, per second of that time."""
    horizon = workers[0]["end_s"]
    done = 0
    for w in workers:
        t = 0.0
        for s in w["step_s"]:
            t += s
            if t > horizon + 1e-9:
                break
            done += 1
    return done * MICRO / horizon


def summarize(runs: dict[str, Any], seeds: list[int], args: argparse.Namespace) -> dict[str, Any]:
    ref = smoothed(runs[f"dp|0|{seeds[0]}"][0]["curve"])
    target = ref[min(len(ref) - 1, int(0.6 * len(ref)))][3]
    result: dict[str, Any] = {"target_val_loss": round(target, 6), "scenarios": {}}
    for slow in (True, False):
        table = {}
        for name in MODES:
            ttt, thr, ups, step = [], [], [], []
            for seed in seeds:
                ranks = runs[f"{name}|{int(slow)}|{seed}"]
                workers = ranks[:WORKERS]
                wall = max(w["end_s"] for w in workers)
                ttt.append(time_to(workers[0]["curve"], target))
                thr.append(throughput(workers))
                updates = ranks[WORKERS]["server"]["updates"] if name != "dp" else args.steps
                ups.append(updates / wall)
                step.append(statistics.mean(workers[0]["step_s"][2:]))
            reached = [x for x in ttt if x is not None]
            table[name] = {
                "time_to_target_s": {"median": round(statistics.median(reached), 4) if len(reached) == len(seeds)
                                     else None, "min": round(min(reached), 4) if reached else None,
                                     "max": round(max(reached), 4) if reached else None, "reached": len(reached)},
                "samples_per_s": round(statistics.median(thr), 2), "updates_per_s": round(statistics.median(ups), 2),
                "rank0_step_s": round(statistics.median(step), 5)}
        result["scenarios"]["straggler" if slow else "no_straggler"] = table
    s, n = result["scenarios"]["straggler"], result["scenarios"]["no_straggler"]
    dp_t = s["dp"]["time_to_target_s"]["median"]
    asyncs = {m: s[m]["time_to_target_s"]["median"] for m in ("ps-async", "ps-ssp", "ps-dc", "ps-backup")}
    best = min(((t, m) for m, t in asyncs.items() if t is not None), default=(None, None))
    result["ratios"] = {
        "straggler_dp_time_to_target_over_best_async": round(dp_t / best[0], 3) if dp_t and best[0] else None,
        "best_async_mode": best[1],
        "no_straggler_ps_sync_step_over_dp_step": round(n["ps-sync"]["rank0_step_s"] / n["dp"]["rank0_step_s"], 3),
        "straggler_throughput_async_over_dp": round(s["ps-async"]["samples_per_s"] / s["dp"]["samples_per_s"], 3)}
    result["backup_order_statistic"] = {sc: backup_prediction(runs, seeds, slow, args)
                                        for sc, slow in (("straggler", True), ("no_straggler", False))}
    return result


def backup_prediction(runs: dict[str, Any], seeds: list[int], slow: bool, args: argparse.Namespace) -> dict:
    """Measured mean step time of a fast worker under backup (each step waits for a version) against
    E[(N-b)-th smallest worker compute time] + the sync run's mean overhead (its step time minus the slowest
    worker's compute in that step)."""
    measured, predicted = [], []
    k = WORKERS - MODES["ps-backup"]["backup_workers"]
    for seed in seeds:
        b = runs[f"ps-backup|{int(slow)}|{seed}"]
        sync = runs[f"ps-sync|{int(slow)}|{seed}"]
        n = min(len(w["compute_s"]) for w in sync[:WORKERS])
        overhead = statistics.mean(sync[0]["step_s"][i] - max(w["compute_s"][i] for w in sync[:WORKERS])
                                   for i in range(2, n))
        m = min(len(w["compute_s"]) for w in b[:WORKERS])
        order = [sorted(w["compute_s"][i] for w in b[:WORKERS])[k - 1] for i in range(2, m)]
        predicted.append(statistics.mean(order) + overhead)
        measured.append(statistics.mean(b[0]["step_s"][2:]))  # rank 0 (a fast worker) waits for each version
    return {"measured_s": round(statistics.median(measured), 5), "predicted_s": round(statistics.median(predicted), 5),
            "measured_over_predicted": round(statistics.median(measured) / statistics.median(predicted), 3)}


def plot(runs: dict[str, Any], seed: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    for name in MODES:
        ranks = runs[f"{name}|1|{seed}"]
        curve = ranks[0]["curve"]
        ax[0, 0].plot([c[2] for c in curve], [c[3] for c in curve], label=name)
        steps = ranks[0]["step_s"]
        ax[0, 1].plot(range(1, len(steps) + 1), steps, label=name)
        cum = [sum(steps[:i + 1]) for i in range(len(steps))]
        ax[1, 0].plot(range(1, len(cum) + 1), cum, label=name)
    names = ["dp", "ps-sync", "ps-async", "ps-backup"]
    data_ = [runs[f"{n}|1|{seed}"][w]["step_s"] for n in names for w in range(WORKERS)]
    ax[1, 1].boxplot(data_, showfliers=False)
    ax[1, 1].set_xticks(range(1, len(data_) + 1), [f"{n}\nw{w}" for n in names for w in range(WORKERS)], fontsize=6)
    titles = ("validation loss vs iteration (server version / DP step)", "rank 0 time per iteration (s)",
              "rank 0 cumulative time (s)", "per-worker step time (s)")
    for a, t in zip(ax.flat, titles, strict=True):
        a.set_title(t, fontsize=9)
    ax[0, 0].set_yscale("log")
    ax[0, 0].legend(fontsize=7)
    fig.suptitle(f"plait parameter server vs all-reduce DP, worker {SLOW_RANK} {runs['_slow_factor']}x slower")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def rpc_model(compute_s: float, width: int = 128) -> torch.nn.Module:
    torch.manual_seed(0)
    return Net(compute_s, width)


def rpc_data() -> torch.utils.data.Dataset:
    return data(0)[0]


def peer(args: argparse.Namespace) -> dict[str, Any]:
    """Updates per second of plait's async parameter server against PyTorch's RPC parameter server (its
    official batch-update example with batch_update_size 1: asynchronous), 3 workers, no straggler, at the
    benchmark's compute per step and at none (transport and server overhead alone), for each hidden width of
    ``--peer-widths`` (the MLP has about width^2 + 40 width parameters: 21K at 128, 1.1M at 1024, 4.3M at
    2048; the benchmark's own model is width 128).

    Measured alike on both sides: updates applied by the server (3 x steps: every gradient) over the
    slowest worker's time in its training loop (forward, backward, push, parameters back; no evaluation:
    the peer has none, so plait's rank 0 skips its held-out evaluation here). plait's loop is the whole
    ``Plait.step`` (its step metrics, progress file and rank 0's periodic server statistics included).
    ``--peer-repeats`` pairs run alternately (plait, then the peer) so that the load of a shared machine
    falls on both alike; each pair's ratio and the median are reported. At ``compute`` ms per step the
    ratio cannot exceed ``(compute + peer overhead) / compute`` whatever plait's overhead: reported as
    ``ratio_bound_at_zero_plait_overhead``. ``cpu_ms_per_update``: CPU time of every rank (workers: their
    loop; server: its setup and serving) per update, the cost that becomes time where cores are scarce."""
    import functools

    from _ps_rpc_peer import run_rpc

    from plait.runtime.spawn import free_port

    out = {}
    for width, compute in [(w, c) for w in args.peer_widths for c in (args.compute_ms, 0.0)]:
        a = argparse.Namespace(**{**vars(args), "compute_ms": compute, "eval_every": 0, "width": width})
        plait_ups, rpc_ups, rpc_step, plait_cpu, rpc_cpu = [], [], [], [], []
        for _ in range(args.peer_repeats):
            ranks = spawn_group(group, WORKERS + 1, ["ps-async"], [0], [False], a, name="plait async",
                                timeout_s=1800)
            plait_wall = max(r["ps-async|0|0"]["end_s"] for r in ranks[:WORKERS])
            updates = ranks[WORKERS]["ps-async|0|0"]["server"]["updates"]
            plait_ups.append(updates / plait_wall)
            plait_cpu.append(sum(r["ps-async|0|0"]["cpu_s"] for r in ranks) / updates)
            rpc_ranks = spawn_group(run_rpc, WORKERS + 1, free_port(), functools.partial(rpc_model, compute / 1000,
                                                                                          width),
                                    rpc_data, mse, args.steps, MICRO, 0.01, name="rpc peer", timeout_s=1800)
            rpc_wall = max(r["end_s"] for r in rpc_ranks[:WORKERS])
            rpc_ups.append(WORKERS * args.steps / rpc_wall)
            rpc_cpu.append(sum(r["cpu_s"] for r in rpc_ranks) / (WORKERS * args.steps))
            rpc_step.append(rpc_wall / args.steps)
        ratios = [p / r for p, r in zip(plait_ups, rpc_ups, strict=True)]
        bound = statistics.median(rpc_step) / (compute / 1000) if compute > 0 else None
        out[f"width_{width}_compute_{compute:g}ms"] = {
            "params": sum(p.numel() for p in Net(0.0, width).parameters()),
            "plait_async_updates_per_s": [round(x, 2) for x in plait_ups],
            "rpc_peer_updates_per_s": [round(x, 2) for x in rpc_ups],
            "plait_over_rpc_per_pair": [round(x, 3) for x in ratios],
            "plait_over_rpc": round(statistics.median(ratios), 3),
            "ratio_bound_at_zero_plait_overhead": round(bound, 3) if bound else None,
            "cpu_ms_per_update": {"plait": round(1e3 * statistics.median(plait_cpu), 3),
                                  "rpc_peer": round(1e3 * statistics.median(rpc_cpu), 3)}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="every mode and scenario once, 1 seed, 8 steps, RPC peer at width 128: checks that it runs")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--compute-ms", type=float, default=20.0)
    ap.add_argument("--slow-factor", type=float, default=4.0)
    ap.add_argument("--out", default="")
    ap.add_argument("--png", default="")
    ap.add_argument("--no-peer", action="store_true", help="leave out the RPC parameter-server peer")
    ap.add_argument("--peer-only", action="store_true", help="only the RPC parameter-server peer comparison")
    ap.add_argument("--peer-repeats", type=int, default=3, help="alternating plait/peer pairs per compute level")
    ap.add_argument("--peer-widths", type=int, nargs="+", default=[128, 1024],
                    help="hidden widths of the MLP for the RPC comparison (128: the benchmark's model)")
    ap.add_argument("--eval-every", type=int, default=EVAL_EVERY, help="rank 0 evaluates every this many steps")
    if ap.parse_args().quick:
        ap.set_defaults(**QUICK)  # the quick sizes, under any flag given explicitly
    args = ap.parse_args()
    if args.peer_only:
        print(json.dumps({"rpc_peer": peer(args), "steps_per_worker": args.steps, **machine_info()}, indent=1))
        return
    seeds = list(range(args.seeds))
    t0 = time.perf_counter()
    runs: dict[str, Any] = {}
    dp = spawn_group(group, WORKERS, ["dp"], seeds, [True, False], args, name="dp", timeout_s=3600)
    ps = spawn_group(group, WORKERS + 1, [m for m in MODES if m != "dp"], seeds, [True, False], args, name="ps",
                     timeout_s=3600)
    for key in dp[0]:
        runs[key] = [r[key] for r in dp]
    for key in ps[0]:
        runs[key] = [r[key] for r in ps]
    out = {"benchmark": "parameter server vs all-reduce data parallelism", **machine_info(),
           "workers": WORKERS, "servers": 1, "micro_batch": MICRO, "steps_per_worker": args.steps,
           "quick": args.quick, "seeds": args.seeds, "compute_ms": args.compute_ms, "slow_rank": SLOW_RANK,
           "slow_factor": args.slow_factor, **summarize(runs, seeds, args),
           "rpc_peer": None if args.no_peer else peer(args),
           "bench_wall_s": round(time.perf_counter() - t0, 1)}
    if args.png:
        runs["_slow_factor"] = args.slow_factor
        plot(runs, seeds[0], args.png)
        out["png"] = args.png
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
