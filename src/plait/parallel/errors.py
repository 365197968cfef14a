"""The errors of plait's API that a layout raises: a call that cannot work (``PlaitError``), a loss that cannot be
backpropagated (``check_loss``), and a rank whose part of the run ends at setup (``RankDone``)."""

from __future__ import annotations

from typing import Any

import torch

from plait.config import ConfigError


class PlaitError(ConfigError):
    """The API was used in a way that cannot work; the message says what to do instead (``plait.PlaitError``)."""


class RankDone(SystemExit):
    """Raised by ``Plait.setup`` on a rank whose part of the run ends there (a parameter server's server
    ranks, once every worker has finished): the process exits with status 0 unless the caller catches it.
    ``stats`` is that rank's summary, under ``key`` in what ``plait train`` returns."""

    key = "rank_done"

    def __init__(self, stats: dict[str, Any]) -> None:
        super().__init__(0)
        self.stats = stats


def check_loss(loss: Any) -> None:
    """A clear error for a loss that cannot be backpropagated: not a scalar, or not from the model."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise PlaitError(f"backward() needs a scalar loss; got {shape}. Reduce it first (loss.mean()), or "
                         "check the loss function returns one number per batch")
    if not loss.requires_grad:
        raise PlaitError("the loss does not require grad: compute it from the model returned by setup(), "
                         "outside torch.no_grad()")
