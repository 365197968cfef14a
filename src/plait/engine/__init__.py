"""``plait.Plait``: the keep-your-loop API. One typed config chooses the layout; the loop stays the user's.

    p = plait.Plait("run.toml")                    # or Plait(parallel={"zero": 2}), or a plait.Config
    model, optimizer = p.setup(model, optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-4))
    loader = p.setup_dataloader(dataset)
    for batch in loader:
        loss = loss_fn(model(batch["x"]), batch["y"])
        p.backward(loss)                          # accumulation, loss scaling, no sync on early micro-steps
        info = p.step()                           # unscale, clip, skip non-finite, step, schedule, zero
    p.save("ckpt", model=model, optimizer=optimizer, dataloader=loader)

It starts the process group itself under ``plait run``, ``torchrun`` or SLURM, and runs as a plain
single process otherwise. ``Plait`` is a facade: the layout is a strategy chosen from the config
(``plait.parallel.registry``: data parallelism, ZeRO, FSDP2, tensor, pipeline, expert, a parameter server,
or one registered by the user) and the engine talks only to its contract (``plait.parallel.strategy``);
beside it are the accumulation window (``window``), the checkpointer (``checkpointer``), the run's files
(``run_files``) and its metrics (``metrics``). ``setup`` builds the optimizer after the layout is applied, so
it holds the parameters the layout trains. The returned model is the user's own object (attribute access
and ``state_dict()`` keys unchanged); under pipeline parallelism it is split over ranks and
``forward_backward(model, batch)`` runs a step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.comm.accounting import TorchCollectiveCounter
from plait.comm.auto import AutoCompress
from plait.comm.collectives import CommStats, comm_from_config
from plait.comm.guard import CollectiveTimeout
from plait.comm.watchdog import StepWatchdog
from plait.config import Config, from_sections, load_config
from plait.data.loader import DeviceLoader, DistributedLoader, is_rank_aware, to_device
from plait.engine.checkpointer import Checkpointer
from plait.engine.metrics import MetricsSink
from plait.engine.run_files import RunFiles
from plait.engine.window import AccumulationWindow
from plait.fault.preempt import PreemptionFlag
from plait.launch import init_distributed, write_error
from plait.nn.moe import moe_layers
from plait.observe.log import get_logger
from plait.parallel import registry
from plait.parallel.apply import ModelSpec
from plait.parallel.expert import MoeMonitor
from plait.parallel.prepare import unwrap_compiled
from plait.parallel.strategy import PlaitError, RankDone, Strategy, check_loss
from plait.parallel.tensor import local_value
from plait.plan.memory import measure_model_state_bytes
from plait.topology import Topology
from plait.train.export import export_safetensors
from plait.train.losses import Loss, infer_loss, resolve_loss
from plait.train.optim import hyperparameters, optimizer_factory, set_hyperparameters
from plait.train.precision import LossScaler
from plait.validate import validate


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
    # (plait.parallel.expert.MoeMonitor); None without MoE and on the steps between reports.
    moe: list[dict[str, Any]] | None = None
    # The strategy's own figures of this step (a parameter server worker's clock, versions, bytes, waits).
    strategy_metrics: dict[str, Any] | None = None

    @property
    def ps(self) -> dict[str, Any] | None:
        """parallel.mode=ps: this worker's clock, shard versions, push/pull bytes and waits (None otherwise)."""
        return self.strategy_metrics or None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _explained(method: Callable) -> Callable:
    """A collective API method whose backend timeout or lost peer becomes the watchdog's error naming the
    phase and the ranks that did not arrive (raised in the user's loop, where no trainer catches it)."""
    import functools

    @functools.wraps(method)
    def wrapper(self: Plait, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as e:
            named = self.explain(e)
            if named is e:
                raise
            raise named from e
    return wrapper


def _config(config: Config | str | Path | None, sections: dict[str, Any]) -> Config:
    if isinstance(config, Config):
        base = config
    elif config is None:
        base = Config()
    elif isinstance(config, str | Path):
        base = load_config(config)
    else:
        raise PlaitError(f"Plait takes a plait.Config, a TOML path or keyword sections; got {type(config).__name__}")
    return from_sections(sections, base)


def select_device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


class Plait:
    """Distributed training for the user's own loop; see the module docstring.

    ``config``: a ``plait.Config``, the path of a TOML file, or None for the defaults; keyword
    ``sections`` (``parallel={"zero": 2}``, ``train=TrainConfig(...)``) are applied on top. The config is
    validated for the world size at once: impossible layouts fail here, before any collective.
    """

    def __init__(self, config: Config | str | Path | None = None, /, **sections: Any) -> None:
        cfg = _config(config, sections)
        if "OMP_NUM_THREADS" in os.environ:
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        init_distributed(cfg.comm.backend, cfg.comm.timeout_s)
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.config = validate(cfg, world, model_checks=False)
        self.device = select_device()
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False
        self._strategy_cls = registry.select(cfg.parallel)
        self.topology: Topology = self._strategy_cls.build_topology(cfg, self.device)
        self.group = self.topology.train_group  # the engine's own collectives run among the training ranks
        self.rank, self.world_size = self.topology.rank, self.topology.world_size
        self.logger = get_logger(self.rank)
        self.files = RunFiles(cfg.run.dir, self.rank, self.world_size)
        cfg.run.dir = str(self.files.run_dir)
        self.comm = comm_from_config(cfg.comm, cfg.train.seed, self.rank, self.world_size)
        self.preemption = PreemptionFlag()
        self.preemption.install()
        self.watchdog = self._build_watchdog()
        self.scaler = LossScaler(enabled=cfg.train.precision == "fp16")
        self.auto = AutoCompress() if cfg.comm.compress == "auto" and self.topology.dp > 1 else None
        self.window = AccumulationWindow(cfg.grad_accum)
        self.checkpointer = Checkpointer(cfg.checkpoint.async_save, self.world_size, self.group, self._saved)
        self.metrics = MetricsSink(self.files.run_dir, cfg, self.is_main)
        self.strategy: Strategy | None = None
        self.moe: MoeMonitor | None = None  # when the model has MoE layers
        self.scheduler: Any = None
        self.loss: Loss | None = None
        self.steps = self.skipped_steps = 0
        self.saved_step: int | None = None
        self.resumed_from = 0
        self.memory: dict[str, int] = {}
        self.shares: list[int] | None = None
        self._boundary_t = time.perf_counter()
        self._counter: TorchCollectiveCounter | None = None
        self._torch_bytes: int | None = None
        self._closed = False
        self._in_window = False

    # -- where things go ---------------------------------------------------------------------------
    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that writes files and logs."""
        return self.rank == 0

    @property
    def dp(self) -> int:
        return self.topology.dp

    @property
    def dp_rank(self) -> int:
        return self.topology.dp_rank

    @property
    def layout(self) -> Strategy | None:
        """The strategy (an older name, kept for scripts that read it)."""
        return self.strategy

    @property
    def model_whole(self) -> bool:
        """Whether the model ``setup`` returns runs whole on each rank (False under pipeline parallelism: it is
        split over ranks, and ``forward_backward`` runs each micro-step)."""
        return self._strategy_cls.model_whole

    @property
    def wants_sample(self) -> bool:
        """Whether ``setup`` uses a ``sample`` micro-batch (to balance pipeline stages by measured cost)."""
        return self._strategy_cls.wants_sample(self.config)

    @property
    def accumulation(self) -> int:
        return self.window.accumulation

    @property
    def run_dir(self) -> Path:
        return self.files.run_dir

    @property
    def error_dir(self) -> Path | None:
        return self.files.error_dir

    @property
    def state_dir(self) -> Path | None:
        return self.files.state_dir

    @property
    def last_save_blocking_s(self) -> float:
        return self.checkpointer.last_blocking_s

    @property
    def finish_blocking_s(self) -> float:
        """Seconds spent completing asynchronous saves since the Trainer last reset it to 0."""
        return self.checkpointer.finish_blocking_s

    @finish_blocking_s.setter
    def finish_blocking_s(self, value: float) -> None:
        self.checkpointer.finish_blocking_s = value

    def _build_watchdog(self) -> StepWatchdog:
        """The step watchdog (``plait.comm.watchdog``): bounds the waits in the collectives PyTorch issues
        for the layout (DTensor, pipeline P2P, FSDP2, DCP), which ``Comm``'s guard does not see."""
        store = dist.distributed_c10d._get_default_store() if self.world_size > 1 else None
        return StepWatchdog(store, self.config.comm.timeout_s, self.rank, self.world_size, self.files.error_path, "")

    def phase(self, name: str) -> None:
        """Name what every rank does next (``"evaluate"``, ``"checkpoint save"``): a rank that waits too
        long for its peers names the phase and the ranks that did not arrive."""
        self.watchdog.enter(self.steps, name)
        self._in_window = False

    # -- setup -------------------------------------------------------------------------------------
    @_explained
    def setup(self, model: nn.Module, optimizer: Any = None, scheduler: Callable[[Any], Any] | None = None, *,
              tp_plan: dict[str, Any] | str | None = None, parallelize_fn: Callable | None = None,
              pp_split: list[str] | None = None, stage_fn: Callable | None = None, loss_fn: Any = None,
              sample: Any = None) -> tuple[nn.Module, Any]:
        """Apply the configured layout to ``model`` and build its optimizer; returns ``(model, optimizer)``.

        ``optimizer``: a factory ``fn(model) -> torch.optim.Optimizer`` called with the returned model
        (the right, possibly sharded, parameters); an optimizer instance that holds no state yet (rebuilt
        over the same parameters, by name, with its class, groups and hyperparameters); or None for AdamW
        from ``[optim]``. ``scheduler``: a factory ``fn(optimizer) -> LR scheduler``, stepped once per
        optimizer step by ``step()``. ``tp_plan`` (patterns -> styles, or "auto") / ``parallelize_fn(model,
        tp_mesh)`` choose tensor parallelism, ``pp_split`` / ``stage_fn(model, stage_index, num_stages)``
        the pipeline split; each overrides the config. ``loss_fn`` (a name, a ``plait.losses.Loss`` or
        ``fn(output, target)``) is what ``forward_backward`` and the pipeline's last stage compute;
        ``sample`` is one micro-batch, used to balance pipeline stages by measured cost.
        """
        self._check_setup_args(model, scheduler)
        self.phase("setup")
        model, compiled = unwrap_compiled(model)
        factory = optimizer_factory(model, optimizer, self.config.optim)
        self._set_loss(model, loss_fn, sample)
        p = self.config.parallel
        spec = ModelSpec(tp_plan=tp_plan if tp_plan is not None else p.tp_plan, parallelize_fn=parallelize_fn,
                         pp_split=list(pp_split if pp_split is not None else p.pp_split), stage_fn=stage_fn,
                         loss=self.loss, sample=self.to_device(sample) if sample is not None else None)
        moe = moe_layers(model)  # the whole model's, the same on every rank (a pipeline stage keeps some)
        self.strategy = strategy = registry.build(self._strategy_cls, model.to(self.device), self.topology,
                                                  self.config, self.comm, spec)
        if moe:
            self.moe = MoeMonitor(strategy.model, self.topology, self.comm, self.config.train.log_every,
                                  bias=any(layer.balance == "bias" for layer in moe))
        opt = strategy.build_optimizer(factory)
        self._start(strategy)
        if scheduler is not None:
            self.scheduler = scheduler(strategy.scheduler_target())
        strategy.wrap_forward(self.device, compiled)
        strategy.set_sync(self.accumulation == 1)  # DDP arms its reducer in the next forward
        # Dropout streams per model replica and pipeline stage; tensor-parallel ranks (tp is the innermost
        # axis) share one, so replicated activations get one mask.
        torch.manual_seed(self.config.train.seed + 7919 * (self.rank // self.topology.degree("tp") + 1))
        self.watchdog.kinds = strategy.describe()
        self._start_step()
        return strategy.model, opt

    def _check_setup_args(self, model: Any, scheduler: Any) -> None:
        if self.strategy is not None:
            raise PlaitError("setup() was already called on this Plait: one Plait trains one model")
        if not isinstance(model, nn.Module):
            raise PlaitError(f"setup() takes a torch.nn.Module; got {type(model).__name__}")
        if scheduler is not None and (not callable(scheduler) or hasattr(scheduler, "step")):
            raise PlaitError("scheduler must be a factory fn(optimizer) -> LR scheduler (plait builds the optimizer "
                             "in setup, so a scheduler made before cannot reference it)")

    def _set_loss(self, model: nn.Module, loss_fn: Any, sample: Any) -> None:
        """The loss ``forward_backward`` computes: ``loss_fn``, or inferred from ``sample`` where the
        strategy computes the loss itself (pipeline parallelism's last stage); compiled with the model."""
        self.loss = resolve_loss(loss_fn)
        if self.config.train.compile:
            from plait.parallel.compile import compile_loss

            # in place: the caller's Loss object runs compiled too
            compile_loss(self.loss, self.config, backend=self.config.train.compile_backend)
        if self.topology.degree("pp") > 1 and self.loss is None:
            if sample is None:
                raise PlaitError("with parallel.pp > 1 the last stage computes the loss: pass loss_fn= to setup "
                                 "(a name such as 'causal_lm', or fn(output, target))")
            self.loss = infer_loss(model, sample)

    def _start(self, strategy: Strategy) -> None:
        """The strategy's start (a parameter server's servers serve there until every worker has finished,
        then end with ``RankDone``: their part of the run is over, and this object is closed)."""
        try:
            strategy.start(self.watchdog.close)
        except RankDone:
            self.close()
            raise
        except BaseException as e:
            write_error(e, self.rank, self.files.error_dir)
            raise

    # -- data --------------------------------------------------------------------------------------
    def setup_dataloader(self, data: Any, batch_size: int | None = None, *, collate_fn: Callable | None = None,
                         shuffle: bool = True, drop_last: bool | None = None, seed: int | None = None,
                         **dataloader_kwargs: Any) -> Any:
        """This rank's share of ``data`` in micro-batches of ``batch_size`` (default
        ``train.micro_batch_size``): a deterministic, resumable loader (``plait.data.loader``).

        ``data`` is a map-style data set or a DataLoader (whose data set, collate function and worker
        settings are kept). A DataLoader whose sampler is already rank-aware (``DistributedSampler``) is
        returned as it is. Training (``shuffle=True``) yields whole global batches of ``batch_size x dp x
        accumulation`` samples, each data-parallel rank a disjoint share; ``shuffle=False`` is for
        evaluation: every sample once (but at most dp-1), the same number of batches on every rank.
        A ``batch_size`` other than the config's changes the accumulation so the global batch stays.
        """
        from torch.utils.data import DataLoader

        if data is None:
            raise PlaitError("setup_dataloader() got None; pass a data set or a DataLoader")
        if isinstance(data, DataLoader):
            if is_rank_aware(data):
                self.logger.info("the DataLoader's sampler is already rank-aware: used as it is (not resumable)")
                return data
            collate_fn = collate_fn or data.collate_fn
            _inherit_loader_settings(data, dataloader_kwargs)
            batch_size = batch_size or data.batch_size
            data = data.dataset
        batch_size = batch_size or self.config.train.micro_batch_size
        accumulation = self._accumulation_for(batch_size) if shuffle else 1
        dataloader_kwargs.setdefault("num_workers", self.config.data.num_workers)
        if self.device.type == "cuda":
            dataloader_kwargs.setdefault("pin_memory", True)
        loader = DistributedLoader(data, batch_size, dp_rank=self.dp_rank, dp_size=self.dp, accumulation=accumulation,
                                   seed=self.config.train.seed if seed is None else seed, shuffle=shuffle,
                                   drop_last=shuffle if drop_last is None else drop_last, collate_fn=collate_fn,
                                   **dataloader_kwargs)
        return loader if self.device.type == "cpu" else DeviceLoader(loader, self.device)

    def _accumulation_for(self, batch_size: int) -> int:
        """Micro-steps per optimizer step with ``batch_size`` per rank (the global batch stays)."""
        t = self.config.train
        per_step = batch_size * self.dp
        if t.global_batch_size % per_step:
            raise PlaitError(f"batch_size={batch_size} x dp={self.dp} does not divide train.global_batch_size="
                             f"{t.global_batch_size}; choose a batch size that divides "
                             f"{t.global_batch_size // self.dp} or change train.global_batch_size")
        accumulation = t.global_batch_size // per_step
        if accumulation != self.accumulation:
            self.logger.info("batch size %d per rank: %d accumulation micro-steps per optimizer step", batch_size,
                             accumulation)
            self.window.accumulation = accumulation
        return accumulation

    def to_device(self, batch: Any) -> Any:
        """``batch`` (tensors in tuples, lists, dicts) moved to this rank's device."""
        return to_device(batch, self.device) if self.device.type != "cpu" else batch

    # -- one step ----------------------------------------------------------------------------------
    def _require_strategy(self) -> Strategy:
        if self.strategy is None:
            raise PlaitError("call p.setup(model, ...) first")
        return self.strategy

    @property
    def sync_gradients(self) -> bool:
        """True when the next ``backward`` is the last micro-step of the accumulation window."""
        return self.window.sync_gradients

    def _enter_window(self) -> None:
        """The watchdog's phase is this step's forward/backward (after another phase ran between steps)."""
        if not self._in_window:
            self._in_window = True
            self.watchdog.enter(self.steps + 1, "forward/backward")

    def _begin_micro(self) -> float:
        """Bookkeeping before a micro-step's backward; returns the loss's scale (loss scale / accumulation)."""
        self._enter_window()
        self._require_strategy().set_sync(self.window.begin())
        return self.scaler.scale / self.accumulation

    def _end_micro(self, loss: torch.Tensor) -> None:
        self.window.end(loss)
        self._require_strategy().set_sync(self.sync_gradients)  # DDP reads it in the next forward

    def _moe_scale(self) -> Callable[[float], None] | None:
        """What sets the MoE layers' auxiliary-loss scale to the main loss's before a backward."""
        return self.moe.set_grad_scale if self.moe is not None else None

    @_explained
    def backward(self, loss: torch.Tensor, num_samples: int | None = None) -> None:
        """Backward of one micro-batch's ``loss`` (a scalar): scaled by loss scale / accumulation, with
        gradient communication only on the last micro-step of the window."""
        strategy = self._require_strategy()
        self.backward_checks(loss)
        with strategy.context():
            scale = self._begin_micro() * self._weight(num_samples)
            if self.moe is not None:  # the auxiliary losses get the main loss's scale in this backward
                self.moe.set_grad_scale(scale)
            t0 = time.perf_counter()
            strategy.backward(loss, scale)
            self.window.times["backward_s"] += time.perf_counter() - t0
            self._end_micro(loss)

    def _weight(self, num_samples: int | None) -> float:
        """With uneven shares (``set_shares``) a micro-batch's mean loss counts in proportion to its samples:
        ``num_samples`` / the even micro-batch, so the averaged gradient is the whole global batch's mean."""
        if self.shares is None or num_samples is None:
            return 1.0
        return num_samples * self.dp * self.accumulation / self.config.train.global_batch_size

    def set_shares(self, loader: Any, shares: list[int] | None) -> None:
        """Give data-parallel rank r ``shares[r]`` samples of every global batch (faster ranks more: see
        ``fault.rebalance``), the same on every rank; losses are weighted so the update equals the even
        split's. ``backward`` then needs ``num_samples`` (``forward_backward`` counts them itself)."""
        loader.set_shares(shares)
        self.shares = list(shares) if shares is not None else None

    @staticmethod
    def backward_checks(loss: Any) -> None:
        """A clear error for a loss that cannot be backpropagated: not a scalar, or not from the model."""
        check_loss(loss)

    @_explained
    def forward_backward(self, model: nn.Module, batch: Any, loss_fn: Any = None) -> torch.Tensor:
        """Forward and backward of one micro-batch with ``loss_fn`` (default: the one given to setup,
        else inferred from the batch); returns this micro-batch's loss, detached. Works for every layout,
        pipeline parallelism included (where it returns 0 on ranks without the last stage)."""
        strategy = self._require_strategy()
        loss = self._loss_for(model, batch, loss_fn)
        weight = self._weight(_batch_size(batch, loss) if self.shares is not None else None)
        batch = self.to_device(batch)
        self._enter_window()
        with strategy.context():
            scale = self._begin_micro() * weight
            value = strategy.forward_backward(model, batch, loss, scale, self._moe_scale(), self.window.times)
            self._end_micro(value)
        return value

    def _loss_for(self, model: nn.Module, batch: Any, loss_fn: Any) -> Loss:
        loss = resolve_loss(loss_fn) if loss_fn is not None else self.loss
        if loss is None:
            loss = self.loss = infer_loss(model, batch)
            self.logger.info("loss: %s (inferred from the first batch)", loss.name)
        return loss

    @_explained
    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch: Any, loss_fn: Any = None) -> torch.Tensor:
        """Mean loss of one batch without gradients (float64 scalar on the CPU), the same on every rank of
        a model replica (pipeline: the last stage's loss brought to every stage)."""
        strategy = self._require_strategy()
        loss = self._loss_for(model, batch, loss_fn)
        value = strategy.evaluate(model, self.to_device(batch), loss)
        return strategy.reduce_loss(local_value(value).detach().double().cpu().reshape(()))

    def _start_step(self) -> None:
        """Open the next step: phase, comm counters, and the torch-collective counter when it counts."""
        self.comm.stats.reset()
        self.comm.step = self.steps + 1  # named by a collective timeout
        self._in_window = False
        self._enter_window()
        strategy = self.strategy
        counting = strategy is not None and strategy.torch_collectives
        mode = self.config.observe.count_torch_collectives if counting else "off"
        if mode == "every_step" or (mode == "first_step" and self._torch_bytes is None):
            self._counter = TorchCollectiveCounter(CommStats())
            self._counter.__enter__()

    @_explained
    def step(self) -> StepInfo | None:
        """At the end of an accumulation window: wait for gradient sync, unscale, clip (``optim.grad_clip``),
        skip the update if the gradients hold NaN/inf, optimizer step, scheduler step, zero grads. Returns
        the step's ``StepInfo``; None between boundaries."""
        strategy = self._require_strategy()
        if not self.window.complete:
            return None
        self._slow_down_for_tests()
        t0 = time.perf_counter()
        strategy.finish()
        exposed = time.perf_counter() - t0
        self.watchdog.enter(self.steps + 1, "optimizer")
        self._in_window = False
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
        self.finish_saves()  # an asynchronous save of the previous steps completes here, on every rank
        now = time.perf_counter()
        info = self._finish_step(norm, not stepped, lr, exposed, now - t1, now - self._boundary_t)
        info.moe = moe
        info.strategy_metrics = strategy.step_metrics()
        self._boundary_t = now
        self._start_step()
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
        strategy = self._require_strategy()
        if not self.memory and getattr(strategy.optimizer, "state", None):
            opts = strategy.optimizers
            self.memory = measure_model_state_bytes(strategy.model, opts if len(opts) > 1 else opts[0])

    def _finish_step(self, norm: float, skipped: bool, lr: float, exposed: float, optimizer_s: float,
                     step_s: float) -> StepInfo:
        self.steps += 1
        stats = self.comm.stats
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._torch_bytes = self._counter.stats.bytes_sent
            self._counter = None
        if self._torch_bytes is not None:
            stats.bytes_sent += self._torch_bytes
        losses, times = self.window.close()
        # The pipeline's loss exists on the last stage only: the strategy brings it to every stage.
        loss = float(self._require_strategy().reduce_loss(torch.stack(losses).mean())) if losses else float("nan")
        global_loss, preempted = self._agree(loss)
        info = StepInfo(step=self.steps, loss=loss, grad_norm=norm, skipped=skipped, lr=lr,
                        comm_bytes=stats.bytes_sent, comm_wait_s=stats.wait_s, comm_exposed_s=exposed,
                        optimizer_s=optimizer_s, step_s=step_s, **times, global_loss=global_loss,
                        preempted=preempted)
        self._write_progress()
        if self.auto is not None and self.auto.observe(self.steps, exposed, step_s, stats.bytes_sent, stats.wait_s):
            decision = self.auto.decide(self.comm, self.topology.dp_group)
            self.logger.info("comm.compress=auto after step %d: %s", self.steps, decision["reason"])
        return info

    def _agree(self, loss: float) -> tuple[float, bool]:
        """What every rank must see alike at a step boundary: the loss averaged over the data-parallel
        replicas and whether any rank was asked to stop. Communication: one all-reduce of two numbers
        over the training ranks (every rank of a replica holds the replica's loss, so the sum / their
        number is the mean over replicas), where the strategy has its ranks meet at every step."""
        t = torch.tensor([loss, float(self.preemption.requested)], dtype=torch.float64)
        meet, group = self._require_strategy().agreement_group(self.group)
        if self.world_size > 1 and meet:
            self.comm.all_reduce_sum(t, group, name="step agreement")
            t[0] /= self.world_size
        return float(t[0]), bool(t[1] > 0)

    @property
    def preempted(self) -> bool:
        """Whether SIGTERM/SIGINT reached this rank (``StepInfo.preempted`` is the agreed value)."""
        return self.preemption.requested

    def _write_progress(self) -> None:
        """Rank 0 notes how far the run got, for the launcher's restart decision (``plait.fault.restart``)."""
        self.files.write_progress(self.steps, self.saved_step, self.resumed_from)

    # -- small collectives --------------------------------------------------------------------------
    def _meet(self) -> None:
        if self.strategy is not None:
            self.strategy.before_collective()

    @_explained
    def reduce(self, value: float | torch.Tensor, op: str = "mean", over: str = "dp") -> Any:
        """``value`` summed or averaged over the data-parallel ranks (``over="dp"``) or all ranks
        (``"world"``); a float for a float. Every rank of the group must call it."""
        if op not in ("mean", "sum") or over not in ("dp", "world"):
            raise PlaitError("reduce(op='mean'|'sum', over='dp'|'world')")
        t = torch.as_tensor(value, dtype=torch.float64).clone().reshape(-1)
        size = self.dp if over == "dp" else self.world_size
        if size > 1:
            self._meet()
            self.comm.all_reduce_sum(t, self.topology.dp_group if over == "dp" else self.group,
                                     name=f"reduce over {over}")
        if op == "mean":
            t /= size
        if isinstance(value, torch.Tensor):
            return t.reshape(value.shape)
        return float(t[0])

    @_explained
    def gather(self, values: list[float]) -> list[list[float]]:
        """Every rank's ``values`` as a list indexed by global rank; every rank must call it with the same
        number of values. Collective over the world: one all-gather of ``len(values)`` float64 per rank."""
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        if self.world_size == 1:
            return [t.tolist()]
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self._meet()
        dist.all_gather(out, t, group=self.group)
        return [o.tolist() for o in out]

    @_explained
    def barrier(self) -> None:
        if self.world_size > 1:
            self._meet()
            dist.barrier(group=self.group)

    # -- state -------------------------------------------------------------------------------------
    @_explained
    def save(self, path: str | Path, *, model: nn.Module | None = None, optimizer: Any = None,
             scheduler: Any = None, dataloader: Any = None, extra: dict[str, Any] | None = None,
             on_complete: Callable[[Path], None] | None = None) -> Path:
        """Save a complete, reshardable checkpoint at ``path`` (collective: every rank calls it).

        Holds the model and optimizer state (DCP shards keyed by the single-process model's names, so
        it loads at another world size or layout), the scheduler, the loader's position, the loss scale,
        every rank's RNG and compressor residuals, and ``extra`` (JSON), with a SHA-256 manifest of every
        file. Written to ``path.tmp`` and renamed when complete: a crash never leaves a half checkpoint
        at ``path``. With ``checkpoint.async`` the shards are written in the background and the
        checkpoint completes at the next optimizer step (or save, or ``close``); ``on_complete(path)``
        then runs on rank 0.
        """
        strategy = self._check_objects(model, optimizer)
        self.finish_saves()
        self.phase("checkpoint save")
        sched = scheduler or self.scheduler
        shared = {"scheduler": sched.state_dict() if sched is not None else None,
                  "dataloader": dataloader.state_dict() if dataloader is not None else None,
                  "scaler": self.scaler.state_dict(), "steps": self.steps, "skipped_steps": self.skipped_steps,
                  "micro": self.window.micro, "param_groups": hyperparameters(strategy.scheduler_target()),
                  "auto": self.auto.state_dict() if self.auto is not None else None}
        meta = {"extra": extra or {}, "world_size": self.world_size, "dp": self.dp,
                "layout": strategy.describe() or "single process", "steps": self.steps}
        return self.checkpointer.save(Path(path), strategy, meta, self.rank, {"comm": self.comm.state_dict()},
                                      shared, self.steps, on_complete, self.is_main)

    def finish_saves(self) -> None:
        """Complete an asynchronous save still being written (collective; nothing when there is none)."""
        if self.checkpointer.pending:
            self.phase("checkpoint save")
            self.checkpointer.finish(self.is_main)

    def _saved(self, path: Path, step: int) -> None:
        self.logger.info("checkpoint saved: %s", path)
        self.saved_step = step
        self._write_progress()

    @_explained
    def load(self, path: str | Path, *, model: nn.Module | None = None, optimizer: Any = None,
             scheduler: Any = None, dataloader: Any = None, verify: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint written by ``save`` (at any world size or layout) into this run's objects;
        returns its ``extra``. Every file is first checked against the checkpoint's manifest
        (``checkpoint.verify``; ``verify`` overrides it): a damaged one raises ``CheckpointError`` naming
        the file. Collective: every rank calls it."""
        strategy = self._check_objects(model, optimizer)
        self.phase("checkpoint load")
        self._meet()
        check = self.config.checkpoint.verify if verify is None else verify
        meta, rank_state, shared, same_world = self.checkpointer.load(Path(path), strategy, self.rank,
                                                                      self.world_size, check)
        set_hyperparameters(strategy.scheduler_target(), shared.get("param_groups"))
        self._restore_scheduler(scheduler or self.scheduler, shared)
        if dataloader is not None:
            if shared.get("dataloader") is None:
                raise PlaitError(f"{path} holds no data-loader position (it was saved without dataloader=)")
            dataloader.load_state_dict(shared["dataloader"])
        self.scaler.load_state_dict(shared["scaler"])
        self.steps, self.skipped_steps = int(shared["steps"]), int(shared["skipped_steps"])
        self.resumed_from = self.steps  # the launcher's no-progress rule compares where attempts started
        strategy.finish_load()
        if rank_state is not None:  # compressor residuals: the resumed run continues exactly
            self.comm.load_state_dict(rank_state["comm"])
        elif not same_world:
            self.logger.info("checkpoint saved at world size %s, loading at %d: per-rank RNG and compressor "
                             "residuals start fresh", meta.get("world_size"), self.world_size)
        if self.auto is not None and shared.get("auto") is not None:
            self.auto.load_state_dict(shared["auto"])
        self.logger.info("loaded %s (step %d)", path, self.steps)
        self._start_step()
        return meta.get("extra", {})

    def _restore_scheduler(self, sched: Any, shared: dict[str, Any]) -> None:
        if sched is None or shared.get("scheduler") is None:
            return
        sched.load_state_dict(shared["scheduler"])
        if hasattr(sched, "get_last_lr"):  # the optimizer's lr is the one the schedule reached
            for g, lr in zip(self._require_strategy().scheduler_target().param_groups, sched.get_last_lr(),
                             strict=False):
                g["lr"] = lr

    def _check_objects(self, model: Any, optimizer: Any) -> Strategy:
        strategy = self._require_strategy()
        if model is not None and model is not strategy.model:
            raise PlaitError("save/load got a model other than the one setup() returned; pass that one")
        if optimizer is not None and optimizer is not strategy.optimizer:
            raise PlaitError("save/load got an optimizer other than the one setup() returned; pass that one")
        return strategy

    @_explained
    def full_state_dict(self, model: nn.Module | None = None, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's weights under its single-process names, unsharded, on the CPU, on every rank
        (``rank0_only``: only rank 0's is sure to be filled, which spares the others the memory).
        Collective: gathers FSDP, tensor-parallel and pipeline shards."""
        strategy = self._check_objects(model, None)
        self.phase("export")
        return {k: v.detach().cpu() for k, v in strategy.full_model_state(rank0_only).items()}

    def export(self, model: nn.Module | None, path: str | Path) -> Path:
        """Write the full weights as safetensors at ``path`` (rank 0 writes; every rank calls it)."""
        full = self.full_state_dict(model, rank0_only=True)
        if self.is_main:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            export_safetensors(full, Path(path))
        self.barrier()
        return Path(path)

    # -- metrics -----------------------------------------------------------------------------------
    def log(self, record: dict[str, Any], step: int | None = None) -> None:
        """Record metrics (rank 0): a line of ``metrics.jsonl``, TensorBoard scalars, the progress bar.
        ``step`` defaults to ``record["step"]``, else the optimizer steps taken."""
        self.metrics.log({"step": step if step is not None else record.get("step", self.steps), **record})

    @_explained
    def truncate_metrics(self, step: int) -> None:
        """Rank 0: drop ``metrics.jsonl`` records of steps after ``step`` (they belong to a timeline a
        restart or a rollback undid), so the file reads as one run."""
        self.metrics.truncate(step)

    def report(self) -> dict[str, Any]:
        """Layout results (pipeline bubble, memory predicted against measured, communication) for a
        summary; collective."""
        strategy = self._require_strategy()
        self.phase("report")
        out: dict[str, Any] = dict(strategy.report(self.run_dir if self.is_main else None, self.memory, self.device))
        c = self.config.comm
        out["comm"] = {"allreduce": c.allreduce, "compress": c.compress, "compress_active": self.comm.compress_active}
        if self.auto is not None:
            out["comm_auto"] = self.auto.decision or {
                "decision": "undecided", "reason": f"the run ended before the measurement window "
                f"(steps {self.auto.first}-{self.auto.last}) was complete; compression stayed off"}
        return out

    def explain(self, exc: BaseException) -> BaseException:
        """A backend timeout or lost peer as the error naming the ranks that did not arrive; the ranks it
        names that run on this host and are stuck (stopped, hung) are ended, so the attempt ends within
        seconds and the restart policy applies (``StepWatchdog.end_stuck_peers``)."""
        named = self.watchdog.explain(exc)
        if isinstance(named, CollectiveTimeout) and named.ranks:
            # This rank's report first: the peers ended next fail at once, and the launcher names the
            # earliest report as the cause.
            write_error(named, self.rank, self.files.error_dir)
            self.watchdog.end_stuck_peers(named.ranks)
        return named

    def close(self) -> None:
        """Stop the watchdog and the comm thread, close metrics files; the process group stays."""
        if self._closed:
            return
        self.finish_saves()
        self._closed = True
        if self.strategy is not None:
            self.strategy.close()  # a parameter server's worker tells the servers it is done
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None
        self.metrics.close()
        self.watchdog.close()
        self.comm.close()
        self.preemption.uninstall()

    def __enter__(self) -> Plait:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _inherit_loader_settings(loader: Any, kwargs: dict[str, Any]) -> None:
    """A DataLoader's worker settings, where the caller did not give them."""
    for key in ("num_workers", "pin_memory", "timeout", "worker_init_fn", "prefetch_factor", "persistent_workers"):
        if key not in kwargs and hasattr(loader, key):
            if key == "prefetch_factor" and loader.num_workers == 0:
                continue
            kwargs[key] = getattr(loader, key)


def _batch_size(batch: Any, loss: Loss) -> int:
    """Samples in a micro-batch: the first dimension of its first input."""
    args, kwargs, _ = loss.split(batch)
    x = args[0] if args else next(iter(kwargs.values()))
    return int(x.shape[0])
