"""Bus bandwidth of plait's all-reduce algorithms against the backend's, on 2 and 4 gloo ranks.

Definitions (as in nccl-tests): ``algbw = bytes / time`` and ``busbw = algbw * 2 (n-1) / n``, with
``time`` the slowest rank's mean time per all-reduce. ``vs_backend`` is the algorithm's busbw
divided by the backend's at the same size (above 1: faster). Also measures the per-call overhead
of ``CollectiveGuard`` around a one-element all-reduce.

    python bench/comm.py [--quick] [--worlds 2,4] [--out results.json]

Spawns its own ranks (torch.multiprocessing, gloo over 127.0.0.1, one thread per rank) and prints
one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from plait.comm.algorithms import get_allreduce  # noqa: E402
from plait.comm.guard import CollectiveGuard  # noqa: E402
from plait.runtime.spawn import spawn_ranks  # noqa: E402

ALGOS = ("backend", "ring", "halving_doubling", "hierarchical")


def _sizes(quick: bool) -> list[int]:
    top = 1 << 20 if quick else 64 << 20
    sizes, s = [], 4 << 10
    while s <= top:
        sizes.append(s)
        s *= 4
    return sizes


def _iters(nbytes: int, quick: bool) -> int:
    budget = (4 << 20) if quick else (128 << 20)  # bytes reduced per (algorithm, size)
    return max(2, min(30 if quick else 50, budget // nbytes))


def _time_one(fn, t: torch.Tensor, iters: int) -> float:
    """Slowest rank's mean seconds per all-reduce of ``t``."""
    fn(t, None)  # warm-up: connections, buffers
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn(t, None)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _guard_overhead(rank: int, calls: int = 200) -> dict[str, float]:
    """Mean microseconds per one-element all-reduce: bare, and guarded with async/sync marks."""
    store = dist.distributed_c10d._get_default_store()
    guards = {"guarded_async": CollectiveGuard(store, 60.0, rank, prefix="bench/a"),
              "guarded_sync": CollectiveGuard(store, 60.0, rank, prefix="bench/s", async_marks=False)}
    t = torch.ones(1)
    times = {}
    for label in ("bare", "guarded_async", "guarded_sync", "bare_again"):
        dist.barrier()
        start = time.perf_counter()
        for step in range(calls):
            if label in guards:
                guards[label].run("bench", None, step, lambda: dist.all_reduce(t, async_op=True))
            else:
                dist.all_reduce(t, async_op=True).wait()
        times[label] = (time.perf_counter() - start) / calls * 1e6
    for g in guards.values():
        g.close()
    bare = min(times["bare"], times["bare_again"])
    out = {"bare_us": round(bare, 1)}
    for label in guards:
        out[f"{label}_us"] = round(times[label], 1)
        out[f"{label}_overhead_us"] = round(times[label] - bare, 1)
    return out


def _worker(rank: int, n: int, quick: bool) -> dict:
    ranks_per_node = max(1, n // 2)
    fns = {a: get_allreduce(a, **({"ranks_per_node": ranks_per_node} if a == "hierarchical" else {}))
           for a in ALGOS}
    rows = []
    for nbytes in _sizes(quick):
        t = torch.randn(nbytes // 4)
        iters = _iters(nbytes, quick)
        secs = {a: _time_one(fns[a], t, iters) for a in ALGOS}
        for a in ALGOS:
            algbw = nbytes / secs[a]
            rows.append({
                "algo": a, "bytes": nbytes, "iters": iters, "time_us": round(secs[a] * 1e6, 1),
                "algbw_GBps": round(algbw / 1e9, 4), "busbw_GBps": round(algbw * 2 * (n - 1) / n / 1e9, 4),
                "vs_backend": round(secs["backend"] / secs[a], 3),
            })
    guard = _guard_overhead(rank)
    return {"world_size": n, "hierarchical_ranks_per_node": ranks_per_node, "rows": rows, "guard": guard}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="sizes 4 KB to 1 MB, fewer iterations")
    ap.add_argument("--worlds", default="2,4", help="comma-separated world sizes (default 2,4)")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()
    report = {"torch": torch.__version__, "backend": "gloo", "cpus": os.cpu_count(),
              "quick": args.quick, "worlds": []}
    for n in (int(w) for w in args.worlds.split(",")):
        report["worlds"].append(spawn_ranks(_worker, n, args.quick, timeout_s=3600, pg_timeout_s=600,
                                            name=f"comm bench at world {n}")[0])
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
