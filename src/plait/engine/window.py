"""The accumulation window: which micro-step of an optimizer step this is, whether its backward
communicates gradients, the micro-steps' losses and timings.

``train.global_batch_size / (micro batch x dp)`` micro-steps make one optimizer step. Every backward
scales its loss by ``loss scale / accumulation``; only the last micro-step of the window synchronises
gradients (the strategy's ``set_sync``); ``Plait.step`` closes the window.
"""

from __future__ import annotations

import torch

from plait.config import ConfigError


class WindowError(ConfigError):
    """The accumulation window was used out of order; the message says what to do."""


class AccumulationWindow:
    """Micro-step bookkeeping of one ``Plait`` (see the module docstring)."""

    def __init__(self, accumulation: int) -> None:
        self.accumulation = accumulation
        self.micro = 0
        self.losses: list[torch.Tensor] = []  # this window's micro-step losses, kept on the device
        self.times = {"forward_s": 0.0, "backward_s": 0.0}

    @property
    def sync_gradients(self) -> bool:
        """True when the next backward is the last micro-step of the window."""
        return self.micro % self.accumulation == self.accumulation - 1

    @property
    def complete(self) -> bool:
        """Whether every micro-step of the window has run (``step`` may close it)."""
        return self.micro > 0 and self.micro % self.accumulation == 0

    def begin(self) -> bool:
        """Before a micro-step's backward; returns whether it ends the window."""
        if self.micro and self.micro % self.accumulation == 0:
            raise WindowError(f"backward() ran {self.micro} times without step(): call p.step() after every "
                              f"backward (it steps once every {self.accumulation} micro-steps)")
        return self.sync_gradients

    def end(self, loss: torch.Tensor) -> None:
        """After a micro-step's backward: its loss joins the window's (a copy to the host here would wait
        for this micro-step's backward on a GPU, so it stays on the device until the step ends)."""
        self.micro += 1
        self.losses.append(loss.detach().float().reshape(()))

    def close(self) -> tuple[list[torch.Tensor], dict[str, float]]:
        """End the window: its losses and timings; the next window starts empty."""
        losses, times = self.losses, self.times
        self.micro, self.losses, self.times = 0, [], {"forward_s": 0.0, "backward_s": 0.0}
        return losses, times
