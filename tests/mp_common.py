"""Shared pieces of the model-parallel tests: a tiny GPT, fixed batches, a single-process reference.

Tolerances, stated once: tensor and pipeline parallelism compute the same maths as one process but
sum in a different order (row-parallel partial sums, vocabulary-parallel softmax, micro-batch
gradient accumulation), so float32 results differ by rounding only. After 3 AdamW steps at lr 1e-3
the observed differences are below 3e-6 for parameters and 2e-6 for losses; the tests allow
``PARAM_ATOL`` and ``LOSS_ATOL`` (10x margin), far below one optimizer update (~1e-3).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from plait.config import ModelConfig
from plait.models.gpt import GPT

PARAM_ATOL = 3e-5
LOSS_ATOL = 2e-5
STEPS = 3
LR = 1e-3


def tiny_cfg(n_layer: int = 4) -> ModelConfig:
    return ModelConfig(n_layer=n_layer, d_model=32, n_head=4, seq_len=16, vocab_size=256, dropout=0.0)


def make_model(cfg: ModelConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def batches(batch_size: int, steps: int = STEPS, seed: int = 1, vocab: int = 256, seq: int = 16):
    """The same ``steps`` (idx, targets) batches of shape (B, T) on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch_size, seq), generator=g),
             torch.randint(0, vocab, (batch_size, seq), generator=g)) for _ in range(steps)]


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=False)


def reference(cfg: ModelConfig, data) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training from the same weights and data: losses and final state dict."""
    model = make_model(cfg)
    opt = optimizer(model.parameters())
    losses = []
    for idx, tgt in data:
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_param_diff(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Largest |difference| over the entries this rank holds (gathers DTensors: collective over tp)."""
    return max((full(v).detach() - ref[k]).abs().max().item() for k, v in sorted(state.items()))


def allreduce_grads_mean(params, group) -> None:
    """Plain data parallelism for the tests: average each local gradient shard over ``group``."""
    from plait.parallel.tensor import local_grads

    n = dist.get_world_size(group)
    for g in local_grads(list(params)):
        dist.all_reduce(g, group=group)
        g.div_(n)


def mean_over(value: float, group) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)
