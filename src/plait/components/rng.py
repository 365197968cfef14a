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

The swap copies the generator states (on the CPU, 5 KB each way) around every forward, so it is made only for a
model that draws: ``for_model`` swaps around the first training-mode forward and compares the stream before and
after; a model whose first training forward drew nothing (no dropout, no random op) runs without the swap from
then on, and its stream stays where it was (the same checkpoints, the same numbers). A model that draws only
later in training (after its first step) would draw from the global generator: give it its dropout from step one.
The swap runs in eager Python around the model's call, outside any compiled region.
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
        self.draws: bool | None = None  # whether the model draws from the stream (None: not known yet)

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

    def for_model(self, training: bool) -> contextlib.AbstractContextManager:
        """The context a model's forward runs in: ``active`` for a model that draws random numbers, nothing for
        one that does not; the first training-mode forward finds out which (see the module docstring)."""
        if self.draws is False or self._depth:
            return _NOTHING
        if self.draws is None and training:
            return self._probe()
        return self.active()

    @contextlib.contextmanager
    def _probe(self) -> Iterator[None]:
        cpu, cuda = self.cpu_state, self.cuda_state
        with self.active():
            yield
        drew = not torch.equal(cpu, self.cpu_state) or (self.cuda and not torch.equal(cuda, self.cuda_state))
        self.draws = bool(drew)

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
    """Make ``model(...)`` draw from ``stream`` while the model draws at all (``RngStream.for_model``); once its
    first training forward drew nothing, the model runs without this wrapper. It wraps the model's compiled call
    where the whole model is compiled (``plait.parallel.compile``), so the swap runs eagerly around the compiled
    region rather than inside it; else ``model.forward``, kept out of any graph a caller compiles around it
    (Dynamo skips this frame and compiles what it calls)."""
    slot = "_compiled_call_impl" if model._compiled_call_impl is not None else "forward"
    inner, own = getattr(model, slot), slot in model.__dict__  # own: an instance attribute (not the class's)

    def call(*args: Any, **kwargs: Any) -> Any:
        with stream.for_model(model.training):
            out = inner(*args, **kwargs)
        if stream.draws is False and model.__dict__.get(slot) is wrapped:
            if own:
                setattr(model, slot, inner)
            else:
                delattr(model, slot)
        return out

    wrapped = call if slot == "_compiled_call_impl" else torch.compiler.disable(call, recursive=False)
    setattr(model, slot, wrapped)


_NOTHING = contextlib.nullcontext()
