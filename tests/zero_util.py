"""Shared pieces of the ZeRO/FSDP equivalence tests: a tiny GPT, fixed data, and the reference loop."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.distributed as dist

from plait.config import ModelConfig
from plait.models.gpt import GPT

CFG = ModelConfig(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=256, dropout=0.0)
GLOBAL_BATCH = 8
STEPS = 5


def make_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)


def param_groups(model: torch.nn.Module, weight_decay: float = 0.1) -> list[dict]:
    """The trainer's grouping: decay on matrices, none on biases and norms."""
    params = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def batches(steps: int = STEPS, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, CFG.seq_len + 1), generator=g)
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def local_micro_batches(x: torch.Tensor, y: torch.Tensor, rank: int, world: int, accum: int):
    """This rank's disjoint slice of the global batch, split into ``accum`` micro-batches."""
    per = GLOBAL_BATCH // world
    xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    return list(zip(xs.chunk(accum), ys.chunk(accum), strict=True))


def reference_run(make_opt: Callable, clip: float, steps: int = STEPS) -> tuple[list[float], dict]:
    """Single process, whole global batch per step: the losses and final parameters to match."""
    model = make_model()
    opt = make_opt(model)
    losses = reference_steps(model, opt, clip, steps)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_steps(model, opt, clip: float, steps: int, first: int = 0) -> list[float]:
    losses = []
    for x, y in batches(first + steps)[first:]:
        loss = model(x, y)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def distributed_run(model: torch.nn.Module, opt, rank: int, world: int, accum: int, clip: float,
                    no_sync: Callable | None = None, steps: int = STEPS, first: int = 0) -> list[float]:
    """A minimal data-parallel loop: accumulate ``accum`` micro-steps, clip, step; global mean loss.
    Runs global batches ``first .. first + steps - 1`` of the fixed sequence."""
    losses = []
    for x, y in batches(first + steps)[first:]:
        micro = local_micro_batches(x, y, rank, world, accum)
        total = torch.zeros(())
        for i, (mx, my) in enumerate(micro):
            ctx = no_sync() if (no_sync is not None and i < accum - 1) else nullcontext()
            with ctx:
                loss = model(mx, my) / accum
                loss.backward()
            total += loss.detach()
        if clip > 0:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        losses.append((total / world).item())
    return losses
