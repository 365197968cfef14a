"""How a rank runs its part of the model: ``WholeModel`` (the model whole on each rank: the user's ``model(...)``,
``backward``) or a pipeline's stages (``plait.parallel.pipeline.stages.PipelineStages``: a schedule runs each
micro-step). ``plait.parallel.compose.parallelize`` makes one of the two; the layout (``plait.parallel.layout``) runs
its micro-steps through it.

Both answer the same questions: the modules the gradient-sync policy synchronises (``holder``) and their parameters
under the single-process names (``named_parameters``; later pipeline copies of a tied parameter in ``tied_copies``),
one micro-step (``backward`` / ``forward_backward``) and an evaluation, the loss every rank of a model replica agrees
on (``reduce_loss``), this rank's state-dict entries, and what a step leaves to do after the gradient reduction (a
pipeline's tied copies).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.components.precision import autocast
from plait.parallel.compile import fusable, fused_loss
from plait.parallel.errors import check_loss
from plait.parallel.tensor.plan import local_value

CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."


def clean(name: str) -> str:
    """A parameter's single-process name (activation checkpointing inserts a wrapper level)."""
    return name.replace(CHECKPOINT_PREFIX, "")


def own_entries(sd: dict[str, Any], modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    """The tensors of a state dict ``sd`` of ``modules`` (keyed by the whole model's names), then, under their
    attribute paths, every parameter and buffer of ``modules`` that ``sd`` does not name so (one a state-dict hook
    renamed: torchtitan's fused ``wqkv`` saved as ``wq``/``wk``/``wv``; a non-persistent buffer): what meta
    initialisation writes into, with the single-process names (the checkpoint wrapper's level removed)."""
    out = {clean(k): v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    for m in modules:
        for name, t in [*m.named_parameters(), *m.named_buffers()]:
            out.setdefault(clean(name), t)
    return out


class WholeModel:
    """The model runs whole on each rank (it may hold tensor-parallel DTensors or an expert slice)."""

    model_whole = True
    is_pipeline = False
    reduce_loss_every_step = False
    tied_copies: frozenset[int] = frozenset()

    def __init__(self, model: nn.Module, precision: str, device: torch.device) -> None:
        self.model = model
        self.precision, self.device = precision, device
        self.compiler: Any = None  # the whole-model compile plan's (forward_backward fuses the loss with it)
        self._fused: dict[int, Any] = {}
        self._named: list[tuple[str, nn.Parameter]] | None = None

    @property
    def holder(self) -> nn.Module:
        """The module the gradient-sync policy synchronises."""
        return self.model

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's trainable parameters, each once, under the single-process names."""
        if self._named is None:
            self._named = [(clean(n), p) for n, p in self.model.named_parameters()]
        return self._named

    def entries(self) -> dict[str, torch.Tensor]:
        """This rank's state-dict entries (parameters, persistent buffers) under the single-process names, as the
        model's own state dict names them (its state-dict hooks honoured): the model's tensors, so writing into
        them writes the model; then its own tensors that the state dict names otherwise or not at all
        (``own_entries``)."""
        return own_entries(self.model.state_dict(keep_vars=True), [self.model])

    def model_state(self) -> dict[str, Any]:
        return self.model.state_dict()

    def load_model_state(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd)

    # -- one micro-step ------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, scale: float | torch.Tensor) -> None:
        """Backward of a loss the user's own forward computed, times ``scale`` (a float, or the loss scaler's
        device tensor); a scale of 1 multiplies nothing (its gradient would be the same)."""
        (loss if isinstance(scale, float) and scale == 1.0 else loss * scale).backward()

    def forward_backward(self, model: nn.Module, batch: Any, loss: Any, scale: float,
                         before_backward: Callable[[float], None] | None = None,
                         times: dict[str, float] | None = None) -> torch.Tensor:
        """Forward, loss and backward of one micro-batch (already on the device); returns the loss, detached."""
        t0 = time.perf_counter()
        out = self._loss_value(model, batch, loss)
        t1 = time.perf_counter()
        check_loss(out)
        if before_backward is not None:
            before_backward(scale)
        self.backward(out, scale)
        if times is not None:
            times["forward_s"] += t1 - t0
            times["backward_s"] += time.perf_counter() - t1
        return out.detach()

    def _loss_value(self, model: nn.Module, batch: Any, loss: Any) -> torch.Tensor:
        """``loss(model, batch)``; with the whole model compiled, the model and the loss in one region
        (``plait.parallel.compile.fused_loss``, one per loss object)."""
        if self.compiler is None or model is not self.model or not fusable(loss):
            return loss(model, batch)
        run = self._fused.get(id(loss))
        if run is None:
            run = self._fused[id(loss)] = fused_loss(model, loss, self.compiler)
        return run(batch)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch: Any, loss: Any) -> torch.Tensor:
        """One batch's loss without gradients, on the rank's device."""
        with autocast(self.precision, self.device):
            return loss(model, batch)

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """This rank's losses as values every rank of its model replica agrees on: its own."""
        return loss

    def after_reduction(self, sync: Any) -> None:
        """What a step does once the gradients are reduced: nothing for a whole model."""

    def before_reduction(self, sync: Any) -> None:
        """What a step does before the gradients are reduced: nothing for a whole model."""

    def retie(self) -> None:
        """After weights were written from outside (a heal): one copy of each parameter, nothing to do."""

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole model's entries, tensor-parallel shards gathered (collective over tp)."""
        return {k: local_value(v).detach() for k, v in self.model.state_dict().items()}

    def report(self, run_dir: Path | None) -> dict[str, Any]:
        return {}
