"""plait's data-parallel reducer against PyTorch DDP, side by side in one run, 2 gloo ranks.

For each config, three trainers are built from the same weights and data: plait's reducer, DDP, and
a compute-only twin (no gradient communication at all). Steps are interleaved in rounds so that
machine noise hits all three alike; the median step time of each is reported. The exposed-
communication fraction of an implementation is (its step time - compute-only step time) / its step
time, the same measurement for both. Prints JSON; ``ratio`` = plait step time / DDP step time.

    python bench/dp.py [--rounds 6] [--steps-per-round 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import _common
import torch.distributed as dist

CONFIGS = {
    # Compute-bound: the default GPT, 16 sequences of 128 tokens per rank per step.
    "compute_bound": ["--model.n_layer=4", "--model.d_model=128", "--model.n_head=4", "--model.seq_len=128",
                      "--train.global_batch_size=32", "--train.micro_batch_size=16"],
    # Communication-heavy: ~25M parameters (100 MB of fp32 gradients), one short sequence per rank.
    "comm_heavy": ["--model.n_layer=8", "--model.d_model=512", "--model.n_head=8", "--model.seq_len=32",
                   "--train.global_batch_size=2", "--train.micro_batch_size=1"],
}


def _trainers(name: str, overrides: list[str], root: str) -> dict:
    from plait.parallel.data.reducer import LocalGrads

    out = {}
    for impl in ("plait", "torch", "compute_only"):
        t = _common.make_trainer(overrides + [f"--parallel.impl={'torch' if impl == 'torch' else 'plait'}"],
                                 Path(root, f"{name}-{impl}"), 2)
        if impl == "compute_only":
            t.layout.policy.engine.require_sync = False  # its hooks never launch a collective
            t.layout.policy.engine = LocalGrads(t.model)
        out[impl] = t
    return out


def _bench_config(name: str, overrides: list[str], rounds: int, per_round: int, root: str) -> dict:
    trainers = _trainers(name, overrides, root)
    times: dict[str, list[float]] = {k: [] for k in trainers}
    exposed: list[float] = []
    for t in trainers.values():  # warm-up: allocations, first-touch, DDP's bucket rebuild
        for _ in range(2):
            t.train_step()
    for _ in range(rounds):
        for impl, t in trainers.items():
            for _ in range(per_round):
                dist.barrier()
                rec = t.train_step()
                times[impl].append(rec["step_s"])
                if impl == "plait":
                    exposed.append(rec["comm_exposed_s"])
    med = {k: statistics.median(v) for k, v in times.items()}
    t0 = trainers["plait"]
    return {
        "config": " ".join(overrides), "num_params": t0.num_params,
        "grad_bytes": t0.num_params * 4, "buckets": len(t0.layout.policy.engine.buckets),
        "plait_step_s": med["plait"], "ddp_step_s": med["torch"], "compute_only_step_s": med["compute_only"],
        "ratio_plait_over_ddp": med["plait"] / med["torch"],
        "plait_exposed_comm_fraction": max(0.0, med["plait"] - med["compute_only"]) / med["plait"],
        "ddp_exposed_comm_fraction": max(0.0, med["torch"] - med["compute_only"]) / med["torch"],
        "plait_measured_wait_fraction": statistics.median(exposed) / med["plait"],
        "samples_per_impl": len(times["plait"]),
    }


def _worker(rank: int, world: int, args: argparse.Namespace, root: str) -> dict:
    return {name: _bench_config(name, ov, args.rounds, args.steps_per_round, root)
            for name, ov in CONFIGS.items() if not args.only or name == args.only}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps-per-round", type=int, default=3)
    ap.add_argument("--only", choices=list(CONFIGS))
    ap.add_argument("--quick", action="store_true", help="2 rounds of 1 step: checks that it runs")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps_per_round = 2, 1
    with tempfile.TemporaryDirectory() as root:
        results = _common.spawn_group(_worker, 2, args, root, name="dp bench", timeout_s=3600)[0]
    print(json.dumps({"bench": "dp", "world_size": 2, **_common.machine_info(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
