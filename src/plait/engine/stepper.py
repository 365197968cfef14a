"""One optimizer step's mechanics behind ``Plait.backward``, ``forward_backward`` and ``step``: micro-steps
through the strategy inside the accumulation window, loss scaling, then at the window's end the gradient
synchronisation, clipping and update, the schedule, the step's record and the agreement of every rank on
the loss and on a stop request."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

from plait.comm.accounting import TorchCollectiveCounter
from plait.comm.auto import AutoCompress
from plait.comm.collectives import Comm, CommStats
from plait.comm.watchdog import StepWatchdog
from plait.components.optim import hyperparameters, set_hyperparameters
from plait.components.precision import LossScaler
from plait.components.rng import RngStream
from plait.config import Config
from plait.data.resumable import checkpoint_state
from plait.engine.run_files import RunFiles
from plait.engine.step_info import StepInfo
from plait.engine.window import AccumulationWindow
from plait.fault.preempt import PreemptionFlag
from plait.observe.log import get_logger
from plait.observe.memory import measure_model_state_bytes
from plait.parallel.expert.dispatch import MoeMonitor
from plait.parallel.strategy import PlaitError, Strategy


class StepperAttribute:
    """A read-only attribute of ``Plait`` kept by its stepper."""

    def __init__(self, name: str, doc: str) -> None:
        self.name, self.__doc__ = name, doc

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.stepper, self.name)


class Stepper:
    """The step state of one ``Plait`` (its counters, the loss scaler, the MoE monitor, the measured
    model-state bytes) and the step itself (see the module docstring)."""

    def __init__(self, config: Config, rank: int, world_size: int, comm: Comm, watchdog: StepWatchdog,
                 files: RunFiles, preemption: PreemptionFlag, group: Any, auto: AutoCompress | None,
                 at_boundary: Callable[[], None], prometheus: Any = None, rng: RngStream | None = None) -> None:
        self.config, self.rank, self.world_size = config, rank, world_size
        self.comm, self.watchdog, self.files, self.preemption, self.group, self.auto = (
            comm, watchdog, files, preemption, group, auto)
        self.at_boundary = at_boundary  # work due at every step boundary (completing an asynchronous save)
        self.prometheus = prometheus  # this rank's Prometheus exporter (None: off)
        self.rng = rng  # the model's random stream (plait.components.rng): forward_backward draws from it
        self.logger = get_logger(rank)
        self.window = AccumulationWindow(config.grad_accum)
        self.scaler = LossScaler(enabled=config.train.precision == "fp16")
        self.strategy: Strategy | None = None
        self.moe: MoeMonitor | None = None  # when the model has MoE layers
        self.scheduler: Any = None
        self.steps = self.skipped_steps = 0
        self.saved_step: int | None = None
        self.resumed_from = 0
        self.memory: dict[str, int] = {}
        self.shares: list[int] | None = None
        self._boundary_t = time.perf_counter()
        self._counter: TorchCollectiveCounter | None = None
        self._torch_bytes: int | None = None
        self.in_window = False
        self.announced: int | None = None  # the accumulation last logged

    # -- micro-steps ---------------------------------------------------------------------------------
    def enter_window(self) -> None:
        """The watchdog's phase is this step's forward/backward (after another phase ran between steps)."""
        if not self.in_window:
            self.in_window = True
            self.watchdog.enter(self.steps + 1, "forward/backward")

    def begin_micro(self) -> float:
        """Bookkeeping before a micro-step's backward; returns the loss's scale (loss scale / accumulation)."""
        self.enter_window()
        self.announce()
        self.strategy.set_sync(self.window.begin())
        return self.scaler.scale / self.window.accumulation

    def announce(self) -> None:
        """Log the accumulation the steps run with, once (again only if a new loader changes it): it comes from
        ``train.micro_batch_size`` or the batch size of the loader ``setup_dataloader`` made, never unseen."""
        n = self.window.accumulation
        if self.announced == n:
            return
        self.announced = n
        t, dp = self.config.train, self.strategy.topo.dp
        self.logger.info("global batch %d = %d samples per micro-step x dp %d x %d micro-step%s per optimizer step",
                         t.global_batch_size, t.global_batch_size // (dp * n), dp, n, "" if n == 1 else "s")

    def end_micro(self, loss: torch.Tensor) -> None:
        self.window.end(loss)
        self.strategy.set_sync(self.window.sync_gradients)  # DDP reads it in the next forward

    def weight(self, num_samples: int | None) -> float:
        """With uneven shares (``Plait.set_shares``) a micro-batch's mean loss counts in proportion to its
        samples: ``num_samples`` / the even micro-batch, so the averaged gradient is the global batch's mean."""
        if self.shares is None or num_samples is None:
            return 1.0
        dp = self.strategy.topo.dp
        return num_samples * dp * self.window.accumulation / self.config.train.global_batch_size

    def backward(self, loss: torch.Tensor, num_samples: int | None) -> None:
        """Backward of a loss the user's own forward computed."""
        with self.strategy.context():
            scale = self.begin_micro() * self.weight(num_samples)
            if self.moe is not None:  # the auxiliary losses get the main loss's scale in this backward
                self.moe.set_grad_scale(scale)
            t0 = time.perf_counter()
            self.strategy.backward(loss, scale)
            self.window.times["backward_s"] += time.perf_counter() - t0
            self.end_micro(loss)

    def forward_backward(self, model: Any, batch: Any, loss: Any, num_samples: int | None) -> torch.Tensor:
        """Forward, loss and backward of one micro-batch through the strategy; returns the loss, detached."""
        self.enter_window()
        with self.strategy.context(), self.rng.active() if self.rng is not None else contextlib.nullcontext():
            scale = self.begin_micro() * self.weight(num_samples)
            before: Callable[[float], None] | None = self.moe.set_grad_scale if self.moe is not None else None
            value = self.strategy.forward_backward(model, batch, loss, scale, before, self.window.times)
            self.end_micro(value)
        return value

    # -- the step ------------------------------------------------------------------------------------
    def start_step(self) -> None:
        """Open the next step: phase, comm counters, and the torch-collective counter when it counts."""
        self.comm.stats.reset()
        self.comm.step = self.steps + 1  # named by a collective timeout
        self.in_window = False
        self.enter_window()
        counting = self.strategy is not None and self.strategy.torch_collectives
        mode = self.config.observe.count_torch_collectives if counting else "off"
        if mode == "every_step" or (mode == "first_step" and self._torch_bytes is None):
            self._counter = TorchCollectiveCounter(CommStats())
            self._counter.__enter__()

    def step(self) -> StepInfo | None:
        """See ``Plait.step``."""
        strategy = self.strategy
        if not self.window.complete:
            return None
        self._slow_down_for_tests()
        t0 = time.perf_counter()
        strategy.finish()
        exposed = time.perf_counter() - t0
        self.watchdog.enter(self.steps + 1, "optimizer")
        self.in_window = False
        t1 = time.perf_counter()
        clip = self.config.optim.grad_clip if self.config.optim.grad_clip > 0 else float("inf")
        target = strategy.scheduler_target()
        lr = float(target.param_groups[0]["lr"]) if target is not None and target.param_groups else float("nan")
        norm, stepped = strategy.clip_and_step(clip, self.scaler, self._measure_memory_once)
        if stepped and self.scheduler is not None:
            self.scheduler.step()
        if not stepped:
            self.skipped_steps += 1
            self.logger.warning("step %d: gradient norm is %s; update skipped", self.steps + 1, norm)
        self.scaler.update(not stepped)
        strategy.after_step()
        moe = self.moe.after_step(self.steps + 1) if self.moe is not None else None
        strategy.zero_grad()
        self.at_boundary()
        now = time.perf_counter()
        info = self._finish_step(norm, not stepped, lr, exposed, now - t1, now - self._boundary_t)
        info.moe = moe
        info.strategy_metrics = strategy.step_metrics()
        if self.prometheus is not None:
            self.prometheus.step_done(vars(info))
        self._boundary_t = now
        self.start_step()
        return info

    def _slow_down_for_tests(self) -> None:
        """Testing aid (``fault.slow_rank``): a slower worker, as on mixed hardware."""
        f = self.config.fault
        if self.rank == f.slow_rank and f.slow_factor > 1:
            times = self.window.times
            extra = (f.slow_factor - 1) * (times["forward_s"] + times["backward_s"])
            time.sleep(extra)
            times["backward_s"] += extra  # it stands for slower compute

    def _measure_memory_once(self) -> None:
        """Parameters, reduced gradients and optimizer states all exist only just before an update, from
        the second one on: measure what this rank holds once."""
        if not self.memory and getattr(self.strategy.optimizer, "state", None):
            opts = self.strategy.optimizers
            self.memory = measure_model_state_bytes(self.strategy.model, opts if len(opts) > 1 else opts[0])

    def _finish_step(self, norm: float, skipped: bool, lr: float, exposed: float, optimizer_s: float,
                     step_s: float) -> StepInfo:
        self.steps += 1
        stats = self.comm.stats
        self.stop_counting()
        if self._torch_bytes is not None:
            stats.bytes_sent += self._torch_bytes
        losses, times = self.window.close()
        # The pipeline's loss exists on the last stage only: the strategy brings it to every stage.
        loss = float(self.strategy.reduce_loss(torch.stack(losses).mean())) if losses else float("nan")
        global_loss, preempted = self._agree(loss)
        info = StepInfo(step=self.steps, loss=loss, grad_norm=norm, skipped=skipped, lr=lr,
                        comm_bytes=stats.bytes_sent, comm_wait_s=stats.wait_s, comm_exposed_s=exposed,
                        optimizer_s=optimizer_s, step_s=step_s, **times, global_loss=global_loss,
                        preempted=preempted)
        self.write_progress()
        if self.auto is not None and self.auto.observe(self.steps, exposed, step_s, stats.bytes_sent, stats.wait_s):
            decision = self.auto.decide(self.comm, self.strategy.topo.dp_group)
            self.logger.info("comm.compress=auto after step %d: %s", self.steps, decision["reason"])
        return info

    def stop_counting(self) -> None:
        """End the torch-collective counter of this step, if one runs, keeping its figure."""
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._torch_bytes = self._counter.stats.bytes_sent
            self._counter = None

    def _agree(self, loss: float) -> tuple[float, bool]:
        """What every rank must see alike at a step boundary: the loss averaged over the data-parallel
        replicas and whether any rank was asked to stop. Communication: one all-reduce of two numbers
        over the training ranks (every rank of a replica holds the replica's loss, so the sum / their
        number is the mean over replicas), where the strategy has its ranks meet at every step."""
        t = torch.tensor([loss, float(self.preemption.requested)], dtype=torch.float64)
        meet, group = self.strategy.agreement_group(self.group)
        if self.world_size > 1 and meet:
            self.comm.all_reduce_sum(t, group, name="step agreement")
            t[0] /= self.world_size
        return float(t[0]), bool(t[1] > 0)

    def write_progress(self) -> None:
        """Rank 0 notes how far the run got, for the launcher's restart decision (``plait.fault.restart``)."""
        self.files.write_progress(self.steps, self.saved_step, self.resumed_from)

    # -- checkpoints -------------------------------------------------------------------------------------
    def run_state(self, scheduler: Any, dataloader: Any) -> dict[str, Any]:
        """What a checkpoint keeps of the run besides the strategy's tensors: the schedule, the loader's
        position, the loss scale, the step counters, the optimizer's hyperparameters, the compression choice."""
        sched = scheduler or self.scheduler
        return {"scheduler": sched.state_dict() if sched is not None else None,
                "dataloader": checkpoint_state(dataloader, self.group) if dataloader is not None else None,
                "scaler": self.scaler.state_dict(), "steps": self.steps, "skipped_steps": self.skipped_steps,
                "micro": self.window.micro, "param_groups": hyperparameters(self.strategy.scheduler_target()),
                "auto": self.auto.state_dict() if self.auto is not None else None}

    def restore(self, shared: dict[str, Any], scheduler: Any, dataloader: Any, path: Any) -> None:
        """The inverse of ``run_state`` (the strategy's tensors are already loaded)."""
        target = self.strategy.scheduler_target()
        set_hyperparameters(target, shared.get("param_groups"))
        sched = scheduler or self.scheduler
        if sched is not None and shared.get("scheduler") is not None:
            sched.load_state_dict(shared["scheduler"])
            if hasattr(sched, "get_last_lr"):  # the optimizer's lr is the one the schedule reached
                for g, lr in zip(target.param_groups, sched.get_last_lr(), strict=False):
                    g["lr"] = lr
        if dataloader is not None:
            if shared.get("dataloader") is None:
                raise PlaitError(f"{path} holds no data-loader position (it was saved without dataloader=)")
            dataloader.load_state_dict(shared["dataloader"])
        self.scaler.load_state_dict(shared["scaler"])
        self.steps, self.skipped_steps = int(shared["steps"]), int(shared["skipped_steps"])
        self.resumed_from = self.steps  # the launcher's no-progress rule compares where attempts started
        if self.auto is not None and shared.get("auto") is not None:
            self.auto.load_state_dict(shared["auto"])
