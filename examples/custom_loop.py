"""Keep your own loop: plait.Plait around a plain PyTorch model, data set and optimizer.

    python examples/custom_loop.py                          # one process
    plait run --nproc 2 examples/custom_loop.py --zero 2    # 2 local workers, ZeRO-2
    torchrun --nproc-per-node 2 examples/custom_loop.py     # the same under torchrun (or srun under SLURM)

Trains a small classifier on synthetic data, saves a checkpoint half way, and (``--resume``) continues
from it; prints the loss every few steps from rank 0 and writes the run's metrics.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import TensorDataset

import plait


def make_data(n: int = 2048, dim: int = 32, classes: int = 4) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, classes, generator=g)
    return TensorDataset(x, (x @ w).argmax(-1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--zero", type=int, default=0)
    ap.add_argument("--run-dir", default="runs/custom-loop")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    p = plait.Plait(run={"dir": args.run_dir}, parallel={"zero": args.zero},
                    train={"global_batch_size": 64, "micro_batch_size": 16, "steps": args.steps},
                    observe={"progress": False})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 4))
    model, optimizer = p.setup(model, optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3),
                               scheduler=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps))
    loader = p.setup_dataloader(make_data())
    ckpt = p.run_dir / "checkpoint"
    if args.resume:
        p.load(ckpt, model=model, optimizer=optimizer, dataloader=loader)
    while p.steps < args.steps:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            p.backward(loss)
            info = p.step()
            if info is None:  # between accumulation boundaries
                continue
            if info.step % 10 == 0:
                p.log({"loss": p.reduce(info.loss), "lr": info.lr, "grad_norm": info.grad_norm})
                if p.is_main:
                    print(f"step {info.step}: loss {info.loss:.4f} (rank 0)", flush=True)
            if info.step == args.steps // 2 and not args.resume:
                p.save(ckpt, model=model, optimizer=optimizer, dataloader=loader, extra={"step": info.step})
            if p.steps >= args.steps:
                break
    p.export(model, p.run_dir / "model.safetensors")
    if p.is_main:
        print(f"done: {p.steps} steps on {p.world_size} worker(s), weights in {p.run_dir / 'model.safetensors'}")
    p.close()


if __name__ == "__main__":
    main()
