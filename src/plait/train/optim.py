"""AdamW with decoupled weight decay on matrices only, and the warmup-then-cosine schedule."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from plait.config import OptimConfig


def param_groups(named_params: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """Matrices decay; biases, norms and embeddings do not. Each parameter appears once (the first
    name of a tied parameter decides, as in ``named_parameters()``)."""
    decay, no_decay, seen = [], [], set()
    for name, p in named_params:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        is_matrix = p.dim() >= 2 and "emb" not in name
        (decay if is_matrix else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def adamw_options(cfg: OptimConfig) -> dict:
    """AdamW keyword arguments from ``optim.*``: the fused kernel with ``optim.fused``, else the plain
    per-parameter loop (foreach=False), which keeps CPU runs bit-repeatable across layouts."""
    kernel = {"fused": True} if cfg.fused else {"foreach": False}
    return {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), **kernel}


def adamw(named_params: Iterable[tuple[str, nn.Parameter]], cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over the named parameters (``param_groups`` decides weight decay by name).

    The fused kernel takes a whole group at once and cannot mix DTensors with plain tensors (tensor
    parallelism leaves norms plain): with ``optim.fused`` each group is split by kind."""
    groups = param_groups(named_params, cfg.weight_decay)
    if cfg.fused:
        from torch.distributed.tensor import DTensor

        groups = [{**g, "params": [p for p in g["params"] if isinstance(p, DTensor) == kind]}
                  for g in groups for kind in (False, True)]
        groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(groups, **adamw_options(cfg))


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over ``model``'s trainable parameters."""
    return adamw(model.named_parameters(), cfg)


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then cosine to min_lr."""
    decay_steps = cfg.decay_steps or total_steps
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, decay_steps - cfg.warmup_steps))
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def materialize_optimizer_state(optimizer: torch.optim.Optimizer, keep_grads: bool = True) -> None:
    """Create the optimizer's state tensors (a step with zero gradients and lr 0) so DCP has
    destinations to load into; parameters do not change. With ``keep_grads`` existing gradient
    tensors are kept (zeroed, not dropped), because the data-parallel reducer's gradients are views
    into its buckets; otherwise every gradient is dropped afterwards."""
    if optimizer.state:
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs, strict=True):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=not keep_grads)
