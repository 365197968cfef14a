"""PyTorch DDP peer for bench/compress.py: plait's model, data, optimizer and schedule under plain DDP or
DDP with ``powerSGD_hook``, writing ``metrics.jsonl`` in the format plait's trainer writes.

Run one process per rank under torchrun; the ``--section.key=value`` overrides are plait's own, so the
model, batch, learning-rate schedule, evaluation set and evaluation interval match a ``plait train`` run
with the same overrides. ``comm_bytes`` is not measured by DDP; it is computed per step as the bytes one
rank sends in a bandwidth-optimal all-reduce (2 (n - 1) / n of the buffer) of the elements DDP reduced:
all gradient elements for plain DDP and for the hook's vanilla warm-up steps, and afterwards the hook's
own count of compressed elements (P and Q factors plus the tensors it leaves uncompressed).

With ``--hook=powersgd`` the whole model is one DDP bucket: ``powerSGD_hook`` on gloo is not safe with
several buckets (its callbacks issue collectives from gloo's worker threads and wait on them there;
ranks then disagree on the collectives' order and gloo aborts or hangs after the vanilla warm-up steps).
The cost is that DDP+PowerSGD communicates only after backward, not overlapped with it.

    torchrun ... bench/_ddp_peer.py --hook=none|powersgd [--start-iter=2] --run.dir=DIR [--section.key=value ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from plait.comm.collectives import ring_allreduce_bytes
from plait.components.optim import build_optimizer, lr_at
from plait.data.corpus import load_splits
from plait.data.sampler import WindowSampler, validation_batches
from plait.models.gpt import GPT
from plait.recipes import load_recipe_config
from plait.recipes import validate_config as validate


def _hook_state(ddp: DistributedDataParallel, hook: str, rank: int, start_iter: int):
    """Register the communication hook; returns the PowerSGD state (None for plain DDP)."""
    if hook == "none":
        return None
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                               start_powerSGD_iter=start_iter, use_error_feedback=True, warm_start=True)
    ddp.register_comm_hook(state, psgd.powerSGD_hook)
    return state


@torch.no_grad()
def _evaluate(ddp: DistributedDataParallel, batches: list) -> float:
    """Mean per-sequence validation loss over the fixed set, summed over ranks (as plait's trainer does)."""
    ddp.module.eval()
    acc = torch.zeros(2, dtype=torch.float64)  # (sum of per-sequence mean losses, sequences)
    for x, y in batches:
        acc[0] += float(ddp.module(x, y)) * len(x)
        acc[1] += len(x)
    ddp.module.train()
    dist.all_reduce(acc)
    return float(acc[0] / acc[1].clamp(min=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hook", choices=["none", "powersgd"], default="none")
    ap.add_argument("--start-iter", type=int, default=2,
                    help="PowerSGD start_powerSGD_iter (vanilla all-reduce before it; 2 is the minimum allowed)")
    args, overrides = ap.parse_known_args()
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = validate(load_recipe_config(overrides=overrides), world)
    t, m = cfg.train, cfg.model
    splits = load_splits(cfg.data.path, m.vocab_size, cfg.data.val_fraction, m.seq_len)
    sampler = WindowSampler(splits.train, m.seq_len, t.global_batch_size, t.micro_batch_size, rank, world, t.seed)
    val = validation_batches(splits.val, m.seq_len, t.micro_batch_size, t.eval_sequences, rank, world)
    torch.manual_seed(t.seed)  # the same initial weights as plait's trainer
    model = GPT(m)
    bucket_mb = cfg.parallel.bucket_mb
    if args.hook == "powersgd":
        # One bucket: powerSGD_hook's future callbacks issue their next all_reduce from whichever gloo
        # worker thread finished the previous one and block on it, so with several buckets in flight the
        # ranks can issue collectives in different orders (gloo aborts with "collective mismatch") or
        # starve both worker threads (a hang). With one bucket each step's chain is sequential.
        bucket_mb = max(bucket_mb, sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20 + 1)
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    state = _hook_state(ddp, args.hook, cfg.comm.powersgd_rank, args.start_iter)
    optimizer = build_optimizer(model, cfg.optim)
    grad_numel = sum(p.numel() for p in model.parameters())
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    out = open(run_dir / "metrics.jsonl", "w") if rank == 0 else None  # noqa: SIM115 (closed below)
    after_before = 0
    for step in range(1, t.steps + 1):
        t0 = time.perf_counter()
        batches = sampler.next_batch()
        total = 0.0
        for i, (x, y) in enumerate(batches):
            ctx = ddp.no_sync() if i < len(batches) - 1 else contextlib.nullcontext()
            with ctx:
                loss = ddp(x, y) / len(batches)
                loss.backward()
            total += float(loss.detach())
        for g in optimizer.param_groups:
            g["lr"] = lr_at(step - 1, cfg.optim, t.steps)
        clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        step_s = time.perf_counter() - t0
        if state is not None and state.total_numel_after_compression > after_before:
            reduced = state.total_numel_after_compression - after_before  # the hook compressed this step
            after_before = state.total_numel_after_compression
        else:
            reduced = grad_numel  # vanilla all-reduce of every gradient element
        rec = {"step": step, "loss": total, "step_s": step_s, "comm_bytes": ring_allreduce_bytes(reduced * 4, world)}
        loss_t = torch.tensor([total], dtype=torch.float64)
        dist.all_reduce(loss_t)
        rec["loss"] = float(loss_t[0]) / world
        if t.eval_every and step % t.eval_every == 0 or step == t.steps:
            rec["val_loss"] = _evaluate(ddp, val)
        if out is not None:
            out.write(json.dumps(rec) + "\n")
            out.flush()
    if out is not None:
        out.close()
        (run_dir / "summary.json").write_text(json.dumps({"steps": t.steps, "final_val_loss": rec["val_loss"]}))
    dist.barrier()
    # Leave without destroying the group: with powerSGD_hook, ~ProcessGroupGloo joins gloo's worker thread
    # while this thread holds the GIL, and that worker needs the GIL to free a hook tensor: a deadlock
    # at exit (seen on loopback, the run's metrics complete). Everything is written and flushed above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
