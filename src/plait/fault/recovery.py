"""The trainer's recovery policy: rollback on loss spikes and persisting NaN, preemption, the automatic
checkpoint interval, stragglers, and the goodput ledger.

Spikes (``fault.spike_threshold`` > 0; the rule is ``plait.fault.spikes``): when ``SpikeDetector`` flags a
step ``s``, or the gradients stay non-finite for ``NONFINITE_STREAK`` steps in a row (each already skipped by
the engine), training goes back to the newest good checkpoint ``c`` at least ``fault.rollback_steps`` before
it and leaves out the spike's window: every global batch from that checkpoint's data position up to and
including the batch of step ``s`` (batches an earlier rollback to ``c`` left out included, so a second
rollback never replays the first one's data), at least ``fault.skip_batches`` of them. Data positions
count global batches (``data_offset``: the batches left out so far, carried in checkpoints, so the position
of step ``s`` is ``s + data_offset``). The skipped samples' data set indices go to ``RUN_DIR/fault.jsonl``
and the log, and plait's loader keeps the windows in its state, so checkpoints hold them.

With ``train.deterministic`` (and ``fault.spike_replay``) the first rollback for a spike replays the same
batches instead: a spike that comes back bit for bit is the data (the log says so), and training rolls
back again leaving its window out; one that does not come back was the hardware or a transient fault, and
training goes on from the replay. The detector judges every step's loss and gradient norm, read in one
transfer at the next log step (``train.log_every``) or save, where the trainer has the engine read them: a
spike is acted on at most ``log_every - 1`` steps after it happened (those steps are rolled back with it), and
no checkpoint is ever taken between a spike and its judgement. The spike and the skip are appended to
``RUN_DIR/fault.jsonl`` before any rank acts (a spike step's checkpoint is never taken as good, and a crash
before the next checkpoint replays the skip on resume rather than the bad data).

With no rollback left (``fault.max_rollbacks``) or no checkpoint to go back to, a spike is a warning and
training goes on; only a loss that stays above the spike limit for ``fault.spike_patience`` judged steps in a
row (it does not come back), or non-finite gradients again right after a rollback for them, stop the run with
``TrainingDiverged``.

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

from plait.checkpoint.integrity import newest_good
from plait.data.loader import DeviceLoader, DistributedLoader
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


def skip_until(run_dir: Path, step: int) -> int | None:
    """The data position (global batches) up to which a resume at ``step`` leaves data out: the furthest
    ``skip`` record for that checkpoint step in the fault log, or None."""
    path = Path(run_dir) / "fault.jsonl"
    if not path.is_file():
        return None
    until = None
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "skip" and int(rec["at_step"]) == step and "until" in rec:
            until = max(until or 0, int(rec["until"]))
    return until


def leave_out(loader: Any, global_batches: int, accumulation: int) -> list[int] | None:
    """Skip the loader's next ``global_batches`` global batches; the data set indices of their samples where
    the loader knows them (plait's map-style loader), else None (a stream's batches are read and dropped)."""
    inner = loader.loader if isinstance(loader, DeviceLoader) else loader
    if isinstance(inner, DistributedLoader) and inner.sampler.drop_last:
        return inner.skip(global_batches)
    loader.advance(global_batches * accumulation)
    return None


class Recovery:
    """One trainer's fault handling (see the module docstring); every rank holds one and decides alike."""

    def __init__(self, trainer: Any) -> None:
        self.t = trainer
        f, cfg = trainer.cfg.fault, trainer.cfg
        after = f.spike_warmup_steps if f.spike_warmup_steps >= 0 else max(cfg.optim.warmup_steps, 2 * f.spike_window)
        self.detector = SpikeDetector(f.spike_threshold, f.spike_window, jump=f.spike_jump, after_steps=after)
        self.data_offset = 0  # global batches left out so far: step s trained on global batch s + data_offset
        self.over = 0  # judged steps in a row above the spike limit with no rollback tried
        self.replay: dict[str, Any] | None = None  # a deterministic replay under way: the spike it checks
        self.replay_on = bool(f.spike_replay and cfg.train.deterministic)
        self.stragglers = StragglerScore(f.straggler_factor)
        self.rollbacks = 0  # rollbacks that left data out (fault.max_rollbacks counts these)
        self.replays = 0  # rollbacks that replayed a spike's batches to tell the data from the hardware
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
        return {"detector": self.detector.state_dict(), "rollbacks": self.rollbacks, "replays": self.replays,
                "auto_every": self.auto_every, "data_offset": self.data_offset}

    def load(self, state: dict[str, Any] | None) -> None:
        if state:
            self.detector.load_state_dict(state.get("detector", {}))
            self.rollbacks, self.replays = int(state.get("rollbacks", 0)), int(state.get("replays", 0))
            self.auto_every = state.get("auto_every")
            self.data_offset = int(state.get("data_offset", 0))
            self._export({})
        self.over = 0

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
        step, loss = h["step"], h["global_loss"]
        verdict = self.detector.observe(loss, h["grad_norm"], step)
        if verdict == "nonfinite":
            self.nonfinite += 1
            if self.nonfinite < NONFINITE_STREAK:
                return False
            if self.rolled_back_for_nonfinite:
                raise TrainingDiverged(
                    f"the gradients are non-finite again after rolling back for them (step {step}): the run "
                    "diverges from that checkpoint too; lower optim.lr, raise optim.warmup_steps, or check the data")
            self.rolled_back_for_nonfinite = True
            return self._spike(step, f"non-finite gradients for {NONFINITE_STREAK} steps", loss, replay=False)
        self.nonfinite = 0
        replayed = self.replay is not None and step == self.replay["step"]
        if replayed and self._replayed(step, loss):
            return True
        if verdict != "spike":
            self.over = 0
            return False
        # a spike is not added to the window, so the limit it was judged against is still the detector's
        why = (f"loss {loss:.4f} above the spike limit {self.detector.limit():.4f} (running median "
               f"{self.detector.median():.4f}, "
               "fault.spike_threshold and fault.spike_jump)")
        # one replay per spike (a step the replay just judged is not replayed again), and no more replays than
        # rollbacks allowed
        replay = self.replay_on and not replayed and self.replays < self.t.cfg.fault.max_rollbacks
        return self._spike(step, why, loss, replay=replay)

    def _replayed(self, step: int, loss: float) -> bool:
        """The replay reached the spike's step: the same loss bit for bit is the data; another, the hardware."""
        t, spike = self.t, self.replay
        self.replay = None
        same = loss == spike["loss"]
        if t.rank0:
            log_fault(t.run_dir, "replay", step=step, loss=loss, spike_loss=spike["loss"], reproduced=same)
        if same:
            if t.rank0:
                t.log.warning("step %d: the deterministic replay from %s reproduced the spike bit for bit (loss %r): "
                              "it is the data (with the model's state then), not the hardware; rolling back again "
                              "and leaving the spike's window out", step, spike["back_to"], loss)
            return self._spike(step, spike["why"], loss, replay=False)
        if t.rank0:
            t.log.warning("step %d: the deterministic replay did not reproduce the spike (loss %.6g, was %.6g): a "
                          "fault of the hardware or a transient one, not the data; training goes on from the replay",
                          step, loss, spike["loss"])
        return False

    def _spike(self, step: int, why: str, loss: float, replay: bool) -> bool:
        """Roll back for the spike at ``step`` (a replay, or leaving its window out); where no rollback is left or
        possible, warn and train on, unless the loss has not come back for ``fault.spike_patience`` steps."""
        t, f = self.t, self.t.cfg.fault
        found = newest_good(t.run_dir, check=t.cfg.checkpoint.verify, before_step=step - f.rollback_steps + 1)
        if self.rollbacks < f.max_rollbacks and found.path is not None:
            return self._rollback(step, why, loss, found.path, replay)
        self.over += 1
        if self.over >= f.spike_patience:
            raise TrainingDiverged(
                f"step {step}: {why}; the loss has stayed above the spike limit for {self.over} steps in a row "
                f"(fault.spike_patience) after {self.rollbacks} rollbacks: it does not come back; lower optim.lr, "
                "raise optim.warmup_steps, or check the data")
        if t.rank0:  # every such step: its checkpoint is never taken as good
            log_fault(t.run_dir, "spike", step=step, reason=why, rolled_back=False)
        if self.over == 1 and t.rank0:
            cause = ("the rollbacks allowed (fault.max_rollbacks) are spent" if found.path is not None else
                     f"no good checkpoint at least {f.rollback_steps} steps earlier to roll back to (save more often "
                     "with checkpoint.every)")
            t.log.warning("step %d: %s, but %s; training goes on, and stops only if the loss stays above the limit "
                          "for %d steps in a row (fault.spike_patience)", step, why, cause, f.spike_patience)
        return False

    def _rollback(self, step: int, why: str, loss: float, path: Path, replay: bool) -> bool:
        t, f = self.t, self.t.cfg.fault
        back_to = int(path.name.split("_")[1])
        until = step + self.data_offset  # the data position after the spike step's batch
        if t.rank0:
            log_fault(t.run_dir, "spike", step=step, reason=why, loss=loss, replay=replay)
            if not replay:  # before any rank acts: a crash before the next checkpoint leaves the window out too
                log_fault(t.run_dir, "skip", at_step=back_to, until=until, min_batches=f.skip_batches)
        self.ledger.record("rollback", **{"from": t.state.step, "to": back_to})
        t.p.barrier()  # the log is written before any rank acts on it
        if t.rank0:
            what = ("replaying the same batches to tell the data from the hardware" if replay else
                    "leaving out the spike's window")
            t.log.warning("step %d: %s; rolling back to %s, %s", step, why, path.name, what)
        rollbacks, replays = self.rollbacks + (not replay), self.replays + replay
        t.load_checkpoint(path)
        self.rollbacks, self.replays = rollbacks, replays  # the checkpoint's counts predate this rollback
        self.replay = {"step": step, "loss": loss, "why": why, "back_to": path.name} if replay else None
        return True

    def resumed_at(self, step: int) -> int:
        """Global batches to leave out after resuming at ``step`` (``data_offset`` already loaded): up to the
        furthest window a rollback to this checkpoint recorded, at least ``fault.skip_batches``."""
        until = skip_until(self.t.run_dir, step)
        if until is None:
            return 0
        return max(until - (step + self.data_offset), self.t.cfg.fault.skip_batches, 0)

    def skipped(self, step: int, samples: list[int] | None, batches: int) -> None:
        """After a load left ``batches`` global batches out: count them, and name their samples in the fault
        log and the log."""
        self.data_offset += batches
        t = self.t
        if not t.rank0:
            return
        log_fault(t.run_dir, "skipped", at_step=step, batches=batches, data_offset=self.data_offset,
                  samples=samples)
        named = ("samples " + ", ".join(map(str, samples[:16])) + (" ..." if len(samples) > 16 else "")
                 if samples is not None else "sample ids unknown for this loader")
        t.log.warning("resumed at step %d leaving out %d global batches (%s; all in %s/fault.jsonl)", step, batches,
                      named, t.run_dir)

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
        out: dict[str, Any] = {"rollbacks": self.rollbacks + self.replays, "replays": self.replays,
                               "left_out_batches": self.data_offset, "stragglers": sorted(self.named_stragglers),
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
