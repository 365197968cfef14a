"""The layout: the one contract between the engine and however the model is trained over the ranks.

``plait.parallel.compose.parallelize`` builds it from parts, in one order: the model after its model-side dimensions
(tensor, expert, context, activation checkpointing, compile), its ``stages`` (``plait.parallel.stages.WholeModel``,
or a pipeline's ``PipelineStages``), ONE gradient-sync ``policy`` (``plait.parallel.grad_sync``: plait's reducer,
DDP, ZeRO-1/2, FSDP2/HSDP, a parameter server) with the experts' side beside it (``ExpertSync``), a context ``split``
of each micro-batch where cp > 1, and the ``drivers`` that wrap the step from outside (``Driver``: DiLoCo's outer loop,
torchft replica groups). No class exists for a combination: every method below asks the parts.

The engine (``plait.Plait``) calls only ``LayoutContract`` (about 20 methods): at setup ``build_optimizer``,
``scheduler_target``, ``wrap_forward``, ``begin``; per micro-step ``backward`` or ``forward_backward`` (``set_sync``
keeps gradients local on all but the last micro-step of an accumulation window), ``evaluate`` / ``evaluation`` /
``reduce_loss``; per optimizer step ``finish`` (complete the gradient synchronisation; its wait is the step's exposed
communication), ``clip_and_step`` (how it skips a non-finite step: ``nonfinite_skip``), ``after_step``,
``zero_grad``, ``step_metrics``; at the end ``describe``, ``report``, ``close``. Checkpoints, weight loading and
export go through ``state`` (``plait.checkpoint.layout_state``: one format for every layout, the single-process
model's names). Optional capabilities (a parameter server's serving ranks, its own pace, its part in a checkpoint)
are small protocols a part implements (``plait.parallel.capabilities``), found with ``capability``. The rest of the
class (``named_parameters``, ``trainable``, ``grads``, ``composition``, the parts) is for the drivers, the state
and tests.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from plait.checkpoint.layout_state import LayoutState, StateContract
from plait.comm.collectives import Comm
from plait.components.precision import LossScaler
from plait.config import Config
from plait.observe.memory import layout_memory
from plait.parallel.capabilities import Driver
from plait.parallel.compile import CompilePlan, compile_model
from plait.parallel.grad_sync import GradSync, OptimizerFactory, scale_down, squares_by_groups
from plait.parallel.meta_init import ModelFacts
from plait.parallel.prepare import route_forward
from plait.parallel.tensor.plan import loss_context
from plait.topology import Topology


@runtime_checkable
class LayoutContract(Protocol):
    """Everything the engine may call on a layout (each documented on ``Layout``): ``Layout`` and the parameter
    server's ``ParameterServer`` implement it; what else a layout offers is a capability (``capability``)."""

    topo: Topology  # the layout's mesh: its data-parallel group, its device
    state: StateContract  # checkpoints, weight loading and export (``plait.checkpoint.layout_state``)
    setup_memory: dict[str, Any] | None  # the engine's measurement of setup, reported by ``report``

    @property
    def model(self) -> nn.Module: ...

    @property
    def optimizer(self) -> Any: ...

    @property
    def optimizers(self) -> list[Any]: ...

    @property
    def torch_collectives(self) -> bool: ...

    @property
    def reduce_loss_every_step(self) -> bool: ...

    def capability(self, protocol: type) -> Any: ...

    def build_optimizer(self, factory: OptimizerFactory) -> Any: ...

    def scheduler_target(self) -> torch.optim.Optimizer: ...

    def wrap_forward(self, device: torch.device, plan: CompilePlan | None = None) -> None: ...

    def begin(self, run: Any) -> None: ...

    def set_sync(self, enabled: bool) -> None: ...

    def backward(self, loss: torch.Tensor, scale: float | torch.Tensor) -> None: ...

    def forward_backward(self, model: nn.Module, batch: Any, loss: Any, scale: float,
                         before_backward: Callable[[float], None] | None = None,
                         times: dict[str, float] | None = None) -> torch.Tensor: ...

    def evaluate(self, model: nn.Module, batch: Any, loss: Any) -> torch.Tensor: ...

    def evaluation(self) -> contextlib.AbstractContextManager: ...

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor: ...

    def finish(self) -> None: ...

    def clip_and_step(self, max_norm: float, scaler: LossScaler, before_step: Callable[[], None]
                      ) -> tuple[torch.Tensor | float, torch.Tensor | bool]: ...

    def nonfinite_skip(self) -> str: ...

    def after_step(self) -> None: ...

    def zero_grad(self) -> None: ...

    def step_metrics(self) -> dict[str, Any]: ...

    def describe(self) -> str: ...

    def report(self, run_dir: Path | None, measured: dict[str, int] | None, device: torch.device
               ) -> dict[str, Any]: ...

    def close(self) -> None: ...


def nonfinite(norm: torch.Tensor) -> torch.Tensor:
    """1.0 where ``norm`` is NaN or infinite, else 0.0: a 0-dim float32 tensor on the norm's device (torch's
    ``found_inf``), computed without reading it."""
    return torch.logical_not(torch.isfinite(norm)).to(torch.float32)


class Layout:
    """One training run's layout over the ranks, built from parts (see the module docstring)."""

    def __init__(self, stages: Any, policy: GradSync, cfg: Config, topo: Topology, comm: Comm, facts: ModelFacts,
                 experts: Any = None, split: Any = None, drivers: list[Driver] | None = None) -> None:
        self.stages, self.policy, self.experts, self.split = stages, policy, experts, split
        self.drivers = drivers or []
        self.cfg, self.topo, self.comm, self.facts = cfg, topo, comm, facts
        self.precision = cfg.train.compute_precision
        self.setup_memory: dict[str, Any] | None = None  # what the engine measured of setup on this rank
        self.state: StateContract = LayoutState(self)
        self._trainable: list[nn.Parameter] | None = None

    # -- what the engine reads ----------------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        """What the user runs forward on: their own model object (a pipeline's ``PipelineModel``)."""
        return self.stages.model

    @property
    def optimizer(self) -> Any:
        """The optimizer ``build_optimizer`` returned (what the user holds)."""
        return self.policy.optimizer

    @property
    def optimizers(self) -> list[Any]:
        """Every optimizer holding state (what memory accounting reads)."""
        extra = [self.experts.optimizer] if self.experts is not None and self.experts.optimizer is not None else []
        return self.policy.optimizers + extra

    @property
    def torch_collectives(self) -> bool:
        """Whether torch issues collectives for this layout (the engine then counts them)."""
        return bool(self.policy.torch_collectives or self.split is not None or self.topo.degree("tp") > 1
                    or self.stages.is_pipeline)

    @property
    def reduce_loss_every_step(self) -> bool:
        """Whether ``reduce_loss`` runs at every step, not only at log steps (a pipeline: the loss is the last
        stage's, brought to every stage)."""
        return self.stages.reduce_loss_every_step

    def capability(self, protocol: type) -> Any:
        """The part (the layout itself, its policy or a driver) implementing ``protocol`` (``Serving``, ``OwnPace``,
        ``CheckpointJoin``), or None."""
        return next((part for part in (self, self.policy, *self.drivers) if isinstance(part, protocol)), None)

    # -- what the layout's drivers and its state read (not the engine) ---------------------------------
    @property
    def composition(self) -> str:
        """The parts this layout is composed of, by class ("PipelineStages/Zero", "WholeModel/Fsdp/ExpertSync"): what
        ran, for messages and tests."""
        parts = (self.stages, self.policy, self.experts, self.split, *self.drivers)
        return "/".join(type(part).__name__ for part in parts if part is not None)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's trainable parameters under the single-process model's names (each once)."""
        return self.stages.named_parameters()

    def trainable(self) -> list[nn.Parameter]:
        """The parameters of ``named_parameters`` that require a gradient (computed once)."""
        if self._trainable is None:
            self._trainable = [p for _, p in self.named_parameters() if p.requires_grad]
        return self._trainable

    # -- building ----------------------------------------------------------------------------------
    def build_optimizer(self, factory: OptimizerFactory) -> Any:
        """The optimizer from the user's factory, over the parameters this layout trains."""
        if self.experts is not None:
            return self.experts.build_optimizer(factory, self.model)
        return self.policy.build_optimizer(factory, self.model)

    def scheduler_target(self) -> torch.optim.Optimizer:
        """The torch optimizer an LR scheduler steps and whose learning rates the metrics read."""
        return self.policy.scheduler_target()

    def begin(self, run: Any) -> None:
        """At the end of setup, once the optimizer and the LR scheduler exist (a replica group joins here)."""
        for d in self.drivers:
            d.begin(self, run)

    def wrap_forward(self, device: torch.device, plan: CompilePlan | None = None) -> None:
        """Make the user's ``model(...)`` run through the policy's wrapper (DDP) and under autocast; with a
        whole-model compile plan, as one compiled region, which ``forward_backward`` extends over the loss."""
        if not self.stages.model_whole:
            return  # the stages run inside the schedule, never through model(...)
        # under autocast unless the policy casts itself (FSDP2's bf16)
        autocast = self.precision != "fp32" and not (self.precision == "bf16" and self.policy.casts_bf16)
        route_forward(self.model, self.policy.forward_wrapper(), self.precision, autocast, device)
        if plan is not None and plan.unit == "model":
            compile_model(self.model, plan.compiler)
            self.stages.compiler = plan.compiler
        if self.split is not None:  # the user's model(...) cut into shards around that routing
            self.split.install(self.model)

    # -- one micro-step ----------------------------------------------------------------------------
    def set_sync(self, enabled: bool) -> None:
        """Whether the next backward communicates gradients (False on non-final accumulation micro-steps)."""
        self.policy.set_sync(enabled)
        if self.experts is not None:
            self.experts.set_sync(enabled)

    def _context(self) -> contextlib.AbstractContextManager:
        """The context forward and backward run in: tensor parallelism's loss parallelism, where the plan kept the
        logits vocabulary-sharded."""
        return loss_context(self.model) if self.stages.model_whole else contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, scale: float | torch.Tensor) -> None:
        """Backward of a loss the user's own forward computed, its gradients multiplied by ``scale``."""
        with self._context():
            (self.split or self.stages).backward(loss, scale)

    def forward_backward(self, model: nn.Module, batch: Any, loss: Any, scale: float,
                         before_backward: Callable[[float], None] | None = None,
                         times: dict[str, float] | None = None) -> torch.Tensor:
        """Forward, ``loss`` and backward of one micro-batch (a pipeline's schedule, a context-parallel shard);
        returns the loss, detached. ``before_backward(scale)`` runs between the loss and its backward."""
        with self._context():
            return (self.split or self.stages).forward_backward(model, batch, loss, scale, before_backward, times)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch: Any, loss: Any) -> torch.Tensor:
        """The loss of one batch without gradients, on this rank (``reduce_loss`` makes it the replica's)."""
        if self.split is not None:
            return self.split.evaluate(model, batch, loss)
        with self._context():
            return self.stages.evaluate(model, batch, loss)

    def evaluation(self) -> contextlib.AbstractContextManager:
        """Context an evaluation loop runs in: the weights every replica agrees on (a driver's, DiLoCo's)."""
        stack = contextlib.ExitStack()
        for d in self.drivers:
            stack.enter_context(d.evaluation(self))
        return stack

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """This rank's losses as values every rank of its model replica agrees on (a pipeline's last stage's, the
        whole sequence's under context parallelism)."""
        return (self.split or self.stages).reduce_loss(loss)

    # -- one optimizer step ------------------------------------------------------------------------
    def finish(self) -> None:
        """Complete the gradient synchronisation: a pipeline's tied copies around the policy's reduction, the
        experts' reduction, then the drivers' (a replica group's average over the groups)."""
        self.stages.before_reduction(self.policy)
        self.policy.finish()
        self.stages.after_reduction(self.policy)
        if self.experts is not None:
            self.experts.finish()
        for d in self.drivers:
            d.after_finish(self)

    def grads(self) -> list[torch.Tensor]:
        """The gradient tensors the optimizer will read (what loss-scale unscaling divides)."""
        return self.policy.grads() + (self.experts.grads() if self.experts is not None else [])

    def _clip_grad_norm(self, max_norm: float) -> torch.Tensor | float:
        """Clip to ``max_norm`` (inf: measure only); returns the global pre-clip norm, a 0-dim tensor on the device.
        Where the policy's gradients are the only ones and none is sharded beyond it (no tensor or pipeline
        parallelism, no experts) the policy clips with torch's numerics; otherwise each rank's squares are summed
        over the groups each gradient is sharded on (tp, the data-parallel shards, ep) and over the pipeline
        stages, each tied parameter once (float64). Communication: one all-reduce per distinct set of groups."""
        alone = self.experts is None and not self.stages.is_pipeline and self.topo.degree("tp") == 1
        if alone:
            norm = self.policy.clip_alone(max_norm)
            if norm is not None:
                return norm
        pieces = self.policy.norm_pieces(skip=set(self.stages.tied_copies))
        if self.experts is not None:
            pieces += self.experts.norm_pieces()
        total = squares_by_groups(pieces)
        if self.topo.degree("pp") > 1:
            torch.distributed.all_reduce(total, group=self.topo.group("pp"))
        norm = total.sqrt()
        if not math.isinf(max_norm):
            scale_down(self.grads(), norm, max_norm)
        return norm

    def _step(self) -> None:
        """The optimizer update (the gradients are finite and clipped)."""
        self.policy.optimizer.step()
        if self.experts is not None:
            self.experts.step()

    def clip_and_step(self, max_norm: float, scaler: LossScaler, before_step: Callable[[], None]
                      ) -> tuple[torch.Tensor | float, torch.Tensor | bool]:
        """Unscale, clip (the global norm over every shard), and step unless the norm is non-finite (after
        ``before_step``); returns (pre-clip norm, skipped). Every rank sees the same norm, so all skip or step
        together. On the device: the norm is a 0-dim tensor and ``skipped`` a 0-dim float tensor (1.0: the update
        did not run), decided by ``_step_unless``; a part that reads the norm on the host decides there (``skipped``
        a bool)."""
        if scaler.enabled:  # no gradient list for a scaler that is off
            scaler.unscale(self.grads())
        norm = self._clip_grad_norm(max_norm)
        if not isinstance(norm, torch.Tensor):
            skipped = not math.isfinite(norm) or not all(d.commit(self) for d in self.drivers)
            if not skipped:
                before_step()
                self._step()
            return norm, skipped
        found = nonfinite(norm)
        before_step()
        if not all(d.commit(self) for d in self.drivers):  # a replica's step whose collectives failed: no update
            return norm, found.fill_(1.0)
        return norm, self._step_unless(found)

    def _torch_optimizers(self) -> list[torch.optim.Optimizer] | None:
        """The torch optimizers ``_step`` runs (a ZeRO optimizer's inner one), or None where one is not a torch
        optimizer (then the skip of a non-finite step is decided on the host)."""
        out = []
        for o in self.optimizers:
            o = o if isinstance(o, torch.optim.Optimizer) else getattr(o, "optimizer", None)
            if not isinstance(o, torch.optim.Optimizer):
                return None
            out.append(o)
        return out

    def _skips_on_device(self) -> bool:
        """Whether every optimizer ``_step`` runs takes torch's ``found_inf`` (``_step_unless``)."""
        opts = self._torch_optimizers()
        return bool(opts) and all(getattr(o, "_step_supports_amp_scaling", False) for o in opts)

    def _skips_on_host(self) -> bool:
        """Whether a non-finite step is skipped by a decision on the host (``optim.skip_nonfinite``): asked for
        (true), or fp16's loss scaling, where an overflow must not update (auto). Otherwise an optimizer that cannot
        skip on the device applies the update, as the user's own loop would."""
        mode = self.cfg.optim.skip_nonfinite
        return mode is True or (mode == "auto" and self.cfg.train.precision == "fp16")

    def nonfinite_skip(self) -> str:
        """How a step with a non-finite gradient norm is skipped: "device" (every optimizer takes torch's
        ``found_inf``: the host reads nothing), "host" (one read of the step's flag per step decides) or "none"
        (the update is applied, as the user's own loop would; ``optim.skip_nonfinite=false`` or an optimizer that
        cannot skip on the device under ``auto``). What setup tells the user."""
        if self.cfg.optim.skip_nonfinite is False:
            return "none"
        if self._skips_on_device():
            return "device"
        return "host" if self._skips_on_host() else "none"

    def _step_unless(self, found: torch.Tensor) -> torch.Tensor | bool:
        """``_step``, unless ``found`` (a 0-dim float tensor on the device) is 1; returns whether the update was
        skipped (a device tensor or a host bool). Optimizers that take torch's ``found_inf`` (fused
        Adam/AdamW/SGD/Adagrad: plait's AdamW on a GPU) skip on the device, parameters, states and step counts
        untouched: the host reads nothing. Any other optimizer skips only by a decision on the host, one read of
        ``found`` per step (on a GPU, a wait for the gradients), made where ``_skips_on_host``; elsewhere it steps
        (``optim.skip_nonfinite=false`` never skips)."""
        opts = self._torch_optimizers()
        if self.cfg.optim.skip_nonfinite is False:
            self._step()
            return False
        if self._skips_on_device():
            for o in opts:
                o.found_inf = found
            try:
                self._step()
            finally:
                for o in opts:
                    del o.found_inf
            return found
        if not self._skips_on_host():
            self._step()  # as the user's own loop: a non-finite norm is reported at the next log step
            return False
        if not bool(found):
            self._step()
        return found

    def after_step(self) -> None:
        """After every optimizer step, stepped or skipped, once the LR scheduler has stepped."""
        self.policy.after_step()
        for d in self.drivers:
            d.after_step(self)

    def zero_grad(self) -> None:
        self.policy.zero_grad()
        if self.experts is not None:
            self.experts.zero_grad()

    def step_metrics(self) -> dict[str, Any]:
        """This rank's layout-specific figures of the step just taken (merged into the metrics record)."""
        out: dict[str, Any] = {}
        for d in self.drivers:
            out.update(d.step_metrics())
        return out

    # -- reporting ---------------------------------------------------------------------------------
    def describe(self) -> str:
        """The kinds of parallelism in use, for messages ("tensor-parallel/FSDP"); empty for one process."""
        t = self.topo
        used = [name for name, on in (("tensor-parallel", t.degree("tp") > 1), ("pipeline", t.degree("pp") > 1),
                                      ("expert", t.degree("ep") > 1)) if on]
        own = self.policy.describe()
        if own:
            used.append(own)
        if self.split is not None:
            used.append("context-parallel")
        inner = "/".join(used)
        for d in self.drivers:
            inner = d.describe(inner)
        return inner

    def report(self, run_dir: Path | None, measured: dict[str, int] | None, device: torch.device) -> dict[str, Any]:
        """The layout's part of the run summary: the per-rank memory prediction against ``measured`` and the peak of
        setup against its prediction (collective: an all-gather over the world), a pipeline's bubble, the experts'
        and context parallelism's blocks."""
        out = dict(self.stages.report(run_dir))
        out.update(self._memory(measured, device))
        if self.experts is not None:
            out.update(self.experts.report())
        if self.split is not None:
            out.update(self.split.report(self.cfg.parallel.cp_impl))
        for d in self.drivers:
            out.update(d.report())
        return out

    def _memory(self, measured: dict[str, int] | None, device: torch.device) -> dict[str, Any]:
        unique = list({id(p): p for _, p in self.named_parameters()}.values())
        return {"memory": layout_memory(unique, list(self.model.buffers()), self.topo, self.cfg.parallel,
                                        self.precision, self.facts.meta, measured, device, self.setup_memory)}

    def close(self) -> None:
        """At the end of the run (a parameter server's worker tells the servers it is done; a replica group leaves)."""
        for d in self.drivers:
            d.close()
        self.policy.close()

