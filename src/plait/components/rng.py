"""plait's own random stream for the model it runs, kept apart from the user's global torch generator.

torch's dropout (``nn.Dropout``, ``F.dropout``, attention's ``dropout_p``) and any other random op in a
model's forward draw from the global generator. A layout needs its own rule for those draws: each model
replica (data-parallel rank) draws masks of its own, and the ranks of one replica that hold copies of the
same activation (tensor parallelism, the innermost mesh axis) draw the same ones. ``RngStream`` is that
stream: a CPU generator state (and, on a GPU, the device's CUDA generator state) seeded once by the engine,
swapped into the global generator only while plait runs the model (``active``) and swapped out after, so
``Plait.setup`` and the user's own code between plait's calls find the global generator as they left it.

Activation checkpointing saves the global state it finds at the forward and restores it around the
recomputation, so a recomputed block replays the masks of the stream its forward drew from, whether the
recomputation runs inside ``active`` or not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class RngStream:
    """A generator state of plait's own (see the module docstring), seeded with ``seed`` on ``device``."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.cpu_state = torch.Generator().manual_seed(seed).get_state()
        self.cuda_state = torch.Generator(device=device).manual_seed(seed).get_state() if self.cuda else None
        self._depth = 0  # nested ``active`` (a forward inside forward_backward) swaps once

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Draw from this stream inside: the global generator holds it until the outermost ``active`` ends,
        then gets back the state it had (whatever the user drew before stays the user's)."""
        outer = self._depth == 0
        if outer:
            user = self._swap(self.cpu_state, self.cuda_state)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if outer:
                self.cpu_state, self.cuda_state = self._swap(*user)

    def _swap(self, cpu: torch.Tensor, cuda: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Install ``(cpu, cuda)`` in the global generators; returns the states they held."""
        old = torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if self.cuda else None
        torch.set_rng_state(cpu)
        if self.cuda:
            torch.cuda.set_rng_state(cuda, self.device)
        return old

    def state_dict(self) -> dict[str, Any]:
        """The stream's position (for a checkpoint of this rank)."""
        return {"cpu": self.cpu_state.clone(), "cuda": self.cuda_state.clone() if self.cuda else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position (the CUDA part only where both runs had one)."""
        self.cpu_state = state["cpu"].clone()
        if self.cuda and state.get("cuda") is not None:
            self.cuda_state = state["cuda"].clone()


def run_forward_in(model: torch.nn.Module, stream: RngStream) -> None:
    """Make ``model(...)`` draw from ``stream`` (the swap is kept out of ``torch.compile``'s graphs: Dynamo
    skips this frame and compiles the forward it calls, as before)."""
    inner = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        with stream.active():
            return inner(*args, **kwargs)

    model.forward = torch.compiler.disable(forward, recursive=False)
