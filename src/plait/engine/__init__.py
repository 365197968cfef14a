"""``plait.Plait``: the keep-your-loop API. One typed config chooses the layout; the loop stays the user's.

    p = plait.Plait("run.toml")                    # or Plait(parallel={"zero": 2}), or a plait.Config
    model, optimizer = p.setup(model, optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-4))
    loader = p.setup_dataloader(dataset)
    for batch in loader:
        loss = loss_fn(model(batch["x"]), batch["y"])
        p.backward(loss)                          # accumulation, loss scaling, no sync on early micro-steps
        info = p.step()                           # unscale, clip, skip non-finite, step, schedule, zero
    p.save("ckpt", model=model, optimizer=optimizer, dataloader=loader)

It starts the process group itself under ``plait run``, ``torchrun`` or SLURM, and runs as one process
otherwise. ``Plait`` is a facade: the layout is composed from the config (``plait.parallel.compose``) and the engine
talks only to its contract (``plait.parallel.layout.LayoutContract``); beside it are the accumulation window,
the checkpointer, the run's files and its metrics. ``setup`` builds the optimizer after the layout is applied,
so it holds the parameters the layout trains. The returned model is the user's own object (attributes and
``state_dict()`` keys unchanged); under pipeline parallelism ``forward_backward(model, batch)`` runs a step.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.checkpoint.checkpointer import Checkpointer
from plait.comm.auto import AutoCompress
from plait.comm.collectives import comm_from_config
from plait.comm.watchdog import StepWatchdog
from plait.components.losses import Loss, infer_loss, resolve_loss
from plait.components.optim import optimizer_factory
from plait.components.rng import RngStream, run_forward_in
from plait.config import Config
from plait.data.loader import to_device
from plait.engine.collectives import SmallCollectives, explained
from plait.engine.loaders import distributed_loader
from plait.engine.metrics import MetricsSink
from plait.engine.persistence import Persistence
from plait.engine.run_access import RunAccess
from plait.engine.run_files import RunFiles
from plait.engine.setup import batch_size, check_setup_args, coerce_config, select_device, setup_loss, skip_note
from plait.engine.step_info import StepInfo
from plait.engine.stepper import Stepper
from plait.engine.stepper import StepperAttribute as _StepperAttr
from plait.engine.tokens import TokenCounting
from plait.fault.preempt import PreemptionFlag
from plait.nn.moe import moe_layers
from plait.observe.log import get_logger
from plait.observe.memory import SetupMeter
from plait.observe.prometheus import serve_metrics
from plait.parallel import compose
from plait.parallel.capabilities import Serving
from plait.parallel.compile import compile_plan
from plait.parallel.errors import PlaitError, RankDone, check_loss
from plait.parallel.expert.dispatch import MoeMonitor
from plait.parallel.layout import Layout
from plait.parallel.meta_init import place
from plait.parallel.prepare import unwrap_compiled
from plait.parallel.spec import ModelSpec
from plait.parallel.tensor.plan import local_value
from plait.runtime.dist import init_distributed, write_error
from plait.topology import Topology
from plait.validate import validate


class Plait(TokenCounting, Persistence, SmallCollectives):
    """Distributed training for the user's own loop; see the module docstring.

    ``config``: a ``plait.Config``, the path of a TOML file, or None for the defaults; keyword
    ``sections`` (``parallel={"zero": 2}``, ``train=TrainConfig(...)``) are applied on top. The config is
    validated for the world size at once: impossible layouts fail here, before any collective.
    """

    def __init__(self, config: Config | str | Path | None = None, /, **sections: Any) -> None:
        cfg = coerce_config(config, sections)
        if "OMP_NUM_THREADS" in os.environ:
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        init_distributed(cfg.comm.backend, cfg.comm.timeout_s)
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.config = validate(cfg, world)
        self.device = select_device()
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False
        self.topology: Topology = compose.topology(cfg, self.device)
        self.group = self.topology.train_group  # the engine's own collectives run among the training ranks
        self.rank, self.world_size = self.topology.rank, self.topology.world_size
        self.logger = get_logger(self.rank)
        self.files = RunFiles(cfg.run.dir, self.rank, self.world_size)
        cfg.run.dir = str(self.files.run_dir)
        self.comm = comm_from_config(cfg.comm, cfg.train.seed, self.rank, self.world_size)
        # The model's dropout stream (the user's is untouched): one per replica and pipeline stage, tp ranks share one
        self.rng = RngStream(cfg.train.seed + 7919 * (self.rank // self.topology.degree("tp") + 1), self.device)
        self.preemption = PreemptionFlag()
        self.preemption.install()
        self.watchdog = self._build_watchdog()
        o = cfg.observe  # rank r's Prometheus endpoint (None: off); the trainer and recovery feed it too
        self.prometheus = serve_metrics(o.prometheus_port, o.prometheus_host, job=self.run_dir.resolve().name,
                                        rank=self.rank, device=self.device, status=self.watchdog.status,
                                        timeout_s=cfg.comm.timeout_s)
        self.auto = AutoCompress() if cfg.comm.compress == "auto" and self.topology.dp > 1 else None
        self.checkpointer = Checkpointer(cfg.checkpoint.async_save, self.world_size, self.group, self._saved,
                                         self._host_copy(cfg))
        self.metrics = MetricsSink(self.files.run_dir, cfg, self.is_main)
        self.stepper = Stepper(cfg, self.rank, self.world_size, self.comm, self.watchdog, self.files,
                               self.preemption, self.group, self.auto, self.finish_saves, self.prometheus, self.rng,
                               self.device, self.topology)
        self.loss: Loss | None = None
        self.train_loader: Any = None  # the training loader setup_dataloader made last (a healed replica moves it)
        self.pending_loader_state: Any = None  # a healed position for the training loader made next
        self._closed = False

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
    def layout(self) -> Layout | None:
        """The layout ``setup`` composed (None before): ``plait.parallel.layout.Layout``."""
        return self.stepper.layout

    @property
    def strategy(self) -> Layout | None:
        """The layout (an older name, kept for scripts that read it)."""
        return self.stepper.layout

    # the step's state lives in the stepper (plait.engine.stepper); read here under the names scripts know
    window = _StepperAttr("window", "The accumulation window (``plait.engine.window``).")
    scaler = _StepperAttr("scaler", "The loss scaler (fp16; scale 1 otherwise).")
    scheduler = _StepperAttr("scheduler", "The LR scheduler ``setup`` built from the factory (None without one).")
    moe = _StepperAttr("moe", "The MoE monitor (None for a model without ``plait.nn.MoE`` layers).")
    steps = _StepperAttr("steps", "Optimizer steps taken (restored by ``load``).")
    skipped_steps = _StepperAttr("skipped_steps", "Updates skipped for a non-finite gradient norm (reads the flags of "
                                                  "the steps since the last log step from the device).")
    saved_step = _StepperAttr("saved_step", "The step of the last completed checkpoint (None before one).")
    resumed_from = _StepperAttr("resumed_from", "The step this process's run was loaded at (0: a new run).")
    memory = _StepperAttr("memory", "This rank's measured model-state bytes (empty before the second update).")
    shares = _StepperAttr("shares", "Samples per data-parallel rank of every global batch (None: even).")

    @property
    def model_whole(self) -> bool:
        """Whether the model ``setup`` returns runs whole on each rank (False under pipeline parallelism: it is
        split over ranks, and ``forward_backward`` runs each micro-step)."""
        return compose.model_whole(self.config)

    @property
    def wants_sample(self) -> bool:
        """Whether ``setup`` uses a ``sample`` micro-batch (to balance pipeline stages by measured cost)."""
        return compose.wants_sample(self.config)

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
        self.stepper.in_window = False

    # -- setup -------------------------------------------------------------------------------------
    @explained
    def setup(self, model: nn.Module, optimizer: Any = None, scheduler: Callable[[Any], Any] | None = None, *,
              tp_plan: dict[str, Any] | str | None = None, parallelize_fn: Callable | None = None,
              pp_split: list[str] | None = None, stage_fn: Callable | None = None, loss_fn: Any = None,
              sample: Any = None, weights: str | Path | None = None, init_fn: Callable | None = None
              ) -> tuple[nn.Module, Any]:
        """Apply the configured layout to ``model`` and build its optimizer; returns ``(model, optimizer)``.

        ``optimizer``: a factory ``fn(model) -> torch.optim.Optimizer`` called with the returned model (the
        right, possibly sharded, parameters), or ``fn(params)`` with its trainable parameters when the factory's
        parameter is named ``params`` (``plait.components.optim.takes_params``); an optimizer instance holding
        no state yet (rebuilt over the same parameters by name, with its class, groups and hyperparameters); or
        None for AdamW from ``[optim]``. ``scheduler``: a factory ``fn(optimizer) -> LR scheduler``, stepped by
        ``step()``. ``tp_plan`` (patterns -> styles, or "auto") / ``parallelize_fn(model, tp_mesh)`` choose
        tensor parallelism, ``pp_split`` / ``stage_fn(model, stage_index, num_stages)`` the pipeline split;
        each overrides the config. ``loss_fn`` (a name, a ``plait.losses.Loss`` or ``fn(output, target)``) is
        what ``forward_backward`` and the pipeline's last stage compute; ``sample``: one micro-batch, to
        balance pipeline stages by measured cost. ``model`` may be on the meta device: each rank allocates only
        its part. ``weights``: a Hugging Face checkpoint (directory or file) or a plait run directory, read
        shard by shard; without it a meta model is initialised per module, by ``init_fn(module)`` if given."""
        check_setup_args(self.strategy, model, scheduler)
        self.phase("setup")
        model, user_compile = unwrap_compiled(model)
        plan = compile_plan(self.config, compose.compile_blocks_because(self.config), user_compile)
        if plan is not None:
            self.logger.info("compile: %s (%s)", "the whole model, with the loss in forward_backward, as one region"
                             if plan.unit == "model" else "block by block, and the loss", plan.why)
        factory = optimizer_factory(model, optimizer, self.config.optim)
        self.loss = setup_loss(model, loss_fn, sample, self.config, self.model_whole, plan)
        p = self.config.parallel
        spec = ModelSpec(tp_plan=tp_plan if tp_plan is not None else p.tp_plan, parallelize_fn=parallelize_fn,
                         pp_split=list(pp_split if pp_split is not None else p.pp_split), stage_fn=stage_fn,
                         loss=self.loss, sample=self.to_device(sample) if sample is not None else None,
                         compile=plan if plan is not None else False)
        moe = moe_layers(model)  # the whole model's, the same on every rank (a pipeline stage keeps some)
        meter = SetupMeter(self.device).start()  # this rank's peak memory of setup, reported with the prediction
        with self.rng.active():  # what setup draws (a pipeline stage's cost measurement) is plait's, not the user's
            self.stepper.layout = strategy = compose.parallelize(place(model, self.device), self.topology,
                                                                 self.config, self.comm, spec)
            strategy.state.prepare_weights(weights, init_fn, self.config.train.seed, self.group)
            if moe:
                # the layout's topology: a bias balances the loads of the ranks that step together (one DiLoCo
                # replica's)
                self.stepper.moe = MoeMonitor(strategy.model, strategy.topo, self.comm, self.config.train.log_every,
                                              bias=any(layer.balance == "bias" for layer in moe),
                                              sequence_parallel=p.sequence_parallel)
            opt = strategy.build_optimizer(factory)
        strategy.setup_memory = meter.stop()
        skips = strategy.nonfinite_skip()
        if skips != "device" and self.config.optim.skip_nonfinite is not False:
            self.logger.info(skip_note(skips == "host", self.device))
        self._start(strategy)
        if scheduler is not None:
            self.stepper.scheduler = scheduler(strategy.scheduler_target())
        strategy.wrap_forward(self.device, plan)
        if self.model_whole:  # the user's model(...) draws its dropout masks from plait's stream
            run_forward_in(strategy.model, self.rng)
        strategy.set_sync(self.accumulation == 1)  # DDP arms its reducer in the next forward
        self.watchdog.kinds = strategy.describe()
        strategy.begin(RunAccess(self))
        self.stepper.start_step()
        return strategy.model, opt

    def _start(self, layout: Layout) -> None:
        """A serving part's start (a parameter server's servers serve there until every worker has finished,
        then end with ``RankDone``: their part of the run is over, and this object is closed)."""
        serving = layout.capability(Serving)
        if serving is None:
            return
        try:
            serving.start(self.watchdog.close)
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

        ``data`` is a map-style data set (a Hugging Face ``datasets.Dataset`` too) or a DataLoader (whose
        data set, batch size, collate function and worker settings are kept); an iterable data set (Hugging
        Face or torch), a ``StatefulDataLoader``, plait's streamed documents or a plain iterable are read
        through ``plait.data.resumable.loader_for`` (sharded over data-parallel ranks, per-rank state). A
        DataLoader whose sampler is already rank-aware (``DistributedSampler``) is returned as it is. Training
        (``shuffle=True``) yields whole global batches of ``batch_size x dp x accumulation`` samples, each
        data-parallel rank a disjoint share; ``shuffle=False`` is for evaluation: every sample once (but at
        most dp-1), the same number of batches on every rank. A ``batch_size`` other than the config's changes
        the accumulation so the global batch stays."""
        if data is None:
            raise PlaitError("setup_dataloader() got None; pass a data set or a DataLoader")
        loader, batch_size, accumulation = distributed_loader(
            data, batch_size, self.config, self.topology, collate_fn=collate_fn, shuffle=shuffle,
            drop_last=drop_last, seed=seed, **dataloader_kwargs)
        if accumulation is not None:  # the first micro-step logs it (plait.engine.stepper.Stepper.announce)
            self.window.accumulation = accumulation
        if shuffle:
            self.train_loader = loader
            if self.pending_loader_state is not None:  # this replica healed before its loader existed
                loader.load_state_dict(self.pending_loader_state)
                self.pending_loader_state = None
        return loader

    def to_device(self, batch: Any) -> Any:
        """``batch`` (tensors in tuples, lists, dicts) moved to this rank's device."""
        return to_device(batch, self.device) if self.device.type != "cpu" else batch

    # -- one step ----------------------------------------------------------------------------------
    def _require_strategy(self) -> Layout:
        if self.strategy is None:
            raise PlaitError("call p.setup(model, ...) first")
        return self.strategy

    @property
    def sync_gradients(self) -> bool:
        """True when the next ``backward`` is the last micro-step of the accumulation window."""
        return self.window.sync_gradients

    @explained
    def backward(self, loss: torch.Tensor, num_samples: int | None = None) -> None:
        """Backward of one micro-batch's ``loss`` (a scalar): scaled by loss scale / accumulation, with
        gradient communication only on the last micro-step of the window. ``num_samples``: the micro-batch's
        samples, needed only with uneven shares (``set_shares``)."""
        self._require_strategy()
        self.backward_checks(loss)
        self.stepper.backward(loss, num_samples)

    def set_shares(self, loader: Any, shares: list[int] | None) -> None:
        """Give data-parallel rank r ``shares[r]`` samples of every global batch (faster ranks more: see
        ``fault.rebalance``), the same on every rank; losses are weighted so the update equals the even
        split's. ``backward`` then needs ``num_samples`` (``forward_backward`` counts them itself)."""
        loader.set_shares(shares)
        self.stepper.shares = list(shares) if shares is not None else None

    @staticmethod
    def backward_checks(loss: Any) -> None:
        """A clear error for a loss that cannot be backpropagated: not a scalar, or not from the model."""
        check_loss(loss)

    @explained
    def forward_backward(self, model: nn.Module, batch: Any, loss_fn: Any = None,
                         num_items_in_batch: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward of one micro-batch with ``loss_fn`` (default: the one given to setup,
        else inferred from the batch); returns this micro-batch's loss, detached. Works for every layout,
        pipeline parallelism included (where it returns 0 on ranks without the last stage).
        ``num_items_in_batch`` (from ``num_items_in_batch``): a loss that counts its items (the causal-LM loss)
        is their sum divided by it, so every real token of the optimizer step weighs the same."""
        self._require_strategy()
        loss = self._loss_for(model, batch, loss_fn)
        samples = batch_size(batch, loss) if self.shares is not None and num_items_in_batch is None else None
        with loss.per_items(num_items_in_batch):
            return self.stepper.forward_backward(model, self.to_device(batch), loss, samples)

    def _loss_for(self, model: nn.Module, batch: Any, loss_fn: Any) -> Loss:
        loss = resolve_loss(loss_fn) if loss_fn is not None else self.loss
        if loss is None:
            loss = self.loss = infer_loss(model, batch)
            self.logger.info("loss: %s (inferred from the first batch)", loss.name)
        return loss

    @explained
    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch: Any, loss_fn: Any = None) -> torch.Tensor:
        """Mean loss of one batch without gradients (float64 scalar on the CPU), the same on every rank of
        a model replica (pipeline: the last stage's loss brought to every stage)."""
        strategy = self._require_strategy()
        loss = self._loss_for(model, batch, loss_fn)
        value = strategy.evaluate(model, self.to_device(batch), loss)
        return strategy.reduce_loss(local_value(value).detach().double().cpu().reshape(()))

    def evaluation(self) -> contextlib.AbstractContextManager:
        """Context for an evaluation loop (``evaluate`` over held-out batches): the weights it scores are the ones
        every data-parallel rank agrees on. The model's own for every layout except ``parallel.sync=diloco``, where
        between two synchronisations they are the last synchronisation's (what checkpoints and exports hold), the
        replica's own weights put back on exit. Every rank enters it; it communicates nothing."""
        return self._require_strategy().evaluation()

    @explained
    def step(self, log: bool | None = None) -> StepInfo | None:
        """At the end of an accumulation window: wait for gradient sync, unscale, clip (``optim.grad_clip``),
        skip the update if the gradients hold NaN/inf, optimizer step, scheduler step, zero grads. Returns
        the step's ``StepInfo``; None between boundaries.

        Nothing is read from the device and no collective runs beyond the gradients' own unless this is a log
        step: ``log=True``, or with None (the default) step 1, every ``train.log_every``-th and the last of
        ``train.steps``. A log step reads the values of the steps since the previous one in one transfer and,
        over several ranks, agrees on the losses (``StepInfo.global_loss``) and on a stop request
        (``StepInfo.preempted``) in one all-reduce; every rank must pass the same ``log``. On other steps
        ``StepInfo.loss``/``grad_norm``/``skipped`` are read when first used."""
        self._require_strategy()
        return self.stepper.step(log)

    @property
    def preempted(self) -> bool:
        """Whether SIGTERM/SIGINT reached this rank (``StepInfo.preempted`` is the agreed value)."""
        return self.preemption.requested

    # -- state -------------------------------------------------------------------------------------
    # -- metrics -----------------------------------------------------------------------------------
    def log(self, record: dict[str, Any], step: int | None = None) -> None:
        """Record metrics (rank 0): a line of ``metrics.jsonl``, the same to each of ``observe.trackers``
        (TensorBoard, W&B, MLflow), the progress bar. ``step`` defaults to ``record["step"]``, else the optimizer
        steps taken."""
        self.metrics.log({"step": step if step is not None else record.get("step", self.steps), **record})

    @explained
    def truncate_metrics(self, step: int) -> None:
        """Rank 0: drop ``metrics.jsonl`` records of steps after ``step`` (they belong to a timeline a
        restart or a rollback undid), so the file reads as one run; the trackers rewind with it."""
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

    def close(self) -> None:
        """Stop the watchdog and the comm thread, close metrics files; the process group stays."""
        if self._closed:
            return
        self.finish_saves()
        self._closed = True
        self.stepper.write_progress()  # the exact step count for the launcher (between log steps it may lag)
        if self.strategy is not None:
            self.strategy.close()  # a parameter server's worker tells the servers it is done
        self.stepper.stop_counting()
        self.metrics.close()
        if self.prometheus is not None:
            self.prometheus.close()
        self.watchdog.close()
        self.comm.close()
        self.preemption.uninstall()

    def __enter__(self) -> Plait:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
