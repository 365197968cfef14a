"""``StepInfo``: what ``Plait.step`` returns at the end of an accumulation window.

The step's loss, gradient norm and skip flag are computed on the device and stay there: a step reads
nothing back on its own (``plait.engine.stepper``). A ``StepInfo`` holds them as tensors and reads each the
first time it is used (``info.loss`` is then a float, as always): reading one is the caller's request, paid
for then (on a GPU, a wait for the step's work). At a log step they arrive already read, with the values every
rank agreed on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch


class _Read:
    """A dataclass field whose value may be a 0-dim tensor on the device, or a function computing it, read (and
    kept as a float, or a bool for ``as_bool``) the first time it is got."""

    def __init__(self, default: Any, as_bool: bool = False) -> None:
        self.default, self.as_bool = default, as_bool

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:  # the dataclass's default
            return self.default
        value = obj.__dict__[self.slot]
        if callable(value) and not isinstance(value, torch.Tensor):  # global_loss off a log step: the agreement
            value = value()
        if isinstance(value, torch.Tensor):
            value = bool(value) if self.as_bool else float(value)
            obj.__dict__[self.slot] = value
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.slot] = value


@dataclass
class StepInfo:
    """What one optimizer step did, as ``Plait.step`` returns it (this rank's view)."""

    step: int
    # this rank's mean loss over the accumulation window (NaN when backward had no loss); under pipeline
    # parallelism the last stage's, on every stage, at log steps (other steps: each rank's own, 0 off the last stage);
    # under context parallelism the whole sequence's at log steps (other steps: this rank's own, a shard's share
    # where the model computed the loss on its shard; their mean over cp, ``global_loss``, is the whole's)
    loss: float = _Read(float("nan"))
    grad_norm: float = _Read(float("nan"))
    # the update was skipped: the gradients held NaN/inf
    skipped: bool = _Read(False, as_bool=True)
    lr: float = _Read(float("nan"))
    comm_bytes: int = 0
    comm_wait_s: float = 0.0
    comm_exposed_s: float = 0.0
    optimizer_s: float = 0.0
    step_s: float = 0.0
    forward_s: float = 0.0  # measured by forward_backward (a user's own forward is not seen)
    backward_s: float = 0.0
    # The step's loss averaged over the data-parallel replicas: the same number on every rank. Agreed at log
    # steps (``logged``); on another step of a run over several ranks reading it runs the agreement then, one
    # all-reduce of one number: a collective, so every rank must read it, as every rank calls ``Plait.reduce``.
    global_loss: float = _Read(float("nan"))
    # SIGTERM/SIGINT reached a rank: every rank sees it at this same step, the first log step after it arrived
    # (one rank: at once); save and stop (the Trainer does; exit with plait.fault.preempt.PREEMPTED_EXIT).
    preempted: bool = False
    # Per MoE layer (plait.nn.MoE), summed over the data-parallel ranks since the last report (every
    # train.log_every steps): tokens per expert, max_violation, dropped_fraction, aux_loss, z_loss, a2a_bytes
    # (plait.parallel.expert.dispatch.MoeMonitor); None without MoE and on the steps between reports.
    moe: list[dict[str, Any]] | None = None
    # The strategy's own figures of this step (a parameter server worker's clock, versions, bytes, waits).
    strategy_metrics: dict[str, Any] | None = None
    # Whether this was a log step: its values were read and agreed on (``Plait.step(log=...)``).
    logged: bool = False
    # At a log step: every step since the previous log step, this one last, as dicts of step, loss,
    # global_loss, grad_norm and skipped (what a judge of the whole run, like the spike detector, reads).
    history: list[dict[str, Any]] | None = None

    @property
    def ps(self) -> dict[str, Any] | None:
        """parallel.mode=ps: this worker's clock, shard versions, push/pull bytes and waits (None otherwise)."""
        return self.strategy_metrics or None

    def as_dict(self) -> dict[str, Any]:
        """Every field, the device values read."""
        return asdict(self)
