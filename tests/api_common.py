"""The single-process reference the keep-your-loop tests compare with: plain PyTorch, no plait in the loop.

``reference_training`` runs ``steps`` optimizer steps of AdamW with gradient clipping at 1.0 over the
global batches plait's loader forms for ``seed`` (the order is a property of plait's sampler, tested in
test_loader: the same samples per step whatever the number of ranks); ``loss_of(model, batch)`` is the
test's own loss, not plait's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def reference_training(model: torch.nn.Module, dataset: Any, global_batch: int, steps: int, lr: float, seed: int,
                       loss_of: Callable[[torch.nn.Module, Any], torch.Tensor]) -> tuple[list[float], dict]:
    """Losses per step and the final state dict of plain single-process training."""
    from plait.data.loader import DistributedBatchSampler

    order = DistributedBatchSampler(len(dataset), global_batch, dp_rank=0, dp_size=1, seed=seed).batches(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for idx in order[:steps]:
        loss = loss_of(model, dataset[idx])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
