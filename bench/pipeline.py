"""Pipeline benchmark: measured bubble against theory; plait's balanced split against plain PyTorch.

Runs gloo ranks on CPU (one thread each) and prints one JSON document:
* ``bubble``: for p in (2, 4) and m in (1, 2, 4, 8, 16), GPipe on a GPT with identical blocks: each
  rank's measured idle fraction (mean over ranks, last of ``--steps`` steps) and (p-1)/(m+p-1).
* ``partition``: p=2, 1F1B, m=4, a GPT whose norm + head + loss costs several blocks (large
  vocabulary). Three pipelines from the same weights, stepped in interleaved rounds (median step time
  of the slower rank): plait's runner with the split balanced by measured per-layer cost; plait's
  runner with equal blocks per stage; and the same schedule driven directly through
  ``torch.distributed.pipelining`` (``PipelineStage`` + ``Schedule1F1B``) on count-balanced stages
  built here in plain PyTorch, no plait code. ``speedup_over_torch`` = torch step time / plait step
  time. The first step's loss of each, and the largest gradient difference between the two count-
  balanced pipelines, show that they compute the same thing.

    PYTHONPATH=src python bench/pipeline.py [--steps 3] [--rounds 5] [--only bubble|partition] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from plait.config import ModelConfig
from plait.models.gpt import GPT
from plait.models.tiny import token_batches
from plait.parallel.pipeline.runner import LayerCosts, build_pipeline, measure_layer_costs
from plait.runtime.spawn import spawn_ranks

MICROBATCHES = (1, 2, 4, 8, 16)
# Norm + head + loss over an 8k vocabulary cost about five blocks: count-balanced stages leave the last
# rank with the head and as many blocks as the first, so the first rank waits on it.
HEAVY = ModelConfig(n_layer=8, d_model=128, n_head=4, seq_len=64, vocab_size=8192)
HEAVY_QUICK = ModelConfig(n_layer=4, d_model=64, n_head=4, seq_len=32, vocab_size=4096)
PART_M, PART_BATCH = 4, 8


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


class TorchStage(nn.Module):
    """Plain-PyTorch stage of the GPT for the baseline: embedding on the first, norm + head on the
    last (an untied copy of the embedding table, its gradient summed with the first stage's after
    backward, as any pipeline over a tied model must), equal numbers of blocks on every stage."""

    def __init__(self, model: GPT, rank: int, world: int) -> None:
        super().__init__()
        n = len(model.blocks)
        per = n // world
        self.first, self.last = rank == 0, rank == world - 1
        self.block_ids = list(range(rank * per, n if self.last else (rank + 1) * per))
        self.tok_emb = model.tok_emb if self.first else None
        self.pos_emb = model.pos_emb if self.first else None
        self.blocks = nn.ModuleList(model.blocks[i] for i in self.block_ids)
        self.ln_f = model.ln_f if self.last else None
        self.head = nn.Linear(model.cfg.d_model, model.cfg.vocab_size, bias=False) if self.last else None
        if self.last:
            self.head.weight = nn.Parameter(model.tok_emb.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:  # token ids (B, T)
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.size(1)))  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        return self.head(self.ln_f(x)) if self.last else x  # (B, T, V) on the last stage


def _ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def _torch_pipeline(cfg: ModelConfig, tie_group) -> tuple[Callable, list[nn.Parameter], list[int]]:
    """The baseline: a step function over ``PipelineStage`` + ``Schedule1F1B``, its parameters, blocks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    full = GPT(cfg)
    module = TorchStage(full, rank, world)
    stage = PipelineStage(module, rank, world, torch.device("cpu"), group=dist.group.WORLD)
    schedule = Schedule1F1B(stage, PART_M, loss_fn=_ce)
    table = module.tok_emb.weight if module.first else module.head.weight if module.last else None

    def step(idx: torch.Tensor, targets: torch.Tensor) -> float | None:
        losses: list[torch.Tensor] = []
        if module.first:
            schedule.step(idx)
        else:
            schedule.step(target=targets, losses=losses)
        # The tied table's two gradients are summed on their own group (point-to-point sends of
        # the schedule may still be in flight on the world group).
        grad = table.grad if table is not None else torch.zeros(cfg.vocab_size, cfg.d_model)
        dist.all_reduce(grad, group=tie_group)
        return torch.stack(losses).mean().item() if losses else None

    return step, list(module.parameters()), module.block_ids


def _plait_pipeline(cfg: ModelConfig, costs: LayerCosts | None) -> tuple[Callable, list[nn.Parameter], list[int]]:
    torch.manual_seed(0)
    runner = build_pipeline(GPT(cfg), dist.group.WORLD, schedule="1f1b", microbatches=PART_M, costs=costs)

    def step(idx: torch.Tensor, targets: torch.Tensor) -> float | None:
        loss = runner.step(idx, targets)
        return None if loss is None else loss.item()

    return step, runner.parameters(), [int(k) for mod in runner.modules for k in mod.blocks]


def _partition(cfg: ModelConfig, rounds: int, per_round: int) -> dict:
    """The three p=2 1F1B pipelines stepped in interleaved rounds; this rank's view."""
    sample = torch.randint(0, cfg.vocab_size, (PART_BATCH // PART_M, cfg.seq_len),
                           generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    costs = measure_layer_costs(GPT(cfg), sample, sample, repeats=3)
    tie_group = dist.new_group(list(range(dist.get_world_size())))
    pipes = {"plait_cost_balanced": _plait_pipeline(cfg, costs),
             "plait_count_balanced": _plait_pipeline(cfg, None),
             "torch_count_balanced": _torch_pipeline(cfg, tie_group)}
    idx, tgt = token_batches(1, PART_BATCH, cfg.seq_len, cfg.vocab_size, seed=1)[0]
    first_loss, times = {}, {name: [] for name in pipes}
    for name, (step, _, _) in pipes.items():  # warm-up; same weights and data, so same loss
        first_loss[name] = step(idx, tgt)
    # The baseline must do the same work: same split, so the same gradients (in the same order).
    pairs = zip(pipes["plait_count_balanced"][1], pipes["torch_count_balanced"][1], strict=True)
    diff = torch.tensor([max((a.grad - b.grad).abs().max().item() for a, b in pairs)])
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    for _, params, _ in pipes.values():
        for p in params:
            p.grad = None
    for _ in range(rounds):
        for name, (step, params, _) in pipes.items():
            for _ in range(per_round):
                dist.barrier()
                start = time.perf_counter()
                step(idx, tgt)
                times[name].append(time.perf_counter() - start)
                for p in params:
                    p.grad = None
    out: dict = {"first_step_loss": first_loss, "grad_max_abs_diff_torch_vs_plait_count": diff.item(),
                 "measured_costs_ms": {"embed": round(costs.embed * 1e3, 3),
                                       "blocks": [round(c * 1e3, 3) for c in costs.blocks],
                                       "head": round(costs.head * 1e3, 3)}}
    for name, (_, _, blocks) in pipes.items():
        slowest = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a pipeline step lasts as long as its slowest rank
        out[name] = {"step_s": round(statistics.median(slowest.tolist()), 4), "blocks_on_rank": blocks}
    return out


def _worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    out: dict = {"bubble": [], "partition": {}}
    cfg = ModelConfig(n_layer=8, d_model=128, n_head=4, seq_len=64, vocab_size=256)
    for m in args.microbatches if args.only != "partition" else ():
        runner, _ = _run(cfg, "gpipe", m, batch=m * 2, steps=args.steps, costs=None)
        out["bubble"].append(runner.local_summary())
    if world == 2 and args.only != "bubble":
        out["partition"] = _partition(HEAVY_QUICK if args.quick else HEAVY, args.rounds, args.steps_per_round)
    return out


def _launch(world: int, args: argparse.Namespace) -> list[dict]:
    return spawn_ranks(_worker, world, args, timeout_s=1200, pg_timeout_s=300, name=f"pipeline bench at world {world}")


def _partition_report(ranks: list[dict], quick: bool) -> dict:
    last = ranks[-1]["partition"]  # the last stage holds the losses
    cfg = HEAVY_QUICK if quick else HEAVY
    names = ("plait_cost_balanced", "plait_count_balanced", "torch_count_balanced")
    report = {"schedule": "1f1b", "p": 2, "m": PART_M, "batch": PART_BATCH,
              "model": {k: getattr(cfg, k) for k in ("n_layer", "d_model", "n_head", "seq_len", "vocab_size")},
              "measured_costs_ms": ranks[0]["partition"]["measured_costs_ms"],
              "first_step_loss": last["first_step_loss"],
              "grad_max_abs_diff_torch_vs_plait_count": last["grad_max_abs_diff_torch_vs_plait_count"]}
    costs = report["measured_costs_ms"]
    for name in names:
        blocks = [r["partition"][name]["blocks_on_rank"] for r in ranks]
        # What the split predicts: each rank's summed measured cost; the largest paces the pipeline.
        stage_ms = [sum(costs["blocks"][b] for b in own) for own in blocks]
        stage_ms[0] += costs["embed"]
        stage_ms[-1] += costs["head"]
        report[name] = {"step_s": ranks[0]["partition"][name]["step_s"], "blocks_per_rank": blocks,
                        "stage_cost_ms": [round(c, 3) for c in stage_ms]}
    torch_s = report["torch_count_balanced"]["step_s"]
    report["speedup_over_torch"] = {name: round(torch_s / report[name]["step_s"], 3) for name in names[:2]}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps per bubble measurement")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the partition comparison")
    parser.add_argument("--steps-per-round", type=int, default=2)
    parser.add_argument("--only", choices=("bubble", "partition"), help="run one of the two parts")
    parser.add_argument("--quick", action="store_true", help="m in (1, 4), a small model, 2 rounds: checks it runs")
    args = parser.parse_args()
    args.microbatches = (1, 4) if args.quick else MICROBATCHES
    if args.quick:
        args.steps, args.rounds, args.steps_per_round = 2, 2, 1
    report: dict = {"bubble": [], "partition": {},
                    "note": "CPU gloo ranks, one thread each; timings from a shared 2-core machine"}
    for world in (2, 4) if args.only != "partition" else (2,):
        ranks = _launch(world, args)
        for i, m in enumerate(args.microbatches if args.only != "partition" else ()):
            rows = [r["bubble"][i] for r in ranks]
            report["bubble"].append({
                "p": world, "m": m, "bubble_theory": rows[0]["bubble_theory"],
                "bubble_measured_mean": round(statistics.mean(r["bubble_measured"] for r in rows), 4),
                "bubble_measured_per_rank": [r["bubble_measured"] for r in rows]})
        if world == 2 and args.only != "bubble":
            report["partition"] = _partition_report(ranks, args.quick)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
