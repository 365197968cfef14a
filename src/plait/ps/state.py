"""One server's shard and its consistency rules, without any transport (so each rule is testable alone).

A shard holds a flat parameter tensor ``w`` and a torch optimizer over one view of ``w`` per parameter
group (any elementwise torch optimizer computes on a flat slice what it computes on the tensors).
``version`` counts the updates applied; ``clocks[k]`` counts worker ``k``'s pushes.

Modes (``ps.mode``), for a gradient ``g`` that worker ``k`` computed on version ``v``:

- ``sync``: the server keeps each worker's gradient of the current version; once every active worker's
  has arrived it applies their mean (summed in worker order), clipped by its global norm (the squared
  norms of all shards summed over the servers: one all-reduce of one number per version), as one
  optimizer step. A pull after a push waits for the version it contributed to. This is all-reduce data
  parallelism's update.
- ``backup`` (``b`` backup workers): as ``sync`` but a version is applied once ``N - b`` gradients
  computed on it arrived; a gradient computed on an older version is dropped and counted. With several
  servers each shard takes the first ``N - b`` gradients that reach it (as TensorFlow's per-variable
  gradient accumulators in ``SyncReplicasOptimizer`` do), so shards may average different workers' gradients
  of one version; each shard's update is still the mean of ``N - b`` gradients of that version, and the
  clipping norm is the applied update's (the shards' squared norms summed over the servers). In
  ``sync`` and ``backup`` a push's ``version`` is the same to every server: the oldest shard version of the
  parameters the worker read (the servers answer at different times, so a read can mix versions; such a
  gradient is of the older one). So every server keeps or drops each push alike, and the servers apply
  every version exactly once each, their all-reduces of the norm pairing up.
- ``async``: each gradient is applied when it arrives, clipped by its own norm (the worker measured it
  over all shards), with staleness ``t = version - v``. With ``max_staleness >= 0`` a gradient with
  ``t > max_staleness`` is rejected and counted; with ``staleness_scaling = a`` the learning rate is
  divided by ``1 + a t``.
- ``ssp`` (bound ``s``, stale-synchronous parallel, Ho et al. 2013): clock-aggregated. A worker's
  ``c``-th push (counting from 0) is its gradient of clock ``c``; the server keeps the gradients of each
  clock and, once every active worker's gradient of clock ``c`` has arrived, applies their mean (summed in
  worker order, clipped by the global norm like ``sync``) as one optimizer step: version ``c + 1``.
  A worker that has pushed ``c`` gradients may read only version ``>= c - s`` (every update up to clock
  ``c - s - 1``); its pull waits on the server until the slowest worker catches up. So ``s = 0`` is
  exactly ``sync`` (for any optimizer) and with ``s > 0`` fast workers run ahead on parameters at most
  ``s`` clocks stale. A gradient computed on version ``v`` and applied in clock ``c`` has staleness
  ``t = c - v <= s``; ``max_staleness`` leaves staler ones out of the mean (counted as rejected) and
  ``staleness_scaling = a`` divides the clock's learning rate by ``1 + a t_mean``, ``t_mean`` the mean
  staleness of the gradients in its mean (an adaptive optimizer such as AdamW undoes a scaling of the
  gradient, not one of the learning rate).
- ``dc``: ``async`` with delay compensation (DC-ASGD, Zheng et al. 2017): the server keeps a copy
  ``w_k`` of what worker ``k`` last pulled and applies ``g + lambda g * g * (w - w_k)`` (elementwise);
  adaptive (DC-ASGD-a): ``lambda / sqrt(ms + 1e-7)`` per element, ``ms <- 0.95 ms + 0.05 g * g``.

A worker that finished (``done``) no longer counts as active: versions complete without it and no
pull waits for its clock, so workers may end at different times without a deadlock.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from plait.ps.shard import Segment

DC_MS_MOMENTUM = 0.95
DC_EPS = 1e-7
MAX_EVENTS = 100_000


def dc_compensate(g: torch.Tensor, w: torch.Tensor, w_read: torch.Tensor, lam: float,
                  mean_square: torch.Tensor | None = None) -> torch.Tensor:
    """DC-ASGD's gradient: ``g + lam * g * g * (w - w_read)``; with ``mean_square`` (adaptive) ``lam`` is
    divided elementwise by ``sqrt(mean_square + 1e-7)``."""
    coef = g * g * (w - w_read)
    if mean_square is not None:
        coef = coef / torch.sqrt(mean_square + DC_EPS)
    return g + lam * coef


class ShardState:
    """The state and rules of one server's shard (see the module docstring).

    ``optimizer_cls``/``defaults``/``groups`` rebuild the user's optimizer over the shard's segments;
    ``norm_sum(x)`` returns ``x`` summed over all servers (identity with one server). Not thread-safe:
    the server calls it under one lock, which ``norm_sum`` may release while the servers meet (``applying``
    is then set: the version's gradients are taken, pushes of it are dropped, pulls waiting for it wait).
    """

    def __init__(self, w: torch.Tensor, segments: list[Segment], optimizer_cls: type, defaults: dict[str, Any],
                 groups: list[dict[str, Any]], num_workers: int, cfg: Any, grad_clip: float,
                 norm_sum: Callable[[float], float] = lambda x: x) -> None:
        self.w = w
        self.segments = segments
        self.views = [w[s.start:s.end] for s in segments]
        hyper = [{k: v for k, v in groups[s.group].items() if k != "params"} for s in segments]
        self.optimizer = optimizer_cls([{"params": [v], **h} for v, h in zip(self.views, hyper, strict=True)],
                                       **defaults)
        self.num_workers, self.cfg, self.grad_clip, self.norm_sum = num_workers, cfg, grad_clip, norm_sum
        # a version's gradients are taken and its norm is being summed over the servers (``norm_sum`` may let
        # other threads in meanwhile: pushes of that version are then dropped, pulls that wait for it wait)
        self.applying = False
        self.version = 0
        self.clocks = [0] * num_workers
        self.done: set[int] = set()
        self.parked: set[int] = set()  # backup: workers waiting for the others in a collective
        self.pending: dict[int, torch.Tensor | None] = {}  # sync/backup: worker -> gradient (None: non-finite)
        self.pending_lrs: dict[int, list[float]] = {}
        # ssp: clock -> worker -> (gradient or None, version it was computed on, learning rates)
        self.by_clock: dict[int, dict[int, tuple[torch.Tensor | None, int, list[float]]]] = {}
        self.last_push_version: list[int | None] = [None] * num_workers
        self.w_read: dict[int, torch.Tensor] = {}  # dc: what each worker last pulled
        self.mean_square: torch.Tensor | None = torch.zeros_like(w) if cfg.mode == "dc" and cfg.dc_adaptive else None
        # statistics; ``events`` keeps (worker, version read, server version, outcome) of the first pushes
        self.events: list[tuple[int, int, int, str]] = []
        self.staleness = Counter()
        self.worker_max_staleness = [0] * num_workers
        self.applied = self.dropped = self.rejected = self.nonfinite = self.updates = 0
        self.max_clock_gap = 0
        self.max_read_gap = 0
        self.applied_norm_sq = 0.0  # the last update's squared gradient norm (over every shard; inf: skipped)
        self.busy_s = 0.0
        self.pull_wait_s = 0.0

    # -- who is still training -----------------------------------------------------------------------
    def active(self) -> list[int]:
        return [k for k in range(self.num_workers) if k not in self.done]

    def needed(self) -> int:
        """Gradients a sync/backup version waits for: all active workers' (sync), the first N - b (backup),
        fewer when workers have finished or are parked."""
        b = self.cfg.backup_workers if self.cfg.mode == "backup" else 0
        free = [k for k in self.active() if k not in self.parked]
        return max(1, min(self.num_workers - b, len(free)))

    def park(self, worker: int) -> None:
        """Worker ``worker`` meets the others in a collective: a backup version it would wait for completes
        with the gradients it holds (it cannot get more until the workers leave the collective)."""
        if self.cfg.mode == "backup":
            self.parked.add(worker)
            self.maybe_apply_version()

    def _note_clock_gap(self) -> None:
        live = [self.clocks[k] for k in self.active()]
        if live:
            self.max_clock_gap = max(self.max_clock_gap, max(live) - min(live))

    # -- push ----------------------------------------------------------------------------------------
    def push(self, worker: int, version: int, grad: torch.Tensor | None, norm_sq: float, lrs: list[float]) -> str:
        """Worker ``worker``'s gradient of this shard computed on ``version`` (None: it was non-finite);
        returns what became of it: applied, pending, dropped, rejected or nonfinite."""
        t0 = time.perf_counter()
        clock = self.clocks[worker]
        self.clocks[worker] += 1
        self._note_clock_gap()
        at = self.version + self.applying  # while a version is being applied, pushes race with the next one
        stale = at - version
        try:
            if self.cfg.mode in ("sync", "backup"):
                outcome = self._push_sync(worker, version, grad, lrs)
            elif self.cfg.mode == "ssp":
                outcome = self._push_ssp(worker, clock, version, grad, lrs)
            else:
                outcome = self._push_async(worker, stale, grad, norm_sq, lrs)
            if len(self.events) < MAX_EVENTS:
                self.events.append((worker, version, at, outcome))
            return outcome
        finally:
            self.busy_s += time.perf_counter() - t0

    def _push_sync(self, worker: int, version: int, grad: torch.Tensor | None, lrs: list[float]) -> str:
        self.last_push_version[worker] = version
        if version < self.version or (self.applying and version == self.version):  # it lost the race for it
            self.dropped += 1
            return "dropped"
        if version > self.version:
            raise RuntimeError(f"worker {worker} pushed a gradient of version {version}, ahead of the server's "
                               f"{self.version}")
        self.pending[worker] = grad
        self.pending_lrs[worker] = lrs
        return self.maybe_apply_version()

    def maybe_apply_version(self) -> str:
        """Apply the pending version once it holds ``needed()`` gradients (also called when a worker ends)."""
        if self.applying or not self.pending or len(self.pending) < self.needed():
            return "pending"
        workers = sorted(self.pending)
        grads = [self.pending[k] for k in workers]
        lrs = self.pending_lrs[workers[0]]
        self.pending, self.pending_lrs = {}, {}
        outcome = self._apply_mean(grads, lrs)
        if outcome == "applied":
            self.staleness[0] += len(grads)
            self.applied += len(grads)
        return outcome

    def _apply_mean(self, grads: list[torch.Tensor | None], lrs: list[float]) -> str:
        """One version from ``grads`` (in worker order): their mean, clipped by its global norm (summed over
        the servers), as one optimizer step with learning rates ``lrs``; a version with a non-finite gradient
        (None) or with none at all advances without a step."""
        if not grads or any(g is None for g in grads):
            # every server takes part in the same all-reduce per version (nothing of this shard: adds 0)
            self.applied_norm_sq = self._sum_over_servers(float("inf") if grads else 0.0)
            self.nonfinite += 1 if grads else 0
            self.version += 1
            return "nonfinite" if grads else "rejected"
        mean = grads[0].clone()
        for g in grads[1:]:
            mean.add_(g)
        mean.div_(len(grads))
        total = self.applied_norm_sq = self._sum_over_servers(float(mean.double().square().sum()))
        self._step(self._clip(mean, total), lrs)
        return "applied"

    def _sum_over_servers(self, x: float) -> float:
        """``norm_sum(x)`` with ``applying`` set: the server releases its lock while the servers meet, so its
        other workers' stale pushes, parks and ends (which another server's version may wait for) go on."""
        self.applying = True
        try:
            return self.norm_sum(x)
        finally:
            self.applying = False

    def _push_ssp(self, worker: int, clock: int, version: int, grad: torch.Tensor | None, lrs: list[float]) -> str:
        if clock < self.version:
            raise RuntimeError(f"worker {worker} pushed its gradient of clock {clock}, but the server already applied "
                               f"clock {self.version - 1}")
        self.by_clock.setdefault(clock, {})[worker] = (grad, version, lrs)
        return self.maybe_apply_clocks()

    def maybe_apply_clocks(self) -> str:
        """SSP: apply clock ``version`` (then the next ones) while every active worker's gradient of it has
        arrived; returns the last outcome (pending when none was applied)."""
        outcome = "pending"
        cfg = self.cfg
        while True:
            c = self.version
            got = self.by_clock.get(c)
            if self.applying or not got or any(k not in got for k in self.active()):
                return outcome
            del self.by_clock[c]
            grads, stale, lrs = [], [], got[min(got)][2]
            for k in sorted(got):
                g, v, _ = got[k]
                t = c - v
                if cfg.max_staleness >= 0 and t > cfg.max_staleness:
                    self.rejected += 1
                    continue
                grads.append(g)
                stale.append(t)
                if g is not None:
                    self.staleness[t] += 1
                    self.worker_max_staleness[k] = max(self.worker_max_staleness[k], t)
            if cfg.staleness_scaling > 0 and stale:
                lrs = [lr / (1.0 + cfg.staleness_scaling * sum(stale) / len(stale)) for lr in lrs]
            outcome = self._apply_mean(grads, lrs)
            if outcome == "applied":
                self.applied += len(grads)

    def _push_async(self, worker: int, stale: int, grad: torch.Tensor | None, norm_sq: float,
                    lrs: list[float]) -> str:
        cfg = self.cfg
        if grad is None or not math.isfinite(norm_sq):
            self.nonfinite += 1
            return "nonfinite"
        if cfg.max_staleness >= 0 and stale > cfg.max_staleness:
            self.rejected += 1
            return "rejected"
        # Clipped by the norm of the gradient the worker computed (over all shards), then compensated.
        grad = self._clip(grad, norm_sq)
        self.applied_norm_sq = norm_sq
        if cfg.mode == "dc":
            if self.mean_square is not None:
                self.mean_square.mul_(DC_MS_MOMENTUM).addcmul_(grad, grad, value=1 - DC_MS_MOMENTUM)
            grad = dc_compensate(grad, self.w, self.w_read.get(worker, self.w), cfg.dc_lambda, self.mean_square)
        scale = 1.0 / (1.0 + cfg.staleness_scaling * stale) if cfg.staleness_scaling > 0 else 1.0
        self._step(grad, [lr * scale for lr in lrs])
        self.staleness[stale] += 1
        self.worker_max_staleness[worker] = max(self.worker_max_staleness[worker], stale)
        self.applied += 1
        return "applied"

    def _clip(self, grad: torch.Tensor, norm_sq: float) -> torch.Tensor:
        """``grad`` clipped to ``optim.grad_clip`` by the global norm ``sqrt(norm_sq)``, with torch's
        coefficient ``min(1, clip / (norm + 1e-6))``."""
        if self.grad_clip > 0:
            coef = self.grad_clip / (math.sqrt(norm_sq) + 1e-6)
            if coef < 1.0:
                return grad * coef
        return grad

    @torch.no_grad()
    def _step(self, grad: torch.Tensor, lrs: list[float]) -> None:
        """One optimizer step of the shard with ``grad`` and the learning rate of each group."""
        for s, view in zip(self.segments, self.views, strict=True):
            view.grad = grad[s.start:s.end]
        for s, g in zip(self.segments, self.optimizer.param_groups, strict=True):
            if lrs:
                g["lr"] = lrs[s.group]
        self.optimizer.step()
        for view in self.views:
            view.grad = None
        self.version += 1
        self.updates += 1

    # -- pull ----------------------------------------------------------------------------------------
    def may_pull(self, worker: int) -> bool:
        """Whether worker ``worker``'s pull can be answered now (else it waits for other workers)."""
        mode = self.cfg.mode
        if mode in ("sync", "backup"):
            last = self.last_push_version[worker]
            return last is None or self.version > last
        if mode == "ssp":
            return self.version >= self.clocks[worker] - self.cfg.staleness
        return True

    def pulled(self, worker: int) -> None:
        """Bookkeeping of an answered pull: the read gap (SSP's bound) and DC's copy of what was read."""
        live = [self.clocks[k] for k in self.active()]
        if live:
            self.max_read_gap = max(self.max_read_gap, self.clocks[worker] - min(live))
        if self.cfg.mode == "dc":
            self.w_read[worker] = self.w.clone()

    def finish(self, worker: int) -> None:
        """Worker ``worker`` ended: it no longer holds back versions or pulls."""
        self.done.add(worker)
        if self.cfg.mode in ("sync", "backup"):
            self.maybe_apply_version()
        elif self.cfg.mode == "ssp":
            self.maybe_apply_clocks()

    # -- state for checkpoints -----------------------------------------------------------------------
    def optimizer_keys(self) -> tuple[list[str], list[str]]:
        """(per-element state keys, scalar state keys) of the optimizer, sorted; state is created first."""
        from plait.components.optim import materialize_optimizer_state

        if self.views:
            materialize_optimizer_state(self.optimizer, keep_grads=False)
        st = self.optimizer.state[self.views[0]] if self.views else {}
        vec = sorted(k for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0)
        sca = sorted(k for k, v in st.items() if not (torch.is_tensor(v) and v.dim() > 0))
        return vec, sca

    def restored(self, version: int, clocks: list[int]) -> None:
        """After a checkpoint load (parameters and optimizer state were read in place): the version and
        clocks it sets; nothing of the previous timeline stays pending."""
        self.version = version
        self.clocks = list(clocks)
        self.last_push_version = [None] * self.num_workers
        self.pending, self.pending_lrs, self.w_read, self.by_clock = {}, {}, {}, {}

    def stats(self) -> dict[str, Any]:
        return {"version": self.version, "clocks": list(self.clocks), "applied": self.applied,
                "dropped": self.dropped, "rejected": self.rejected, "nonfinite": self.nonfinite,
                "updates": self.updates, "staleness_histogram": {str(k): v for k, v in sorted(self.staleness.items())},
                "worker_max_staleness": list(self.worker_max_staleness), "max_clock_gap": self.max_clock_gap,
                "max_read_gap": self.max_read_gap, "busy_s": round(self.busy_s, 6),
                "pull_wait_s": round(self.pull_wait_s, 6)}
