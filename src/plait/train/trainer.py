"""plait's training loop for any model, on the public ``plait.Plait`` API only.

    trainer = plait.Trainer(model=model, train_data=dataset, eval_data=held_out, config="run.toml")
    summary = trainer.fit()

One optimizer step is ``accumulation`` micro-steps of ``Plait.forward_backward`` and one ``Plait.step``.
Every ``train.log_every`` steps a line goes to ``metrics.jsonl`` (and the trackers of ``observe.trackers``
and the progress bar): loss (mean over data-parallel ranks), learning rate, gradient norm, throughput and the time of
each phase; ``comm_exposed_s`` is the time spent waiting for gradient communication after backward
finished, the part that overlap did not hide. Every ``train.eval_every`` steps the evaluation set is
scored, every ``checkpoint.every`` steps a checkpoint is saved (``RUN_DIR/checkpoints/step_N``, the
newest named by ``latest``), and at the end the run is evaluated, saved, exported as ``model/`` (a Hugging
Face directory, written shard by shard: ``plait.checkpoint.weights``) and summarised in ``summary.json``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.components.losses import CausalLMLoss, ClassificationLoss, Loss, infer_loss, resolve_loss
from plait.components.optim import lr_at
from plait.config import Config
from plait.engine import Plait
from plait.fault.recovery import Recovery, leave_out
from plait.observe.ranks import rank_timings


class _EngineCount:
    """``RunState.skipped_steps``: the engine's count (``Plait.skipped_steps``, which reads the non-finite flags
    of the steps since the last log step when looked up), or a number where no engine is attached."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return 0
        value = obj.__dict__.get(self.slot, 0)
        return value() if callable(value) else value

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.slot] = value


@dataclass
class RunState:
    step: int = 0
    skipped_steps: int = _EngineCount()
    last_loss: float = float("nan")
    val_loss: float = float("nan")
    val_accuracy: float = float("nan")
    tokens_seen: int = 0
    samples_seen: int = 0
    train_seconds: float = 0.0


class StepRecord(dict):
    """One step's metrics record (``Trainer.train_step``): the host's figures, and the device's (``loss``,
    ``global_loss``, ``grad_norm``) read when first looked up (``rec["loss"]``) on a step that did not log; at a
    log step they are in it already, read with the rest in one transfer."""

    DEVICE_KEYS = ("loss", "global_loss", "grad_norm")

    def __init__(self, info: Any, **host: Any) -> None:
        super().__init__(**host)
        self.info = info
        if info.logged:
            for k in self.DEVICE_KEYS:
                self[k] = getattr(info, k)

    def __missing__(self, key: str) -> Any:
        if key not in self.DEVICE_KEYS:
            raise KeyError(key)
        value = self[key] = getattr(self.info, key)
        return value

    def __reduce__(self) -> Any:  # pickled (to another process) as the plain dict it holds, values read
        return dict, (dict({k: self[k] for k in self.DEVICE_KEYS}, **self),)


def warmup_cosine(cfg: Config) -> Any:
    """The ``[optim]`` schedule as a scheduler factory: linear warmup, then cosine to ``min_lr_ratio``."""
    o, steps = cfg.optim, cfg.train.steps
    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, o, steps) / o.lr)


def _items(batch: Any, loss: Loss) -> tuple[int, int]:
    """(tokens, samples) of one micro-batch: tokens when the input is a (B, T) tensor of token ids."""
    args, kwargs, _ = loss.split(batch)
    x = args[0] if args else kwargs.get("input_ids", next(iter(kwargs.values()), None))
    if not isinstance(x, torch.Tensor):
        return 0, 0
    tokens = x.numel() if x.dim() == 2 and not x.is_floating_point() else 0
    return tokens, x.size(0)


# Where a rank's in-memory copy came from (plait.engine.host_copies.SOURCES), for the resume's log line
_SOURCE_NAMES = {"own": "its own machine's holder", "peer": "the peer machine's holder",
                 "other": "another machine's holder"}


class Trainer:
    """plait's loop on any model (see the module docstring).

    ``model``: an ``nn.Module``; ``train_data`` / ``eval_data``: map-style data sets or DataLoaders;
    ``loss_fn``: a name (causal_lm, hf, classification), a ``plait.losses.Loss``, ``fn(output, target)``
    or None (``train.loss``, else inferred from the first batch); ``optimizer``: a factory ``fn(model)``
    or an optimizer without state (default: AdamW from ``[optim]``); ``scheduler``: a factory
    ``fn(optimizer)`` (default: ``[optim]``'s warmup and cosine); ``config``: a ``plait.Config``, a TOML
    path or None; ``plait``: an existing ``Plait`` to train with (its config is used). ``setup`` keyword
    arguments (``tp_plan``, ``parallelize_fn``, ``pp_split``, ``stage_fn``) pass through.
    """

    def __init__(self, model: nn.Module, train_data: Any, loss_fn: Any = None, eval_data: Any = None,
                 optimizer: Any = None, scheduler: Any = None, config: Config | str | Path | None = None, *,
                 plait: Plait | None = None, **setup_kwargs: Any) -> None:
        self.p = p = plait if plait is not None else Plait(config)
        self.cfg = cfg = p.config
        self.run_dir = p.run_dir
        self.last_moe: list[dict[str, Any]] | None = None  # the last reported step's per-MoE-layer figures
        self.log = p.logger
        self.rank0 = p.is_main
        if self.rank0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.loader = p.setup_dataloader(train_data)
        self.eval_loader = None
        if eval_data is not None:
            self.eval_loader = p.setup_dataloader(eval_data, shuffle=False, drop_last=not p.model_whole)
        self.loss = resolve_loss(loss_fn if loss_fn is not None else cfg.train.loss)
        # One batch read ahead (and put back) only when something needs it: inferring the loss, measuring
        # pipeline stage costs.
        needs_sample = self.loss is None or p.wants_sample
        sample = self._peek() if needs_sample else None
        self.loss = self.loss or infer_loss(model, sample)
        self.num_params = sum(q.numel() for q in model.parameters())
        self.flops = self._model_flops(model, sample)  # before setup: the user's whole model
        self.model, self.optimizer = p.setup(model, optimizer, scheduler if scheduler is not None else
                                             warmup_cosine(cfg), loss_fn=self.loss, sample=sample, **setup_kwargs)
        self.scheduler = p.scheduler
        # a loss that counts its items (causal LM) weighs every real token of the optimizer step the same; a
        # pipeline's last stage computes it per pipeline micro-batch, and an asynchronous parameter server's workers
        # share no step, so there it stays a mean per micro-batch (Plait.weighs_tokens)
        self.token_weighted = self.loss.counts_items_for(model) and p.weighs_tokens
        # A data set whose every sample holds the same number of counted targets (plait's token windows: no -100)
        # read in whole global batches: this rank's count over a step is known (its samples x targets_per_sample),
        # and so the step's, so nothing is counted or all-reduced per step (the cp ranks of a group read the same
        # samples: the count is the same as at cp = 1, and the context split divides its shard's loss by cp)
        per = getattr(train_data, "targets_per_sample", None)
        self.items_per_step = (cfg.train.global_batch_size // p.dp * per if self.token_weighted and per is not None
                               and isinstance(self.loss, CausalLMLoss) else None)
        self.peak = self._peak()
        self.state = RunState(step=p.steps)  # above 0 where setup joined live replicas at a later step
        self.state.skipped_steps = lambda: p.skipped_steps  # read from the engine only when looked up
        self._it: Any = None
        self.recovery = Recovery(self)
        if self.rank0:
            (self.run_dir / "preempted.json").unlink(missing_ok=True)
        self.log.info("model: %.2fM parameters, world %d, dp %d x accumulation %d, precision %s, loss %s",
                      self.num_params / 1e6, p.world_size, p.dp, p.accumulation, cfg.train.precision, self.loss.name)

    # -- the engine's parts, for inspection ---------------------------------------------------------
    @property
    def layout(self) -> Any:
        return self.p.layout

    @property
    def comm(self) -> Any:
        return self.p.comm

    @property
    def scaler(self) -> Any:
        return self.p.scaler

    @property
    def memory(self) -> dict[str, int]:
        return self.p.memory

    # -- utilisation ------------------------------------------------------------------------------
    def _model_flops(self, model: nn.Module, sample: Any) -> Any:
        """Rank 0 (the rank that logs): the model's FLOPs per token or sample (``plait.train.mfu``)."""
        from plait.train.mfu import formula_flops_per_token, model_flops_per_item

        if not self.rank0:
            return None
        if sample is None and formula_flops_per_token(model) is None:
            sample = self._peek()
        tokens, samples = _items(sample, self.loss) if sample is not None else (0, 0)
        return model_flops_per_item(model, self.loss, sample, tokens, samples)

    def _peak(self) -> Any:
        """Rank 0: one device's peak FLOP/s for this run's precision (measured once per machine on a CPU)."""
        from plait.train.mfu import device_peak

        return device_peak(self.p.device, self.cfg.train.compute_precision) if self.rank0 else None

    def mfu(self, tokens_per_s: float, samples_per_s: float) -> float | None:
        """Model FLOPs utilisation at these rates over all ``world_size`` devices (None off rank 0)."""
        from plait.train.mfu import mfu

        if self.flops is None or self.peak is None:
            return None
        rate = tokens_per_s if self.flops.item == "token" else samples_per_s
        return mfu(self.flops.per_item, rate, self.p.world_size, self.peak.flops)

    # -- data --------------------------------------------------------------------------------------
    def _peek(self) -> Any:
        """The first training micro-batch, without consuming it (loss inference, pipeline costs)."""
        state = self.loader.state_dict()
        batch = next(iter(self.loader))
        self.loader.load_state_dict(state)
        return batch

    def _next_batch(self) -> Any:
        if self._it is None:
            self._it = iter(self.loader)
        try:
            return next(self._it)
        except StopIteration:  # the epoch is over: the loader starts the next one
            self._it = iter(self.loader)
            return next(self._it)

    # -- checkpoints -------------------------------------------------------------------------------
    def resume(self) -> bool:
        """Continue from the run directory's newest good checkpoint (damaged ones, and those of loss-spike
        steps, are skipped with a warning naming the problem); False when it has none."""
        from plait.checkpoint.integrity import newest_good

        if self.p.steps > 0:  # setup joined live replicas (fault.mode=replicas): their state is newer than any save
            self.log.info("joined the live replicas at step %d: their state, not a checkpoint, is continued",
                          self.p.steps)
            return True
        if self._resume_from_memory():
            return True
        t0 = time.perf_counter()
        found = newest_good(self.run_dir, check=self.cfg.checkpoint.verify)
        for path, problems in found.skipped.items():
            self.log.warning("checkpoint %s skipped: %s", path, "; ".join(problems))
        if found.path is None:
            self._truncate_metrics(0)
            return False
        self.load_checkpoint(found.path)
        self.log.info("resumed from %s at step %d in %.2fs (disk)", found.path, self.state.step,
                      time.perf_counter() - t0)
        return True

    def _resume_from_memory(self) -> bool:
        """``fault.memory_checkpoint``: load the newest checkpoint from the holders' copies when every rank finds its
        copy of it, whole (the disk's newest complete checkpoint, not a loss spike's), in its own machine's holder
        or a peer machine's; else say why not."""
        from plait.checkpoint.dcp import step_dir
        from plait.checkpoint.integrity import checkpoints_newest_first, spike_steps

        holders = self.p.checkpointer.host_copy
        if holders is None:
            return False
        newest = next((int(q.name.split("_")[1]) for q in checkpoints_newest_first(self.run_dir)
                       if (q / "meta.json").is_file() and int(q.name.split("_")[1]) not in spike_steps(self.run_dir)),
                      None)
        t0 = time.perf_counter()
        held = self.p.memory_copy(lambda step: step == newest)
        if held is None:
            if newest is not None and self.rank0:
                self.log.warning("no whole in-memory copy of step %d on every rank (holder %s): loading from disk",
                                 newest, holders.address)
            return False
        self.load_checkpoint(step_dir(self.run_dir, held.step), memory=held)
        where = ", ".join(f"{n} rank{'s' * (n > 1)} from {_SOURCE_NAMES[k]}" for k, n in held.ranks_from.items() if n)
        self.log.info("resumed at step %d from host memory (%s; holder %s) in %.2fs; the disk copy was not read",
                      self.state.step, where, holders.address, time.perf_counter() - t0)
        return True

    def load_checkpoint(self, path: Path, memory: Any = None) -> None:
        """Every state a checkpoint holds, and the data window to leave out after it (see Recovery). ``memory``:
        the in-memory copy of it every rank found (``Plait.memory_copy``), read instead of the disk."""
        t0 = time.perf_counter()
        extra = self.p.load(path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                            dataloader=self.loader, memory=memory.decoded if memory is not None else None)
        for k, v in extra.items():
            if hasattr(self.state, k) and k != "skipped_steps":  # the engine restored its own count
                setattr(self.state, k, type(getattr(self.state, k))(v))
        self.recovery.load(extra.get("recovery"))
        skip = self.recovery.resumed_at(self.state.step)
        if skip:  # a rollback's window: left out again on every load of this checkpoint (see Recovery)
            self.recovery.skipped(self.state.step, leave_out(self.loader, skip, self.p.accumulation), skip)
        self._it = None
        self._truncate_metrics(self.state.step)
        source = {"source": "memory", "ranks_from": memory.ranks_from} if memory is not None else {"source": "disk"}
        self.recovery.ledger.record("resume", step=self.state.step, load_s=time.perf_counter() - t0,
                                    skipped_batches=skip, **source)

    def _truncate_metrics(self, step: int) -> None:
        """Metrics of steps after ``step`` belong to a timeline that was undone (a crash, a rollback)."""
        if self.rank0:
            self.p.truncate_metrics(step)

    def save(self) -> Path:
        from plait.checkpoint.dcp import point_latest, step_dir

        s = self.state
        extra = {"step": s.step, "skipped_steps": s.skipped_steps, "tokens_seen": s.tokens_seen,
                 "samples_seen": s.samples_seen, "train_seconds": s.train_seconds, "recovery": self.recovery.state()}
        keep = self.cfg.checkpoint.keep
        path = self.p.save(step_dir(self.run_dir, s.step), model=self.model, optimizer=self.optimizer,
                           scheduler=self.scheduler, dataloader=self.loader, extra=extra,
                           on_complete=lambda done: point_latest(self.run_dir, done, keep))
        self.recovery.saved(self.p.last_save_blocking_s)
        self.p.barrier()
        return path

    # -- one step ----------------------------------------------------------------------------------
    def logs_at(self, step: int) -> bool:
        """Whether step ``step`` reads its values: it is logged (step 1, every ``train.log_every``-th, the last)
        or a checkpoint is saved after it (the spike detector judges before any save)."""
        cfg = self.cfg.train
        last = step == cfg.steps
        return step == 1 or step % cfg.log_every == 0 or last or self.recovery.should_save(step, last)

    def train_step(self, log: bool | None = None) -> dict[str, Any]:
        """One optimizer step over ``accumulation`` micro-batches; returns its metrics record (a ``StepRecord``).
        ``log``: whether the step reads and agrees on its values (default: ``logs_at``); a step that does not
        reads nothing from the device unless the record's ``loss``, ``global_loss`` or ``grad_norm`` is looked up."""
        p = self.p
        log = self.logs_at(self.state.step + 1) if log is None else log
        t_start = time.perf_counter()
        tokens, samples, info = 0, 0, None
        # The step's micro-batches are read first: the loss divides by the real tokens of all of them (over every
        # data-parallel rank), known before the first backward (plait.components.losses: token weighting)
        batches = [self._next_batch() for _ in range(p.accumulation - p.window.micro)]
        data_s = time.perf_counter() - t_start
        if self.items_per_step is not None:
            items = p.num_items_known(self.items_per_step)
        else:
            items = p.num_items_in_batch(batches, self.loss) if self.token_weighted else None
        for batch in batches:
            n_tok, n_smp = _items(batch, self.loss)
            tokens, samples = tokens + n_tok, samples + n_smp
            p.forward_backward(self.model, batch, self.loss, items)
            info = p.step(log)
        assert info is not None, "the accumulation window did not close"
        step_s = time.perf_counter() - t_start
        if p.finish_blocking_s:  # an asynchronous save completed in this step: its wait is blocking time
            self.recovery.save_done(p.finish_blocking_s)
            p.finish_blocking_s = 0.0
        s = self.state
        s.step = info.step
        tokens, samples = tokens * p.dp, samples * p.dp
        s.tokens_seen += tokens
        s.samples_seen += samples
        s.train_seconds += step_s
        rec = StepRecord(info, step=info.step, lr=info.lr, preempted=info.preempted)
        if info.history is not None:  # a log step: every step since the previous one, for the spike detector
            rec["history"] = info.history
        if tokens:
            rec["tokens_per_s"] = tokens / step_s
        rec.update({"samples_per_s": samples / step_s, "step_s": step_s, "data_s": data_s,
                    "forward_s": info.forward_s, "backward_s": info.backward_s,
                    "comm_exposed_s": info.comm_exposed_s, "optimizer_s": info.optimizer_s,
                    "comm_bytes": info.comm_bytes, "comm_wait_s": info.comm_wait_s})
        util = self.mfu(tokens / step_s, samples / step_s)
        if util is not None:
            rec["mfu"] = util
        if info.moe is not None:
            rec["moe"] = info.moe
        if info.strategy_metrics:  # e.g. a parameter server worker's clock, versions, bytes and waits
            rec.update(info.strategy_metrics)
            self.last_moe = info.moe
        if p.prometheus is not None:  # what the engine's step does not see: data wait and throughput
            p.prometheus.set_values({"data_s": data_s, "tokens_per_s": rec.get("tokens_per_s")})
        return rec

    # -- evaluation --------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the evaluation set (all data-parallel ranks together); also sets the accuracy
        for classification. NaN without an evaluation set."""
        if self.eval_loader is None:
            return float("nan")
        p = self.p
        p.phase("evaluate")
        self.model.train(False)
        acc = torch.zeros(4, dtype=torch.float64)  # (sum of per-sample mean losses, samples, correct, counted)
        classify = isinstance(self.loss, ClassificationLoss) and p.model_whole
        with p.evaluation():  # the weights the ranks agree on (DiLoCo: the last synchronisation's)
            for batch in self.eval_loader:
                _, n = _items(batch, self.loss)
                if classify:
                    args, kwargs, target = self.loss.split(p.to_device(batch))
                    out = self.model(*args, **kwargs)
                    value = self.loss.loss(out, target).double().cpu()
                    acc[2] += float((out.argmax(-1) == target).sum())
                    acc[3] += n
                else:
                    value = p.evaluate(self.model, batch, self.loss)
                acc[0] += float(value) * n
                acc[1] += n
        self.model.train(True)
        acc = p.reduce(acc, op="sum")
        if acc[3] > 0:
            self.state.val_accuracy = float(acc[2] / acc[3])
        return float(acc[0] / acc[1].clamp(min=1))

    # -- the loop ----------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to ``train.steps`` (from where a resumed run stopped); returns the summary."""
        cfg, s, p = self.cfg, self.state, self.p
        try:
            while s.step < cfg.train.steps:
                rec = self.train_step()
                if self.recovery.after_step(rec):
                    continue  # rolled back: this step and the ones since the checkpoint are undone
                preempted = rec.pop("preempted")
                last = s.step == cfg.train.steps
                rec.pop("history", None)
                if s.step % cfg.train.log_every == 0 or last or s.step == 1:
                    p.phase("loss logging")
                    rec["loss"] = s.last_loss = rec.pop("global_loss")
                    rec.update(rank_timings(p, rec))  # every rank's step parts: a slow rank stands out
                    rec.update(self.recovery.ranks(rec))
                    # A preempted rank's grace is for saving (an evaluation could outlast it).
                    if cfg.train.eval_every and s.step % cfg.train.eval_every == 0 and not last and not preempted:
                        rec["val_loss"] = s.val_loss = self.evaluate()
                        self.log.info("step %d: train loss %.4f, val loss %.4f", s.step, rec["loss"], s.val_loss)
                    p.log(rec)
                if preempted:  # after logging: the step is done and saved, and the resumed run starts after it
                    self._preempted()
                if self.recovery.should_save(s.step, last):
                    self.save()
            return self.finish()
        except Exception as e:
            self.recovery.ledger.flush()  # the steps' goodput events kept since the last log step
            named = p.explain(e)  # a backend timeout becomes the error naming the late ranks
            if named is e:
                raise
            raise named from e

    def _preempted(self) -> None:
        """SIGTERM/SIGINT reached some rank: every rank saves at this step and stops (exit code 75)."""
        from plait.fault.preempt import Preempted

        path = self.save()
        self.p.finish_saves()
        if self.rank0:
            (self.run_dir / "preempted.json").write_text(json.dumps({"step": self.state.step, "checkpoint": str(path)}))
        self.recovery.ledger.record("preempted", step=self.state.step)  # counted apart from failures
        self.p.barrier()
        if self.rank0:
            self.log.warning("preempted at step %d: saved %s", self.state.step, path)
        raise Preempted(self.state.step, str(path))

    def finish(self) -> dict[str, Any]:
        s, p = self.state, self.p
        report = p.report()  # before evaluation, which runs forward passes (the pipeline's last timeline)
        s.val_loss = self.evaluate()
        record = {"step": s.step, "val_loss": s.val_loss}
        if not math.isnan(s.val_accuracy):
            record["val_accuracy"] = s.val_accuracy
        p.log(record)
        self.save()
        p.export(self.model, self.run_dir / "model")
        summary = {
            "final_train_loss": s.last_loss, "final_val_loss": s.val_loss, "steps": s.step,
            "tokens_per_s": s.tokens_seen / s.train_seconds if s.train_seconds else 0.0,
            "samples_per_s": s.samples_seen / s.train_seconds if s.train_seconds else 0.0,
            "total_seconds": s.train_seconds, "world_size": p.world_size, "dp": p.dp,
            "skipped_steps": s.skipped_steps, "num_params": self.num_params, "precision": self.cfg.train.precision,
            "zero": self.cfg.parallel.zero, "loss": self.loss.name, **report, **self.recovery.summary(),
        }
        if self.flops is not None and self.peak is not None:
            summary.update(mfu=self.mfu(summary["tokens_per_s"], summary["samples_per_s"]),
                           model_flops_per_item=self.flops.per_item, flops_item=self.flops.item,
                           flops_source=self.flops.source, peak_flops_per_device=self.peak.flops,
                           peak_source=self.peak.source)
        self.recovery.ledger.record("end")
        if self.rank0:
            from plait.fault import goodput

            summary["goodput"] = goodput.goodput(self.run_dir)
            summary.update({k: summary["goodput"].get(k, 0) for k in ("preemptions", "failures")})
        if not math.isnan(s.val_accuracy):
            summary["final_val_accuracy"] = s.val_accuracy
        if self.last_moe is not None:
            summary["moe"] = self.last_moe
        if self.rank0:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        p.barrier()
        p.close()
        if self.rank0 and self.cfg.observe.report:  # after close: metrics.jsonl is complete
            from plait.observe.report import report_at_end

            report_at_end(self.run_dir, self.log)
        return summary
