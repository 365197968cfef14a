"""``StepInfo``: what ``Plait.step`` returns at the end of an accumulation window."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class StepInfo:
    """What one optimizer step did, as ``Plait.step`` returns it (this rank's view)."""

    step: int
    loss: float  # this rank's mean loss over the accumulation window (NaN when backward had no loss)
    grad_norm: float
    skipped: bool
    lr: float
    comm_bytes: int
    comm_wait_s: float
    comm_exposed_s: float
    optimizer_s: float
    step_s: float
    forward_s: float = 0.0  # measured by forward_backward (a user's own forward is not seen)
    backward_s: float = 0.0
    # The step's loss averaged over the data-parallel replicas: the same number on every rank.
    global_loss: float = float("nan")
    # SIGTERM/SIGINT reached a rank: every rank sees it at this same step; save and stop
    # (the Trainer does; exit with plait.fault.preempt.PREEMPTED_EXIT).
    preempted: bool = False
    # Per MoE layer (plait.nn.MoE), summed over the data-parallel ranks since the last report (every
    # train.log_every steps): tokens per expert, max_violation, dropped_fraction, aux_loss, z_loss, a2a_bytes
    # (plait.parallel.expert.dispatch.MoeMonitor); None without MoE and on the steps between reports.
    moe: list[dict[str, Any]] | None = None
    # The strategy's own figures of this step (a parameter server worker's clock, versions, bytes, waits).
    strategy_metrics: dict[str, Any] | None = None

    @property
    def ps(self) -> dict[str, Any] | None:
        """parallel.mode=ps: this worker's clock, shard versions, push/pull bytes and waits (None otherwise)."""
        return self.strategy_metrics or None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
