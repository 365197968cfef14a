"""The trainer's recovery policy: rollback on loss spikes and persisting NaN, preemption, the automatic
checkpoint interval, stragglers, and the goodput ledger.

Rollback (``fault.spike_threshold`` > 0): when ``SpikeDetector`` flags a step, or the gradients stay
non-finite for ``NONFINITE_STREAK`` steps in a row (each already skipped by the engine), training goes
back to the newest good checkpoint at least ``fault.rollback_steps`` before it and leaves out the data
that led there: the global batches from that checkpoint to the spike. The detector judges every step's loss
and gradient norm, read in one transfer at the next log step (``train.log_every``) or save, where the trainer
has the engine read them: a spike is acted on at most ``log_every - 1`` steps after it happened (those steps
are rolled back with it), and no checkpoint is ever taken between a spike and its judgement. The spike and the skip are
appended to ``RUN_DIR/fault.jsonl`` first (a spike step's checkpoint is never taken as good, and a
crash before the next checkpoint replays the skip on resume rather than the bad data). More than
``fault.max_rollbacks`` rollbacks, or non-finite gradients again right after a rollback for them,
stop the run with ``TrainingDiverged``.

Automatic interval (``checkpoint.every = "auto"``): the first checkpoint is taken at step
``AUTO_FIRST_SAVE`` to measure the blocking save time ``S``; then every ``sqrt(2 x MTBF x S)`` seconds of
training (Young 1974), in steps of the measured mean step time, re-estimated at every save.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from plait.components.integrity import newest_good
from plait.fault import goodput
from plait.fault.spikes import SpikeDetector
from plait.fault.stragglers import StragglerScore

NONFINITE_STREAK = 3
AUTO_FIRST_SAVE = 10


class TrainingDiverged(RuntimeError):
    """Rollbacks did not help (or are spent); the message says what happened and what to change."""


def log_fault(run_dir: Path, event: str, **fields: Any) -> None:
    with open(Path(run_dir) / "fault.jsonl", "a") as f:
        f.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")


def skips_at(run_dir: Path, step: int) -> int:
    """Global batches to leave out when training continues from the checkpoint of ``step``."""
    path = Path(run_dir) / "fault.jsonl"
    if not path.is_file():
        return 0
    total = 0
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "skip" and int(rec["at_step"]) == step:
            total = max(total, int(rec["batches"]))
    return total


class Recovery:
    """One trainer's fault handling (see the module docstring); every rank holds one and decides alike."""

    def __init__(self, trainer: Any) -> None:
        self.t = trainer
        f = trainer.cfg.fault
        self.detector = SpikeDetector(f.spike_threshold, f.spike_window)
        self.stragglers = StragglerScore(f.straggler_factor)
        self.rollbacks = 0
        self.nonfinite = 0
        self.rolled_back_for_nonfinite = False
        self.named_stragglers: set[int] = set()
        self.every = trainer.cfg.checkpoint.every
        self.auto_every: int | None = None
        self._step_times: list[float] = []
        self._export({"straggler_factor": f.straggler_factor})
        self.ledger = goodput.Ledger(trainer.run_dir, trainer.rank0)  # step events written at log steps
        self.ledger.record("ready", attempt=int(__import__("os").environ.get("PLAIT_ATTEMPT", "0")))

    def _export(self, values: dict[str, Any]) -> None:
        """To the Prometheus endpoint, when there is one: the checkpoint interval it judges age by, and more."""
        exporter = self.t.p.prometheus
        if exporter is not None:
            every = self.every if self.every != "auto" else self.auto_every or AUTO_FIRST_SAVE
            exporter.set_values({"checkpoint_interval_steps": every, **values})

    # -- state carried in checkpoints ---------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"detector": self.detector.state_dict(), "rollbacks": self.rollbacks, "auto_every": self.auto_every}

    def load(self, state: dict[str, Any] | None) -> None:
        if state:
            self.detector.load_state_dict(state.get("detector", {}))
            self.rollbacks = int(state.get("rollbacks", 0))
            self.auto_every = state.get("auto_every")
            self._export({})

    # -- after every step ---------------------------------------------------------------------------
    def after_step(self, rec: dict[str, Any]) -> bool:
        """Note the step just taken; at a log step (``rec["history"]``: every step since the previous one) judge
        each of them in order. Returns True when training was rolled back (the record is void)."""
        self._step_times.append(rec["step_s"])
        self.ledger.step(rec["step"], rec["step_s"])
        if not rec.get("history"):
            return False
        self.ledger.flush()
        for h in rec["history"]:
            if self._judge(h):
                return True
        return False

    def _judge(self, h: dict[str, Any]) -> bool:
        verdict = self.detector.observe(h["global_loss"], h["grad_norm"])
        if verdict == "nonfinite":
            self.nonfinite += 1
            if self.nonfinite < NONFINITE_STREAK:
                return False
            if self.rolled_back_for_nonfinite:
                raise TrainingDiverged(
                    f"the gradients are non-finite again after rolling back for them (step {h['step']}): the run "
                    "diverges from that checkpoint too; lower optim.lr, raise optim.warmup_steps, or check the data")
            self.rolled_back_for_nonfinite = True
            return self._rollback(h["step"], f"non-finite gradients for {NONFINITE_STREAK} steps")
        self.nonfinite = 0
        if verdict == "spike":
            median = self.detector._median(self.detector._sorted)
            return self._rollback(h["step"], f"loss {h['global_loss']:.4f} far above the running median "
                                             f"{median:.4f}")
        return False

    def _rollback(self, step: int, why: str) -> bool:
        t, f = self.t, self.t.cfg.fault
        if self.rollbacks >= f.max_rollbacks:
            raise TrainingDiverged(f"step {step}: {why}, after {self.rollbacks} rollbacks (fault.max_rollbacks); "
                                   "lower optim.lr or raise fault.max_rollbacks")
        found = newest_good(t.run_dir, check=t.cfg.checkpoint.verify, before_step=step - f.rollback_steps + 1)
        if found.path is None:  # nothing to go back to: note it and train on (a run is never ended for this)
            if t.rank0:
                log_fault(t.run_dir, "spike", step=step, reason=why, rolled_back=False)
                t.log.warning("step %d: %s, but no good checkpoint at least %d steps earlier to roll back to; "
                              "continuing (save more often with checkpoint.every)", step, why, f.rollback_steps)
            return False
        back_to = int(found.path.name.split("_")[1])
        if t.rank0:
            log_fault(t.run_dir, "spike", step=step, reason=why)
            log_fault(t.run_dir, "skip", at_step=back_to, batches=step - back_to)
        self.ledger.record("rollback", **{"from": t.state.step, "to": back_to})
        t.p.barrier()  # the log is written before any rank acts on it
        if t.rank0:
            t.log.warning("step %d: %s; rolling back to %s and leaving out the %d global batches after it", step,
                          why, found.path.name, step - back_to)
        self.rollbacks += 1
        rollbacks = self.rollbacks
        t.load_checkpoint(found.path)
        self.rollbacks = rollbacks  # the checkpoint's count predates this rollback
        return True

    def resumed_at(self, step: int) -> int:
        """Global batches to skip after resuming at ``step`` (a rollback's window a crash interrupted)."""
        return skips_at(self.t.run_dir, step)

    # -- checkpoints ----------------------------------------------------------------------------------
    def should_save(self, step: int, last: bool) -> bool:
        if last:
            return False
        if self.every != "auto":
            return bool(self.every) and step % int(self.every) == 0
        if self.auto_every is None:
            return step == AUTO_FIRST_SAVE
        return step % self.auto_every == 0

    def saved(self, blocking_s: float) -> None:
        """After a save: the blocking time for goodput and the Young interval."""
        self.ledger.record("save", blocking_s=blocking_s)
        if self.every == "auto" and self._step_times:
            step_s = sum(self._step_times[-50:]) / len(self._step_times[-50:])
            interval_s = math.sqrt(2 * self.t.cfg.fault.mtbf_s * max(blocking_s, 1e-6))
            self.auto_every = max(1, round(interval_s / max(step_s, 1e-9)))
            self.t.log.info("checkpoint.every=auto: save %.3fs, step %.3fs, MTBF %gs -> every %d steps",
                            blocking_s, step_s, self.t.cfg.fault.mtbf_s, self.auto_every)
            self._export({})

    def save_done(self, blocking_s: float) -> None:
        """An asynchronous save completed inside a later step: the seconds that step waited for it (the
        shard writes, manifest and rename not yet finished in the background) count as blocking too."""
        self.ledger.record("save_done", blocking_s=blocking_s)

    # -- stragglers ------------------------------------------------------------------------------------
    def ranks(self, rec: dict[str, Any]) -> dict[str, Any]:
        """Straggler score from the per-rank timings of a logged step (``rank_compute_s``, ``rank_data_s``)."""
        compute, data = rec.get("rank_compute_s"), rec.get("rank_data_s")
        if not compute:
            return {}
        slow = self.stragglers.observe([c + d for c, d in zip(compute, data or [0.0] * len(compute), strict=True)])
        for r in set(slow) - self.named_stragglers if self.t.rank0 else ():
            self.t.log.warning("rank %d is a straggler: its work takes %.2fx the median rank's", r,
                               self.stragglers.scores[r])
        self.named_stragglers |= set(slow)
        out = {"straggler_score": [round(x, 3) for x in self.stragglers.scores], "stragglers": sorted(slow)}
        self._export({"straggler_score": out["straggler_score"]})
        if self.t.cfg.fault.rebalance and self.t.p.dp == self.t.p.world_size > 1:
            work = [c + d for c, d in zip(compute, data or [0.0] * len(compute), strict=True)]
            out["shares"] = self._rebalance(work)
        return out

    def _rebalance(self, work_s: list[float]) -> list[int]:
        """Shares of the global batch proportional to each rank's measured speed (samples per second of
        its own work), changed only when some share moves by more than 10%; identical on every rank, as
        the inputs are the gathered timings."""
        p, g = self.t.p, self.t.cfg.train.global_batch_size
        current = p.shares or [g // p.dp] * p.dp
        per_sample = [max(w, 1e-9) / n for n, w in zip(current, work_s, strict=True)]
        # smoothed over the logged steps, so one noisy step does not move the shares back and forth
        prev = getattr(self, "_per_sample", None)
        self._per_sample = per_sample if prev is None else [0.5 * a + 0.5 * b for a, b in zip(per_sample, prev,
                                                                                              strict=True)]
        speed = [1.0 / x for x in self._per_sample]
        new = largest_remainder([g * v / sum(speed) for v in speed], g, minimum=p.accumulation)
        if max(abs(a - b) / b for a, b in zip(new, current, strict=True)) > 0.10:
            p.set_shares(self.t.loader, new)
            self.t._it = None  # the next batches come from the new shares
            if self.t.rank0:
                self.t.log.info("fault.rebalance: shares of each global batch %s -> %s", current, new)
            return new
        return current

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rollbacks": self.rollbacks, "stragglers": sorted(self.named_stragglers),
                               "straggler_score": [round(x, 3) for x in self.stragglers.scores]}
        if self.every == "auto":
            out["checkpoint_every"] = self.auto_every
        return out


def largest_remainder(exact: list[float], total: int, minimum: int = 1) -> list[int]:
    """Integers close to ``exact`` summing to ``total``, each at least ``minimum``."""
    floors = [max(minimum, int(x)) for x in exact]
    order = sorted(range(len(exact)), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    i = 0
    while sum(floors) < total:
        floors[order[i % len(order)]] += 1
        i += 1
    while sum(floors) > total:
        j = max(range(len(floors)), key=lambda k: floors[k] - exact[k])
        if floors[j] <= minimum:
            break
        floors[j] -= 1
    return floors
