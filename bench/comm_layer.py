"""Per-collective overhead of plait's comm layer (``Comm``: counting, hang guard, comm thread).

Times a small all-reduce (``--numel`` fp32 elements, default 1) on 2 gloo ranks, mean microseconds
per call over ``--calls`` calls, slowest rank:

- ``bare``: ``dist.all_reduce`` directly;
- ``comm``: ``Comm.all_reduce_sum`` without a guard (counting only);
- ``comm_guarded``: with the ``CollectiveGuard`` the trainer installs (store marks on a thread);
- ``comm_thread_ring_guarded``: ``comm.allreduce=ring``, which runs on the comm thread, guarded;
- ``ring_direct``: the same ring algorithm called directly (the thread's own cost is the difference).

    python bench/comm_layer.py [--quick] [--calls 500] [--numel 1]

``--quick`` times 20 calls of each (every variant still runs): checks that it runs, the figures are noise.

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from plait.comm.algorithms import ring_all_reduce  # noqa: E402
from plait.comm.collectives import Comm  # noqa: E402
from plait.comm.guard import CollectiveGuard  # noqa: E402
from plait.runtime.spawn import spawn_ranks  # noqa: E402

QUICK_CALLS = 20


def _time(fn, calls: int) -> float:
    for _ in range(min(10, calls)):
        fn()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def _worker(rank: int, world: int, calls: int, numel: int) -> dict:
    store = dist.distributed_c10d._get_default_store()
    t = torch.ones(numel)
    plain = Comm()
    guarded = Comm(guard=CollectiveGuard(store, 60.0, rank, prefix="bench/g"))
    ring = Comm("ring", guard=CollectiveGuard(store, 60.0, rank, prefix="bench/r"))
    res = {
        "bare": _time(lambda: dist.all_reduce(t), calls),
        "comm": _time(lambda: plain.all_reduce_sum(t, None), calls),
        "comm_guarded": _time(lambda: guarded.all_reduce_sum(t, None), calls),
        "ring_direct": _time(lambda: ring_all_reduce(t, None), calls),
        "comm_thread_ring_guarded": _time(lambda: ring.all_reduce_sum(t, None), calls),
    }
    slowest = torch.tensor(list(res.values()), dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    for c in (plain, guarded, ring):
        c.close()
    return dict(zip(res, [round(v, 1) for v in slowest.tolist()], strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_CALLS} calls per variant: checks that it runs")
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--numel", type=int, default=1)
    if ap.parse_args().quick:
        ap.set_defaults(calls=QUICK_CALLS)  # --calls given explicitly still wins
    args = ap.parse_args()
    us = spawn_ranks(_worker, 2, args.calls, args.numel, timeout_s=600, pg_timeout_s=120, name="comm layer bench")[0]
    overhead = {"comm": us["comm"] - us["bare"], "comm_guarded": us["comm_guarded"] - us["bare"],
                "comm_thread_ring_guarded": us["comm_thread_ring_guarded"] - us["ring_direct"]}
    report = {"world": 2, "numel": args.numel, "calls": args.calls, "quick": args.quick, "mean_us_per_call": us,
              "overhead_us": {k: round(v, 1) for k, v in overhead.items()}}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
