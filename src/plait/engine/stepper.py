"""One optimizer step's mechanics behind ``Plait.backward``, ``forward_backward`` and ``step``: micro-steps
through the layout inside the accumulation window, loss scaling, then at the window's end the gradient
synchronisation, clipping and update, the schedule, the step's record and the agreement of every rank on
the loss and on a stop request.

The hot path is sacred (DESIGN.md, rule 11): a step that does not log reads nothing from the device, writes
no file and runs no collective beyond the gradients' own. Its loss, gradient norm and non-finite flag stay on
the device (``StepInfo`` reads one when the caller does); the update of a non-finite step is skipped on the
device by optimizers that take torch's ``found_inf`` (``Layout.clip_and_step``). A log step (step 1, every
``train.log_every``-th, the last of ``train.steps``, or ``step(log=True)``) reads every value since the previous
one in one transfer and, over several ranks, agrees on the losses and on a stop request in one all-reduce:
a SIGTERM is seen by every rank at the first log step after it arrived. Where steps are slow, that could outlast
a scheduler's grace period (30 s by default under SLURM and Kubernetes): each agreement also averages the ranks'
step time, and every rank derives from it the same number of steps between stop checks, ``STOP_CHECK_S`` of
them at most (one all-reduce of one flag, read back): a stop request is seen within ``train.log_every - 1`` steps
and within ``STOP_CHECK_S`` seconds or the next step boundary, whichever comes first. With steps faster than
``STOP_CHECK_S / train.log_every`` (0.5 s at the default 20 s and 10 steps: the benchmarks, the tests) there is no
check between log steps. ``progress.json`` (the launcher's
restart decision) is written at log steps, saves, loads, errors and the first step after a load, and at least
every ``PROGRESS_EVERY_S`` seconds otherwise (checked with a clock read at each step boundary): after an error
plait reports it is exact; after a kill (SIGKILL, a crash of the process) it lags the step count by at most
``train.log_every - 1`` steps or that interval, whichever is shorter."""

from __future__ import annotations

import collections
import contextlib
import functools
import statistics
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
from plait.parallel.capabilities import agreement
from plait.parallel.errors import PlaitError
from plait.parallel.expert.dispatch import MoeMonitor
from plait.parallel.layout import Layout
from plait.parallel.tensor.plan import local_value

PROGRESS_EVERY_S = 30.0  # progress.json at least this often between log steps (a clock read per step, no I/O)
STOP_CHECK_S = 20.0  # a stop request is seen within this (or the next step boundary), however slow the steps


class _Pending:
    """What one step left on the device until the next log step reads it (see the module docstring)."""

    __slots__ = ("step", "loss", "norm", "skipped", "step_s")

    def __init__(self, step: int, loss: torch.Tensor | None, norm: Any, skipped: Any, step_s: float) -> None:
        self.step, self.loss, self.norm, self.skipped, self.step_s = step, loss, norm, skipped, step_s


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
                 at_boundary: Callable[[], None], prometheus: Any = None, rng: RngStream | None = None,
                 device: torch.device | None = None, topology: Any = None) -> None:
        self.config, self.rank, self.world_size = config, rank, world_size
        self.comm, self.watchdog, self.files, self.preemption, self.group, self.auto = (
            comm, watchdog, files, preemption, group, auto)
        self.at_boundary = at_boundary  # work due at every step boundary (completing an asynchronous save)
        self.prometheus = prometheus  # this rank's Prometheus exporter (None: off)
        self.rng = rng  # the model's random stream (plait.components.rng): forward_backward draws from it
        self.logger = get_logger(rank)
        self.device = device if device is not None else torch.device("cpu")
        self.topology = topology  # the engine's: its dp counts the ranks that read different batches
        self.window = AccumulationWindow(config.grad_accum)
        self.scaler = LossScaler(enabled=config.train.precision == "fp16", device=self.device)
        self.clip = config.optim.grad_clip if config.optim.grad_clip > 0 else float("inf")
        self.log_every = max(1, config.train.log_every)
        self.layout: Layout | None = None
        self.moe: MoeMonitor | None = None  # when the model has MoE layers
        self.scheduler: Any = None
        self.steps = 0
        self._skipped = 0  # skipped updates up to the last log step; the pending ones are read on demand
        self._pending: list[_Pending] = []  # steps since the last log step, their values still on the device
        self._progress_t = time.monotonic()
        self._check_every = 0  # steps between stop checks off log steps (0: none), agreed at the last log step
        self._next_check = 0
        self.saved_step: int | None = None
        self.resumed_from = 0
        self.memory: dict[str, int] = {}
        self.shares: list[int] | None = None
        self._boundary_t = time.perf_counter()
        self._counter: TorchCollectiveCounter | None = None
        self._torch_bytes: int | None = None
        self.in_window = False
        self.announced: int | None = None  # the accumulation last logged
        self._recent_compute: collections.deque[float] = collections.deque(maxlen=5)  # fault.slow_rank's base

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
        self.layout.set_sync(self.window.begin())
        return self.scaler.loss_factor() / self.window.accumulation

    def announce(self) -> None:
        """Log the accumulation the steps run with, once (again only if a new loader changes it): it comes from
        ``train.micro_batch_size`` or the batch size of the loader ``setup_dataloader`` made, never unseen."""
        n = self.window.accumulation
        if self.announced == n:
            return
        self.announced = n
        t, dp = self.config.train, self._data_ranks()
        self.logger.info("global batch %d = %d samples per micro-step x dp %d x %d micro-step%s per optimizer step",
                         t.global_batch_size, t.global_batch_size // (dp * n), dp, n, "" if n == 1 else "s")

    def end_micro(self, loss: torch.Tensor) -> None:
        self.window.end(local_value(loss))  # tensor parallelism's loss is a (replicated) DTensor
        self.layout.set_sync(self.window.sync_gradients)  # DDP reads it in the next forward

    def weight(self, num_samples: int | None) -> float:
        """With uneven shares (``Plait.set_shares``) a micro-batch's mean loss counts in proportion to its
        samples: ``num_samples`` / the even micro-batch, so the averaged gradient is the global batch's mean."""
        if self.shares is None or num_samples is None:
            return 1.0
        dp = self._data_ranks()
        return num_samples * dp * self.window.accumulation / self.config.train.global_batch_size

    def _data_ranks(self) -> int:
        """The ranks that read different batches (the layout's dp also counts context-parallel ranks)."""
        return (self.topology or self.layout.topo).dp

    def backward(self, loss: torch.Tensor, num_samples: int | None) -> None:
        """Backward of a loss the user's own forward computed."""
        scale = self.begin_micro() * self.weight(num_samples)
        if self.moe is not None:  # the auxiliary losses get the main loss's scale in this backward
            self.moe.set_grad_scale(scale)
        t0 = time.perf_counter()
        self.layout.backward(loss, scale)  # under the layout's context (tensor parallelism's loss parallelism)
        self.window.times["backward_s"] += time.perf_counter() - t0
        self.end_micro(loss)

    def forward_backward(self, model: Any, batch: Any, loss: Any, num_samples: int | None) -> torch.Tensor:
        """Forward, loss and backward of one micro-batch through the layout; returns the loss, detached."""
        self.enter_window()
        rng = self.rng.for_model(model.training) if self.rng is not None else contextlib.nullcontext()
        with rng:
            scale = self.begin_micro() * self.weight(num_samples)
            before: Callable[[float], None] | None = self.moe.set_grad_scale if self.moe is not None else None
            value = self.layout.forward_backward(model, batch, loss, scale, before, self.window.times)
            self.end_micro(value)
        return value

    # -- the step ------------------------------------------------------------------------------------
    def start_step(self) -> None:
        """Open the next step: phase, comm counters, and the torch-collective counter when it counts."""
        self.comm.stats.reset()
        self.comm.step = self.steps + 1  # named by a collective timeout
        self.in_window = False
        self.enter_window()
        counting = self.layout is not None and self.layout.torch_collectives
        mode = self.config.observe.count_torch_collectives if counting else "off"
        if mode == "every_step" or (mode == "first_step" and self._torch_bytes is None):
            self._counter = TorchCollectiveCounter(CommStats())
            self._counter.__enter__()

    @property
    def skipped_steps(self) -> int:
        """Updates skipped for a non-finite gradient norm (reading it reads the steps since the last log step)."""
        return self._skipped + sum(bool(p.skipped) for p in self._pending)

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped, self._pending = int(value), []

    def is_log_step(self, step: int) -> bool:
        """Step 1, every ``train.log_every``-th and the last of ``train.steps``: the steps whose values are read."""
        return step == 1 or step % self.log_every == 0 or step == self.config.train.steps

    def step(self, log: bool | None = None) -> StepInfo | None:
        """See ``Plait.step``."""
        layout = self.layout
        if not self.window.complete:
            return None
        self._slow_down_for_tests()
        t0 = time.perf_counter()
        layout.finish()
        exposed = time.perf_counter() - t0
        self.watchdog.enter(self.steps + 1, "optimizer")
        self.in_window = False
        t1 = time.perf_counter()
        lr = self._lr(layout.scheduler_target())
        norm, skipped = layout.clip_and_step(self.clip, self.scaler, self._measure_memory_once)
        if skipped is True:  # decided on the host: say so now (a device flag is read at the next log step)
            self.logger.warning("step %d: gradient norm is %s; update skipped", self.steps + 1, norm)
        if self.scheduler is not None:  # every step, skipped or not: the host does not know which yet
            self.scheduler.step()
        self.scaler.update(skipped)
        # the step's MoE bias moves before the layout's step boundary, where a driver's quorum may hand this state
        # to a replacement (fault.mode=replicas)
        moe = self.moe.after_step(self.steps + 1) if self.moe is not None else None
        layout.after_step()
        layout.zero_grad()
        self.at_boundary()
        now = time.perf_counter()
        info = self._finish_step(norm, skipped, lr, exposed, now - t1, now - self._boundary_t, log)
        info.moe = moe
        info.strategy_metrics = layout.step_metrics()
        if self.prometheus is not None:
            self.prometheus.step_done(self._exported(info))
        self._boundary_t = now
        self.start_step()
        return info

    @staticmethod
    def _lr(target: Any) -> Any:
        """The first group's learning rate: a float, or a copy of a tensor one (the scheduler changes it in place)."""
        if target is None or not target.param_groups:
            return float("nan")
        lr = target.param_groups[0]["lr"]
        return lr.detach().clone() if isinstance(lr, torch.Tensor) else float(lr)

    @staticmethod
    def _exported(info: StepInfo) -> dict[str, Any]:
        """What the Prometheus exporter gets: the step's host figures, and at a log step the values read."""
        out = {k: getattr(info, k) for k in ("step", "comm_exposed_s", "optimizer_s", "step_s", "forward_s",
                                             "backward_s")}
        if info.logged:
            out.update(loss=info.loss, grad_norm=info.grad_norm,
                       skipped=sum(bool(h["skipped"]) for h in info.history or ()))
        return out

    def _slow_down_for_tests(self) -> None:
        """Testing aid (``fault.slow_rank``): a slower worker, as on mixed hardware. The extra time is scaled from
        the median compute time of the last 5 steps, not this step's alone: a loaded machine can stall one step for
        seconds, which ``slow_factor`` would multiply (a 3.4 s stall made one step of a test at slow_factor 40 last
        132 s). A stop request cuts the extra time short: one slowed step could otherwise outlast the grace the agent
        gives a stopped worker to save."""
        f = self.config.fault
        if self.rank == f.slow_rank and f.slow_factor > 1:
            times = self.window.times
            self._recent_compute.append(times["forward_s"] + times["backward_s"])
            extra = (f.slow_factor - 1) * statistics.median(self._recent_compute)
            start = time.monotonic()
            while not self.preemption.requested and (left := start + extra - time.monotonic()) > 0:
                time.sleep(min(left, 0.1))
            times["backward_s"] += time.monotonic() - start  # it stands for slower compute

    def _measure_memory_once(self) -> None:
        """Parameters, reduced gradients and optimizer states all exist only just before an update, from
        the second one on: measure what this rank holds once."""
        if not self.memory and getattr(self.layout.optimizer, "state", None):
            opts = self.layout.optimizers
            self.memory = measure_model_state_bytes(self.layout.model, opts if len(opts) > 1 else opts[0])

    def _finish_step(self, norm: Any, skipped: Any, lr: Any, exposed: float, optimizer_s: float, step_s: float,
                     log: bool | None) -> StepInfo:
        self.steps += 1
        stats = self.comm.stats
        self.stop_counting()
        if self._torch_bytes is not None:
            stats.bytes_sent += self._torch_bytes
        losses, times = self.window.close()
        loss = (losses[0] if len(losses) == 1 else torch.stack(losses).mean()) if losses else None
        if loss is not None and self.layout.reduce_loss_every_step:  # a pipeline: the last stage's, everywhere
            loss = self.layout.reduce_loss(loss)
        self._pending.append(_Pending(self.steps, loss, norm, skipped, step_s))
        info = StepInfo(step=self.steps, lr=lr, comm_bytes=stats.bytes_sent, comm_wait_s=stats.wait_s,
                        comm_exposed_s=exposed, optimizer_s=optimizer_s, step_s=step_s, **times)
        if self.is_log_step(self.steps) if log is None else log:
            self._settle(info)
            info.comm_bytes, info.comm_wait_s = stats.bytes_sent, stats.wait_s  # the agreement's wait counts too
        else:  # the values stay on the device; reading one of them is the caller's request
            own = loss if loss is not None else float("nan")
            info.loss, info.grad_norm, info.skipped = own, norm, skipped
            meet, group = agreement(self.layout, self.group)
            if self.world_size == 1 or not meet:  # nothing to agree on: this rank's own values
                info.global_loss, info.preempted = own, self.preemption.requested
            else:  # agreed only if read (a collective then: every rank reads it)
                info.global_loss = functools.partial(self._agree_loss, own, group)
                if self._check_every and self.steps >= self._next_check:  # slow steps: the stop request's bound
                    info.preempted = self._check_stop(group)
        # the first step of an attempt too: the launcher's no-progress rule compares where attempts got
        first = self.steps == self.resumed_from + 1
        if info.logged or first or time.monotonic() - self._progress_t >= PROGRESS_EVERY_S:
            self.write_progress()
        if self.auto is not None and self.auto.observe(self.steps, exposed, step_s, stats.bytes_sent, stats.wait_s):
            decision = self.auto.decide(self.comm, self.layout.topo.group("dp_cp"))
            self.logger.info("comm.compress=auto after step %d: %s", self.steps, decision["reason"])
        return info

    def _settle(self, info: StepInfo) -> None:
        """A log step: the values of every step since the previous one, agreed and read in one go. Over several
        ranks the losses (brought to every pipeline stage by the layout) are averaged over the replicas, a stop
        request and the step times summed: one all-reduce over the training ranks, where the layout has them
        meet (every rank of a replica holds the replica's loss, so the sum / their number is the mean over
        replicas)."""
        pending, self._pending = self._pending, []
        n = len(pending)
        f64 = {"dtype": torch.float64, "device": self.device}
        nan = torch.full((), float("nan"), **f64)
        local = torch.stack([nan if p.loss is None else p.loss.to(**f64) for p in pending])
        if not self.layout.reduce_loss_every_step:
            local = self.layout.reduce_loss(local)
        meet, group = agreement(self.layout, self.group)
        met = self.world_size > 1 and meet
        mine = torch.tensor([float(self.preemption.requested), sum(p.step_s for p in pending)], **f64)
        agreed = torch.cat([local, mine])
        if met:
            self.comm.all_reduce_sum(agreed, group, name="step agreement")
            agreed /= self.world_size
        norms = torch.stack([torch.as_tensor(p.norm).to(**f64) for p in pending])
        flags = torch.stack([torch.as_tensor(p.skipped).to(**f64) for p in pending])
        values = torch.cat([local, agreed, norms, flags]).tolist()  # the one device-to-host read since the last
        own, agreed_losses, (stop, step_s) = values[:n], values[n:2 * n], values[2 * n:2 * n + 2]
        norms, flags = values[-2 * n:-n], values[-n:]
        if met:
            self._plan_stop_checks(step_s / n)
        info.history = [{"step": p.step, "loss": own[i], "global_loss": agreed_losses[i], "grad_norm": norms[i],
                         "skipped": flags[i] > 0} for i, p in enumerate(pending)]
        for p, h in zip(pending, info.history, strict=True):
            finite = h["grad_norm"] == h["grad_norm"] and abs(h["grad_norm"]) != float("inf")
            if not h["skipped"] and not finite:  # optim.skip_nonfinite: the optimizer could not skip it for free
                self.logger.warning("step %d: gradient norm is %s; the update was applied (optim.skip_nonfinite=%s: "
                                    "set it true to skip such steps)", p.step, h["grad_norm"],
                                    self.config.optim.skip_nonfinite)
            if h["skipped"] and not isinstance(p.skipped, bool):  # a host decision was logged at its step
                if h["grad_norm"] == h["grad_norm"] and abs(h["grad_norm"]) != float("inf"):  # not the norm's doing
                    self.logger.warning("step %d: update skipped by the layout (gradient norm %s, finite)", p.step,
                                        h["grad_norm"])
                else:
                    self.logger.warning("step %d: gradient norm is %s; update skipped", p.step, h["grad_norm"])
        self._skipped += sum(h["skipped"] for h in info.history)
        last = info.history[-1]
        info.loss, info.global_loss, info.grad_norm = last["loss"], last["global_loss"], last["grad_norm"]
        info.skipped, info.preempted, info.logged = last["skipped"], stop > 0, True

    def _plan_stop_checks(self, step_s: float) -> None:
        """Steps between stop checks until the next log step, from the mean step time the ranks agreed on (so
        every rank checks at the same steps): none when ``train.log_every`` steps take under ``STOP_CHECK_S``."""
        every = max(1, int(STOP_CHECK_S / max(step_s, 1e-9)))
        self._check_every = every if every < self.log_every else 0
        self._next_check = self.steps + every

    def _check_stop(self, group: Any) -> bool:
        """Whether any rank was asked to stop: one all-reduce of one flag, read back (steps too slow for the log
        steps alone to bound how late a stop request is seen)."""
        self._next_check = self.steps + self._check_every
        t = torch.full((1,), float(self.preemption.requested), dtype=torch.float64, device=self.device)
        self.comm.all_reduce_sum(t, group, name="stop check")
        return float(t[0]) > 0

    def _agree_loss(self, loss: torch.Tensor | float, group: Any) -> float:
        """``StepInfo.global_loss`` read off a log step: this step's loss averaged over the replicas now (one
        all-reduce of one number over the training ranks; every rank must read it)."""
        t = torch.as_tensor(loss).to(dtype=torch.float64, device=self.device).reshape(1).clone()
        self.comm.all_reduce_sum(t, group, name="global_loss read")
        return float(t[0]) / self.world_size

    def stop_counting(self) -> None:
        """End the torch-collective counter of this step, if one runs, keeping its figure."""
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._torch_bytes = self._counter.stats.bytes_sent
            self._counter = None

    def write_progress(self) -> None:
        """Rank 0 notes how far the run got, for the launcher's restart decision (``plait.fault.restart``)."""
        self._progress_t = time.monotonic()
        self.files.write_progress(self.steps, self.saved_step, self.resumed_from)

    # -- checkpoints -------------------------------------------------------------------------------------
    def run_state(self, scheduler: Any, dataloader: Any) -> dict[str, Any]:
        """What a checkpoint keeps of the run besides the layout's tensors: the schedule, the loader's
        position, the loss scale, the step counters, the optimizer's hyperparameters, the compression choice."""
        sched = scheduler or self.scheduler
        return {"scheduler": sched.state_dict() if sched is not None else None,
                "dataloader": checkpoint_state(dataloader, self.group) if dataloader is not None else None,
                "scaler": self.scaler.state_dict(), "steps": self.steps, "skipped_steps": self.skipped_steps,
                "micro": self.window.micro, "param_groups": hyperparameters(self.layout.scheduler_target()),
                "auto": self.auto.state_dict() if self.auto is not None else None}

    def restore(self, shared: dict[str, Any], scheduler: Any, dataloader: Any, path: Any) -> None:
        """The inverse of ``run_state`` (the layout's tensors are already loaded)."""
        target = self.layout.scheduler_target()
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
        self.steps, self.skipped_steps = int(shared["steps"]), int(shared["skipped_steps"])  # pending ones dropped
        self.resumed_from = self.steps  # the launcher's no-progress rule compares where attempts started
        if self.auto is not None and shared.get("auto") is not None:
            self.auto.load_state_dict(shared["auto"])
