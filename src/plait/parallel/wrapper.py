"""Composition by wrapping: a strategy built around another one, delegating every call it does not override
(expert parallelism around the data-parallel strategy of the dense parameters)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.config import ParallelConfig
from plait.parallel.strategy import OptimizerFactory, Strategy


class Wrapper(Strategy):
    """A strategy composed around another (``inner``): every call goes to ``inner`` unless overridden.
    ``wraps(cfg)`` says when the registry puts it around the chosen strategy."""

    is_wrapper = True

    def __init__(self, inner: Strategy) -> None:  # noqa: D107 - the inner strategy is already built
        self.inner = inner
        self.cfg, self.topo, self.comm, self.precision = inner.cfg, inner.topo, inner.comm, inner.precision

    @classmethod
    def wraps(cls, p: ParallelConfig) -> bool:
        return False

    @property
    def model(self) -> nn.Module:  # type: ignore[override]
        return self.inner.model

    @property
    def optimizer(self) -> Any:  # type: ignore[override]
        return self.inner.optimizer

    @property
    def torch_collectives(self) -> bool:  # type: ignore[override]
        return self.inner.torch_collectives

    @property
    def reduce_loss_every_step(self) -> bool:  # type: ignore[override]
        return self.inner.reduce_loss_every_step

    @property
    def optimizers(self) -> list[Any]:
        return self.inner.optimizers

    @property
    def facts(self) -> Any:
        return self.inner.facts

    def model_entries(self) -> dict[str, torch.Tensor]:
        return self.inner.model_entries()

    @property
    def setup_memory(self) -> dict[str, Any] | None:  # type: ignore[override]
        return self.inner.setup_memory

    @setup_memory.setter
    def setup_memory(self, reading: dict[str, Any] | None) -> None:
        self.inner.setup_memory = reading  # the inner strategy's report carries the memory block

    def build_optimizer(self, factory: OptimizerFactory) -> Any:
        return self.inner.build_optimizer(factory)

    def scheduler_target(self) -> torch.optim.Optimizer:
        return self.inner.scheduler_target()

    def start(self, leaving: Callable[[], None]) -> None:
        self.inner.start(leaving)

    def begin(self, run: Any) -> None:
        self.inner.begin(run)

    def uses_autocast(self) -> bool:
        return self.inner.uses_autocast()

    def wrap_forward(self, device: torch.device, plan: Any = None) -> None:
        self.inner.wrap_forward(device, plan)

    def set_sync(self, enabled: bool) -> None:
        self.inner.set_sync(enabled)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.inner.no_sync()

    def context(self) -> contextlib.AbstractContextManager:
        return self.inner.context()

    def evaluation(self) -> contextlib.AbstractContextManager:
        return self.inner.evaluation()

    def backward(self, loss: torch.Tensor, scale: float) -> None:
        self.inner.backward(loss, scale)

    def forward_backward(self, model: nn.Module, batch: Any, loss: Any, scale: float,
                         before_backward: Callable[[float], None] | None = None,
                         times: dict[str, float] | None = None) -> torch.Tensor:
        return self.inner.forward_backward(model, batch, loss, scale, before_backward, times)

    def evaluate(self, model: nn.Module, batch: Any, loss: Any) -> torch.Tensor:
        return self.inner.evaluate(model, batch, loss)

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.inner.reduce_loss(loss)

    def finish(self) -> None:
        self.inner.finish()

    def grads(self) -> list[torch.Tensor]:
        return self.inner.grads()

    def clip_grad_norm(self, max_norm: float) -> float:
        return self.inner.clip_grad_norm(max_norm)

    def step(self) -> None:
        self.inner.step()

    def after_step(self) -> None:
        self.inner.after_step()

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def agreement_group(self, default: Any) -> tuple[bool, Any]:
        return self.inner.agreement_group(default)

    def before_collective(self) -> None:
        self.inner.before_collective()

    def step_metrics(self) -> dict[str, Any]:
        return self.inner.step_metrics()

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return self.inner.named_parameters()

    def state_dicts(self) -> tuple[dict, dict]:
        return self.inner.state_dicts()

    def load_state_dicts(self, model_sd: dict, optim_sd: dict) -> None:
        self.inner.load_state_dicts(model_sd, optim_sd)

    def save_planner(self) -> Any:
        return self.inner.save_planner()

    def load_planner(self) -> Any:
        return self.inner.load_planner()

    def checkpoint_group(self, default: Any) -> Any:
        return self.inner.checkpoint_group(default)

    def begin_save(self, path: Path) -> None:
        self.inner.begin_save(path)

    def begin_load(self, path: Path, verify: bool) -> None:
        self.inner.begin_load(path, verify)

    def finish_load(self) -> None:
        self.inner.finish_load()

    def retie(self) -> None:
        self.inner.retie()

    def full_model_state(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        return self.inner.full_model_state(rank0_only)

    def describe(self) -> str:
        return self.inner.describe()

    def report(self, run_dir: Path | None, measured: dict[str, int] | None, device: torch.device) -> dict[str, Any]:
        return self.inner.report(run_dir, measured, device)

    def close(self) -> None:
        self.inner.close()
