"""Pipeline benchmark: measured bubble against theory, and cost-balanced against count-balanced stages.

Runs gloo ranks on CPU and prints one JSON document:
* ``bubble``: for p in (2, 4) and m in (1, 2, 4, 8, 16), GPipe on a GPT with identical blocks: each
  rank's measured idle fraction (mean over ranks, last of ``--steps`` steps) and (p-1)/(m+p-1).
* ``partition``: p=2, 1F1B, a GPT whose head + loss is expensive (large vocabulary): mean step time
  with plait's cost-balanced split against the same schedule with count-balanced stages.

    PYTHONPATH=src python bench/pipeline.py [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from plait.config import ModelConfig
from plait.models.gpt import GPT
from plait.parallel.pipeline import LayerCosts, build_pipeline, measure_layer_costs


def _run(cfg: ModelConfig, schedule: str, m: int, batch: int, steps: int, costs: LayerCosts | None):
    torch.manual_seed(0)
    runner = build_pipeline(GPT(cfg), dist.group.WORLD, schedule=schedule, microbatches=m, costs=costs)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        runner.step(idx, idx)
        times.append(time.perf_counter() - start)
        for p in runner.parameters():
            p.grad = None
    return runner, statistics.median(times[1:] or times)


def _worker(rank: int, world: int, port: int, steps: int, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    out: dict = {"bubble": [], "partition": {}}
    cfg = ModelConfig(n_layer=8, d_model=32, n_head=4, seq_len=32, vocab_size=256)
    for m in (1, 2, 4, 8, 16):
        runner, _ = _run(cfg, "gpipe", m, batch=m * 2, steps=steps, costs=None)
        out["bubble"].append(runner.local_summary())
    heavy = ModelConfig(n_layer=8, d_model=64, n_head=4, seq_len=64, vocab_size=16384)
    if world == 2:
        torch.manual_seed(0)
        sample = torch.randint(0, heavy.vocab_size, (2, heavy.seq_len))
        costs = measure_layer_costs(GPT(heavy), sample, sample, repeats=2)
        for name, c in (("count_balanced", None), ("cost_balanced", costs)):
            runner, step_s = _run(heavy, "1f1b", 4, batch=8, steps=steps, costs=c)
            blocks = [int(k) for mod in runner.modules for k in mod.blocks]
            out["partition"][name] = {"step_s": round(step_s, 4), "blocks_on_rank": blocks}
        out["partition"]["measured_costs_ms"] = {"embed": round(costs.embed * 1e3, 3),
                                                 "blocks": [round(c * 1e3, 3) for c in costs.blocks],
                                                 "head": round(costs.head * 1e3, 3)}
    queue.put((rank, out))
    dist.destroy_process_group()


def _launch(world: int, steps: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, steps, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=1200) for _ in procs)
    for p in procs:
        p.join()
    return [results[r] for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    report: dict = {"bubble": [], "partition": {}, "note": "CPU gloo ranks; timings from a shared machine"}
    for world in (2, 4):
        ranks = _launch(world, args.steps)
        for i, m in enumerate((1, 2, 4, 8, 16)):
            rows = [r["bubble"][i] for r in ranks]
            report["bubble"].append({
                "p": world, "m": m, "bubble_theory": rows[0]["bubble_theory"],
                "bubble_measured_mean": round(statistics.mean(r["bubble_measured"] for r in rows), 4),
                "bubble_measured_per_rank": [r["bubble_measured"] for r in rows]})
        if world == 2:
            report["partition"] = {
                "schedule": "1f1b", "p": 2, "m": 4,
                **{k: v for k, v in ranks[0]["partition"].items() if k == "measured_costs_ms"},
                **{name: {"step_s": ranks[0]["partition"][name]["step_s"],
                          "blocks_per_rank": [r["partition"][name]["blocks_on_rank"] for r in ranks]}
                   for name in ("count_balanced", "cost_balanced")}}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
