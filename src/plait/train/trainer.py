"""The training loop: one optimizer step = accumulation micro-steps, gradient reduction, clipping, update.

Every worker runs ``train(cfg, run_dir, resume)``. Timings of each phase go into ``metrics.jsonl``;
``comm_exposed_s`` is the time spent waiting for gradient communication after backward finished,
the part that overlap did not hide.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait.comm.accounting import TorchCollectiveCounter
from plait.comm.auto import AUTO_COMPRESSOR, AutoCompress
from plait.comm.collectives import Comm, CommStats
from plait.comm.guard import CollectiveGuard
from plait.comm.watchdog import StepWatchdog
from plait.config import Config
from plait.data.corpus import load_splits
from plait.data.sampler import WindowSampler, validation_batches
from plait.launch import error_file
from plait.models.gpt import GPT
from plait.observe.log import get_logger
from plait.observe.metrics import MetricsWriter, ProgressBar
from plait.parallel.apply import apply_parallel
from plait.plan.memory import measure_model_state_bytes
from plait.topology import Topology, build_topology
from plait.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from plait.train.export import export_safetensors
from plait.train.optim import lr_at
from plait.train.precision import LossScaler, autocast


@dataclass
class StepTimes:
    data_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    comm_exposed_s: float = 0.0
    optimizer_s: float = 0.0


@dataclass
class RunState:
    step: int = 0
    skipped_steps: int = 0
    last_loss: float = float("nan")
    val_loss: float = float("nan")
    tokens_seen: int = 0
    train_seconds: float = 0.0


def select_device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def set_determinism(cfg: Config) -> None:
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def build_comm(cfg: Config, rank: int, world_size: int) -> Comm:
    """The comm layer from ``comm.*``: algorithm, compression, and (with several ranks) the hang guard
    on the default process group's store, so every rank's arrivals are visible to the others."""
    c = cfg.comm
    guard = None
    if world_size > 1 and dist.is_initialized():
        guard = CollectiveGuard(dist.distributed_c10d._get_default_store(), c.timeout_s, rank)
    comm = Comm(c.allreduce, ranks_per_node=c.ranks_per_node or None, guard=guard)
    if c.compress != "none":
        name = AUTO_COMPRESSOR if c.compress == "auto" else c.compress
        comm.set_compression(name, active=c.compress != "auto", ratio=c.compress_ratio,
                             powersgd_rank=c.powersgd_rank, error_feedback=c.error_feedback,
                             stochastic_rounding=c.stochastic_rounding and name in ("int8", "int4"),
                             seed=cfg.train.seed)
    return comm


def build_watchdog(cfg: Config, topo: Topology, run_dir: Path) -> StepWatchdog:
    """The step watchdog (``plait.comm.watchdog``) on the default group's store: bounds the waits in
    the collectives PyTorch issues for the layout (DTensor, pipeline P2P, FSDP2, DCP), which
    ``Comm``'s guard does not see. Inert on one process."""
    store = None
    if topo.world_size > 1 and dist.is_initialized():
        store = dist.distributed_c10d._get_default_store()
    z = cfg.parallel.zero
    kinds = [name for name, used in (("tensor-parallel", topo.degree("tp") > 1), ("pipeline", topo.degree("pp") > 1),
                                     ("expert", topo.degree("ep") > 1), ("FSDP", z == 3), ("ZeRO", z in (1, 2)),
                                     ("data-parallel", topo.dp > 1 and z == 0)) if used]
    return StepWatchdog(store, cfg.comm.timeout_s, topo.rank, topo.world_size, error_file(run_dir, topo.rank),
                        "/".join(kinds))


class Trainer:
    """Builds everything from the config and runs the loop on one worker."""

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.device = select_device()
        set_determinism(cfg)
        self.topo: Topology = build_topology(cfg, self.device)
        self.rank0 = self.topo.rank == 0
        self.log = get_logger(self.topo.rank)
        self.comm = build_comm(cfg, self.topo.rank, self.topo.world_size)
        self.watchdog = build_watchdog(cfg, self.topo, run_dir)
        self.watchdog.enter(0, "setup")
        self.auto = AutoCompress() if cfg.comm.compress == "auto" and self.topo.dp > 1 else None
        self._torch_bytes: int | None = None  # bytes of the collectives torch issued in the counted step
        splits = load_splits(cfg.data.path, cfg.model.vocab_size, cfg.data.val_fraction, cfg.model.seq_len)
        self.log.info("data: %s, %d train / %d val tokens", splits.source, len(splits.train), len(splits.val))
        t = cfg.train
        self.sampler = WindowSampler(splits.train, cfg.model.seq_len, t.global_batch_size, t.micro_batch_size,
                                     self.topo.dp_rank, self.topo.dp, t.seed)
        self.val_batches = validation_batches(splits.val, cfg.model.seq_len, t.micro_batch_size,
                                              t.eval_sequences, self.topo.dp_rank, self.topo.dp)
        torch.manual_seed(t.seed)  # identical initial weights on every rank
        model = GPT(cfg.model).to(self.device)
        self.model = model
        self.num_params = model.num_params()
        self.layout = apply_parallel(model, self.topo, cfg, self.comm, self.sampler.peek()[0])
        self.optimizer = self.layout.optimizer
        self.scaler = LossScaler(enabled=t.precision == "fp16")
        # zero=3 runs forward in bf16 through FSDP2's mixed-precision policy instead of autocast.
        self.use_autocast = not (cfg.parallel.zero == 3 and t.precision == "bf16")
        self.memory: dict[str, Any] = {}
        # Dropout streams per model replica and pipeline stage; tensor-parallel ranks (tp is the innermost
        # axis) share one, so replicated activations get one mask (see plait.parallel.tensor).
        torch.manual_seed(t.seed + 7919 * (self.topo.rank // self.topo.degree("tp") + 1))
        self.state = RunState()
        self.metrics = MetricsWriter(run_dir, self.rank0, cfg.observe.tensorboard)
        self.log.info("model: %.2fM parameters, world %d, dp %d x accumulation %d, precision %s",
                      self.num_params / 1e6, self.topo.world_size, self.topo.dp, cfg.grad_accum, t.precision)

    # -- checkpoints -------------------------------------------------------------------------------
    def resume(self) -> None:
        path = latest_checkpoint(self.run_dir)
        if path is None:
            return
        self.watchdog.enter(self.state.step, "checkpoint load")
        meta = load_checkpoint(path, self.layout, self.topo.rank)
        self.sampler.load_state_dict(meta["sampler"])
        self.scaler.load_state_dict(meta["scaler"])
        for k in ("step", "skipped_steps", "tokens_seen", "train_seconds"):
            setattr(self.state, k, meta[k])
        if meta["rank_state"] is not None:  # compressor residuals: the resumed run continues exactly
            self.comm.load_state_dict(meta["rank_state"]["comm"])
            if self.auto is not None and meta["rank_state"].get("auto") is not None:
                self.auto.load_state_dict(meta["rank_state"]["auto"])
        self.log.info("resumed from %s at step %d", path, self.state.step)

    def save(self) -> None:
        s = self.state
        self.watchdog.enter(s.step, "checkpoint save")
        meta = {"sampler": self.sampler.state_dict(), "scaler": self.scaler.state_dict(),
                "skipped_steps": s.skipped_steps, "tokens_seen": s.tokens_seen,
                "train_seconds": s.train_seconds, "world_size": self.topo.world_size}
        rank_state = {"comm": self.comm.state_dict(), "auto": self.auto.state_dict() if self.auto else None}
        path = save_checkpoint(self.run_dir, s.step, self.layout, meta, self.topo.rank, self.cfg.checkpoint.keep,
                               rank_state)
        self.log.info("checkpoint saved: %s", path)

    # -- one step ----------------------------------------------------------------------------------
    def _amp(self) -> contextlib.AbstractContextManager:
        return autocast(self.cfg.train.precision, self.device, self.use_autocast)

    def _forward_backward(self, batches: list, times: StepTimes) -> float:
        """Run the accumulation micro-steps; returns this rank's mean loss over them."""
        n = len(batches)
        factor = self.scaler.scale / n
        total = torch.zeros((), dtype=torch.float64)
        acc = {"forward_s": 0.0, "backward_s": 0.0}
        for i, (x, y) in enumerate(batches):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with self.layout.no_sync() if i < n - 1 else contextlib.nullcontext():
                total += self.layout.forward_backward(x, y, factor, self._amp, acc).double().cpu() / n
        times.forward_s, times.backward_s = acc["forward_s"], acc["backward_s"]
        return float(self.layout.reduce_loss(total))

    def _apply_update(self, lr: float) -> float:
        """Unscale, clip, and step unless the gradients hold NaN/inf; returns the gradient norm."""
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.scaler.unscale(self.layout.grads())
        clip = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        norm = self.layout.clip_grad_norm(clip)
        if math.isfinite(norm):
            if not self.memory and self.optimizer.state:
                # Parameters, reduced gradients and optimizer states all exist only here, from the
                # second update on: measure what this rank holds once.
                self.memory = measure_model_state_bytes(self.layout.model, self.optimizer)
            self.optimizer.step()
        else:
            self.state.skipped_steps += 1
            self.log.warning("step %d: gradient norm is %s; update skipped", self.state.step, norm)
        self.scaler.update(not math.isfinite(norm))
        self.layout.zero_grad()
        return norm

    def train_step(self) -> dict[str, Any]:
        times = StepTimes()
        t_start = time.perf_counter()
        self.comm.stats.reset()
        self.comm.step = self.state.step + 1  # named by a collective timeout
        self.watchdog.enter(self.comm.step, "forward/backward")
        batches = self.sampler.next_batch()
        times.data_s = time.perf_counter() - t_start
        # Collectives torch issues (DDP, FSDP2, DTensor, pipelining) go into the same stats: counted
        # on this process's first step (or every step), then that step's figure is added.
        mode = self.cfg.observe.count_torch_collectives if self.layout.torch_collectives else "off"
        counter = None
        if mode == "every_step" or (mode == "first_step" and self._torch_bytes is None):
            counter = TorchCollectiveCounter(CommStats())
        with counter if counter is not None else contextlib.nullcontext():
            loss = self._forward_backward(batches, times)
            t0 = time.perf_counter()
            self.layout.finish()
            times.comm_exposed_s = time.perf_counter() - t0
            lr = lr_at(self.state.step, self.cfg.optim, self.cfg.train.steps)
            t0 = time.perf_counter()
            self.watchdog.enter(self.comm.step, "optimizer")
            norm = self._apply_update(lr)
            times.optimizer_s = time.perf_counter() - t0
        step_s = time.perf_counter() - t_start
        tokens = self.cfg.train.global_batch_size * self.cfg.model.seq_len
        self.state.step += 1
        self.state.tokens_seen += tokens
        self.state.train_seconds += step_s
        stats = self.comm.stats
        if counter is not None:
            self._torch_bytes = counter.stats.bytes_sent
        if mode != "off":
            stats.bytes_sent += self._torch_bytes
        rec = {"step": self.state.step, "loss": loss, "lr": lr, "grad_norm": norm,
               "tokens_per_s": tokens / step_s, "step_s": step_s, **times.__dict__,
               "comm_bytes": stats.bytes_sent, "comm_wait_s": stats.wait_s}
        if self.auto is not None and self.auto.observe(self.state.step, times.comm_exposed_s, step_s,
                                                       stats.bytes_sent, stats.wait_s):
            decision = self.auto.decide(self.comm, self.topo.dp_group)
            self.log.info("comm.compress=auto after step %d: %s", self.state.step, decision["reason"])
        return rec

    # -- evaluation --------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over the fixed validation set (all data-parallel ranks together)."""
        self.watchdog.enter(self.state.step, "evaluate")
        self.layout.module.eval()
        acc = torch.zeros(2, dtype=torch.float64)  # (sum of per-sequence mean losses, sequences)
        for x, y in self.val_batches:
            loss = self.layout.evaluate(x.to(self.device), y.to(self.device), self._amp)
            acc[0] += float(self.layout.reduce_loss(loss.double().cpu())) * len(x)
            acc[1] += len(x)
        self.layout.module.train()
        acc = self._dp_sum(acc)
        return float(acc[0] / acc[1].clamp(min=1))

    def _dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.topo.dp > 1:
            self.comm.all_reduce_sum(t, self.topo.dp_group)
        return t

    def _mean_over_dp(self, value: float) -> float:
        return float(self._dp_sum(torch.tensor([value], dtype=torch.float64))[0]) / self.topo.dp

    # -- the loop ----------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        cfg, s = self.cfg, self.state
        bar = ProgressBar(cfg.train.steps, s.step, self.rank0 and cfg.observe.progress)
        try:
            while s.step < cfg.train.steps:
                rec = self.train_step()
                last = s.step == cfg.train.steps
                if s.step % cfg.train.log_every == 0 or last or s.step == 1:
                    self.watchdog.enter(s.step, "loss logging")
                    rec["loss"] = self._mean_over_dp(rec["loss"])
                    s.last_loss = rec["loss"]
                    if cfg.train.eval_every and s.step % cfg.train.eval_every == 0 and not last:
                        rec["val_loss"] = s.val_loss = self.evaluate()
                        self.log.info("step %d: train loss %.4f, val loss %.4f", s.step, rec["loss"],
                                      s.val_loss)
                    self.metrics.log(rec)
                    bar.update(s.step, rec["loss"], rec["tokens_per_s"])
                if cfg.checkpoint.every and s.step % cfg.checkpoint.every == 0 and not last:
                    self.save()
        finally:
            bar.close()
        return self.finish()

    # -- memory ------------------------------------------------------------------------------------
    def _memory_summary(self) -> dict[str, Any]:
        """Per-rank lists (index = global rank) of predicted and measured model-state bytes and peak bytes."""
        from plait.plan.memory import peak_memory_bytes, predict_model_state_bytes

        precision = "bf16" if self.cfg.train.precision != "fp32" else "fp32"
        predicted = None
        if self.topo.degree("tp") == self.topo.degree("pp") == 1:  # the model covers data parallel + ZeRO
            predicted = predict_model_state_bytes(self.num_params, stage=self.cfg.parallel.zero, dp=self.topo.dp,
                                                  precision=precision)
        mine = {"predicted": predicted, "measured": self.memory or None, "peak_bytes": peak_memory_bytes(self.device)}
        ranks = [mine]
        if dist.is_initialized():
            ranks = [None] * self.topo.world_size
            dist.all_gather_object(ranks, mine)
        return {
            "predicted_model_state_bytes": [r["predicted"]["total"] if r["predicted"] else None for r in ranks],
            "measured_model_state_bytes": [r["measured"]["total"] if r["measured"] else None for r in ranks],
            "peak_bytes": [r["peak_bytes"] for r in ranks],
            "breakdown": ranks,
        }

    def _comm_summary(self) -> dict[str, Any]:
        c = self.cfg.comm
        out: dict[str, Any] = {"comm": {"allreduce": c.allreduce, "compress": c.compress,
                                        "compress_active": self.comm.compress_active}}
        if self.auto is not None:
            out["comm_auto"] = self.auto.decision or {
                "decision": "undecided", "reason": f"the run ended before the measurement window "
                f"(steps {self.auto.first}-{self.auto.last}) was complete; compression stayed off"}
        return out

    def finish(self) -> dict[str, Any]:
        s = self.state
        self.watchdog.enter(s.step, "report")
        layout_report = self.layout.report(self.run_dir)  # before evaluation, which runs forward passes
        s.val_loss = self.evaluate()
        self.metrics.log({"step": s.step, "val_loss": s.val_loss})
        self.save()
        self.watchdog.enter(s.step, "export")
        full = self.layout.full_model_state()
        if self.rank0:
            export_safetensors(full, self.run_dir / "model.safetensors")
        summary = {
            "final_train_loss": s.last_loss, "final_val_loss": s.val_loss, "steps": s.step,
            "tokens_per_s": s.tokens_seen / s.train_seconds if s.train_seconds else 0.0,
            "total_seconds": s.train_seconds, "world_size": self.topo.world_size, "dp": self.topo.dp,
            "skipped_steps": s.skipped_steps, "num_params": self.num_params, "precision": self.cfg.train.precision,
            "zero": self.cfg.parallel.zero, "memory": self._memory_summary(), **layout_report,
            **self._comm_summary(),
        }
        if self.rank0:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        self.metrics.close()
        return summary


def train(cfg: Config, run_dir: Path, resume: bool = False) -> dict[str, Any]:
    """Train on this worker (process group already initialized when there are several)."""
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    trainer = Trainer(cfg, run_dir)
    try:
        if resume:
            trainer.resume()
        summary = trainer.fit()
        if dist.is_initialized():
            dist.barrier()
    except Exception as e:
        named = trainer.watchdog.explain(e)  # a backend timeout becomes the error naming the late ranks
        if named is e:
            raise
        raise named from e
    finally:
        trainer.watchdog.close()
    trainer.comm.close()  # not on failure: after a timeout its thread may be stuck in a receive
    return summary

