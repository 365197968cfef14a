"""The existing practice for bench/chaos.py: a hand-written DDP loop under ``torchrun --max-restarts``.

plait's GPT, data, optimizer and schedule (the same ``--section.key=value`` overrides as ``plait train``),
``torch.save`` of model, optimizer, step and sampler position every ``checkpoint.every`` steps (written to
a temporary file and renamed: the careful version of the practice), and on start the newest checkpoint
loaded. The process group's timeout is plait's ``comm.timeout_s``, so a hang is detected as soon as
plait detects it; what differs is what happens next. Writes the same ``progress.json`` and goodput
ledger as plait (``plait.fault``), so both are measured alike.

    torchrun --max-restarts=N bench/_chaos_peer.py --run.dir=DIR [--section.key=value ...]
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from plait.components.optim import build_optimizer, lr_at
from plait.data.corpus import load_splits
from plait.data.sampler import WindowSampler
from plait.fault import goodput
from plait.fault.restart import write_pid, write_progress
from plait.models.gpt import GPT
from plait.recipes import load_recipe_config
from plait.recipes import validate_config as validate


def main() -> None:
    import sys

    overrides = [a for a in sys.argv[1:] if a.startswith("--")]
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    cfg0 = load_recipe_config(overrides=overrides)
    timeout = timedelta(seconds=cfg0.comm.timeout_s)
    # torch 2.13's env:// rendezvous reuses the dead attempt's gloo addresses after a torchrun restart
    # ("connectFullMesh failed ... Connection refused"): without a store prefix per attempt the practice
    # cannot restart at all on gloo, so the peer gets the same workaround plait uses.
    env = os.environ
    store = dist.PrefixStore(f"peer/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=False, timeout=timeout))
    dist.init_process_group("gloo", store=store, rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                            timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = validate(cfg0, world)
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_pid(run_dir, rank)
    t, m = cfg.train, cfg.model
    splits = load_splits(cfg.data.path, m.vocab_size, cfg.data.val_fraction, m.seq_len)
    sampler = WindowSampler(splits.train, m.seq_len, t.global_batch_size, t.micro_batch_size, rank, world, t.seed)
    torch.manual_seed(t.seed)
    model = DistributedDataParallel(GPT(m))
    opt = build_optimizer(model.module, cfg.optim)
    ckpt = run_dir / "peer.pt"
    step = 0
    if ckpt.is_file():
        t0 = time.time()
        state = torch.load(ckpt, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        step, sampler.consumed = int(state["step"]), int(state["consumed"])
        if rank == 0:
            goodput.record(run_dir, "resume", step=step, load_s=time.time() - t0)
    if rank == 0:
        goodput.record(run_dir, "ready")
    while step < t.steps:
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg.optim, t.steps)
        batches = sampler.next_batch()
        for i, (x, y) in enumerate(batches):
            ctx = model.no_sync() if i < len(batches) - 1 else _null()
            with ctx:
                (model(x, y) / len(batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if rank == 0:
            goodput.record(run_dir, "step", step=step, s=time.perf_counter() - t0)
            write_progress(run_dir, steps=step, saved=None)
        if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
            t1 = time.perf_counter()
            if rank == 0:
                tmp = ckpt.with_suffix(".tmp")
                torch.save({"model": model.module.state_dict(), "optim": opt.state_dict(), "step": step,
                            "consumed": sampler.consumed}, tmp)
                os.replace(tmp, ckpt)
            dist.barrier()
            if rank == 0:
                goodput.record(run_dir, "save", blocking_s=time.perf_counter() - t1)
    dist.destroy_process_group()


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    main()
