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
talks only to its contract (``plait.parallel.layout.Layout``); beside it are the accumulation window,
the checkpointer, the run's files and its metrics. ``setup`` builds the optimizer after the layout is applied,
so it holds the parameters the layout trains. The returned model is the user's own object (attributes and
``state_dict()`` keys unchanged); under pipeline parallelism ``forward_backward(model, batch)`` runs a step.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.comm.auto import AutoCompress
from plait.comm.collectives import comm_from_config
from plait.comm.watchdog import StepWatchdog
from plait.components.hf_checkpoint import DEFAULT_SHARD_BYTES
from plait.components.losses import IGNORE_INDEX, Loss, infer_loss, resolve_loss
from plait.components.optim import optimizer_factory
from plait.components.rng import RngStream, run_forward_in
from plait.config import Config
from plait.data.loader import to_device
from plait.engine.checkpointer import Checkpointer
from plait.engine.collectives import SmallCollectives, explained
from plait.engine.export import export_weights
from plait.engine.loaders import distributed_loader
from plait.engine.metrics import MetricsSink
from plait.engine.run_access import RunAccess
from plait.engine.run_files import RunFiles
from plait.engine.setup import batch_size, check_setup_args, coerce_config, select_device, setup_loss
from plait.engine.step_info import StepInfo
from plait.engine.stepper import Stepper
from plait.engine.stepper import StepperAttribute as _StepperAttr
from plait.fault.preempt import PreemptionFlag
from plait.nn.moe import moe_layers
from plait.observe.log import get_logger
from plait.observe.memory import SetupMeter
from plait.observe.prometheus import serve_metrics
from plait.parallel import compose
from plait.parallel.capabilities import Serving, agreement
from plait.parallel.compile import compile_plan
from plait.parallel.expert.dispatch import MoeMonitor
from plait.parallel.layout import Layout, PlaitError, RankDone, check_loss
from plait.parallel.meta_init import place
from plait.parallel.prepare import unwrap_compiled
from plait.parallel.spec import ModelSpec
from plait.parallel.tensor.plan import local_value
from plait.runtime.dist import init_distributed, write_error
from plait.topology import Topology
from plait.validate import validate


class Plait(SmallCollectives):
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
            strategy.prepare_weights(weights, init_fn, self.config.train.seed, self.group)
            if moe:
                self.stepper.moe = MoeMonitor(strategy.model, self.topology, self.comm, self.config.train.log_every,
                                              bias=any(layer.balance == "bias" for layer in moe),
                                              sequence_parallel=p.sequence_parallel)
            opt = strategy.build_optimizer(factory)
        strategy.setup_memory = meter.stop()
        if self.device.type == "cuda" and not strategy.skips_on_device():
            self.logger.info("the optimizer cannot skip a non-finite step on the GPU (no found_inf): each step reads "
                             "its non-finite flag on the host, one sync; a fused optimizer (AdamW(fused=True), "
                             "plait's default) does not")
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

    @explained
    def num_items_in_batch(self, batches: Any, loss_fn: Any = None, *, shift: bool = True) -> torch.Tensor:
        """The divisor that makes a summed loss one mean over the real tokens of the whole optimizer step.

        ``batches``: this rank's labels of every micro-batch of the optimizer step (a tensor or a list of them:
        Hugging Face labels, ``-100`` where a token does not count), or its micro-batches (dicts with
        ``labels``, or any batch ``loss_fn`` counts; ``loss_fn`` defaults to the one given to setup). Labels are
        counted after the causal-LM shift (``labels[..., 1:]``; ``shift=False`` counts them as they are), as
        transformers counts ``num_items_in_batch``. The counts are summed over the data-parallel ranks (one
        all-reduce of one number when dp > 1; the only collective, on the device, nothing read back) and divided
        by the micro-steps and ranks ``backward`` averages over (accumulation x the ranks gradients are averaged
        over; under context parallelism the data-parallel ranks only, the value of cp=1: the model's forward divides
        a shard's loss by cp itself), so that ``loss = token_losses.sum() / n`` per micro-step, or a Hugging Face
        model's ``model(**batch, num_items_in_batch=n).loss``, through ``backward`` weighs every real token of the
        step ``1 / N``. Returns a 0-dim float32 tensor on this rank's device; every data-parallel rank must call it."""
        strategy = self._require_strategy()
        if not self.model_whole:
            raise PlaitError("num_items_in_batch: under pipeline parallelism the last stage computes the loss per "
                             "pipeline micro-batch; use the mean loss given to setup (loss_fn)")
        if not self.weighs_tokens:
            raise PlaitError("num_items_in_batch: the data-parallel ranks of this layout run at their own pace (an "
                             "asynchronous parameter server), so no step's token count is shared; use a mean loss")
        items = list(batches) if isinstance(batches, list | tuple) else [batches]
        if not items:
            raise PlaitError("num_items_in_batch() got no labels: pass every micro-batch's labels of the step")
        counts = [self._count_items(b, loss_fn, shift) for b in items]
        ranks = strategy.items_ranks  # the data-parallel ranks backward averages over, and the micro-steps
        divisor = ranks * self.window.accumulation
        alone = self.dp == 1 or ranks == 1  # nothing to sum over the data-parallel group
        # Host counts are added on the host and filled in on the device (a kernel, not a copy that waits for the
        # stream); counts of labels already on the device stay there: nothing is read back.
        host = sum(int(c.numpy()) for c in counts if c.device.type == "cpu")  # numpy: no tensor read is dispatched
        on_device = [c for c in counts if c.device.type != "cpu"]
        if alone and not on_device:  # one fill, the step's only op here
            return self._items_fill(host)
        total = torch.full((1,), float(host), dtype=torch.float64, device=self.device)
        for c in on_device:
            total += c.to(device=self.device, dtype=torch.float64)
        if not alone:
            self._meet()
            self.comm.all_reduce_sum(total, self.topology.dp_group, name="num_items_in_batch")
        return (total[0] / divisor).float()

    def num_items_known(self, per_rank: int) -> torch.Tensor:
        """``num_items_in_batch`` for a step whose count is known without counting: ``per_rank`` items on this
        rank over the optimizer step's micro-steps, the same on every rank whose counts ``num_items_in_batch``
        would sum (e.g. whole batches of a data set whose every target counts). Nothing is counted or
        communicated: one fill on this rank's device."""
        return self._items_fill(per_rank * self._require_strategy().items_ranks)

    def _items_fill(self, total: int) -> torch.Tensor:
        """The divisor for ``total`` items summed over the ranks and micro-steps backward averages over."""
        divisor = self._require_strategy().items_ranks * self.window.accumulation
        return torch.full((), total / divisor, dtype=torch.float32, device=self.device)

    @property
    def weighs_tokens(self) -> bool:
        """Whether ``num_items_in_batch`` applies: the model runs whole on each rank (not a pipeline) and the
        data-parallel ranks meet at every step (not an asynchronous parameter server)."""
        strategy = self._require_strategy()
        return self.model_whole and (self.dp == 1 or agreement(strategy, self.group)[0])

    def _count_items(self, batch: Any, loss_fn: Any, shift: bool) -> torch.Tensor:
        """One micro-batch's items: labels counted (HF convention), or what the loss counts in a batch."""
        if isinstance(batch, torch.Tensor):
            return ((batch[..., 1:] if shift else batch) != IGNORE_INDEX).sum()
        loss = resolve_loss(loss_fn) if loss_fn is not None else self.loss
        count = loss.count_items(batch) if loss is not None else None
        if count is None and isinstance(batch, Mapping) and "shift_labels" in batch:
            return self._count_items(batch["shift_labels"], None, False)
        if count is None and isinstance(batch, Mapping) and "labels" in batch:
            return self._count_items(batch["labels"], None, shift)
        if count is None:
            raise PlaitError("num_items_in_batch: cannot count the items of a batch of type "
                             f"{type(batch).__name__}; pass the labels tensors (-100 where a token does not count)")
        return count

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
    @explained
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
        shared = self.stepper.run_state(scheduler, dataloader)
        meta = {"extra": extra or {}, "world_size": self.world_size, "dp": self.dp,
                "layout": strategy.describe() or "single process", "steps": self.steps}
        rank_state = {"comm": self.comm.state_dict(), "rng": self.rng.state_dict()}
        return self.checkpointer.save(Path(path), strategy, meta, self.rank, rank_state,
                                      shared, self.steps, on_complete, self.is_main)

    def finish_saves(self) -> None:
        """Complete an asynchronous save still being written (collective; nothing when there is none)."""
        if self.checkpointer.pending:
            self.phase("checkpoint save")
            self.checkpointer.finish(self.is_main)

    def _saved(self, path: Path, step: int) -> None:
        self.logger.info("checkpoint saved: %s", path)
        self.stepper.saved_step = step
        self.stepper.write_progress()
        if self.prometheus is not None:
            self.prometheus.checkpoint_done()

    def _host_copy(self, cfg: Config) -> Any:
        """``fault.memory_checkpoint``: this rank's holders (``plait.engine.host_copies``: its machine's, which the
        launcher started, and on several machines the peer machine's); None when off, under a parameter server,
        or where no holder runs (a worker not started by ``plait train``: said once). Collective on several
        machines (one all-gather of the holders' addresses, at setup)."""
        if not cfg.fault.memory_checkpoint or cfg.parallel.mode != "collective":
            return None
        from plait.engine.host_copies import holders_for

        holders = holders_for(self.rank, self.world_size, self.group, self.device, self.logger)
        if holders is None and self.is_main:
            self.logger.warning("fault.memory_checkpoint: no holder runs beside this worker (plait train starts "
                                "one for 2 or more workers, whose restarts use it); checkpoints go to disk only")
        return holders

    def memory_copy(self, accept: Callable[[int], bool]) -> Any:
        """The in-memory checkpoint (``plait.engine.host_copies.HeldCopy``: step, this rank's decoded copy, where it
        came from) that every rank found whole, from its own machine's holder or a peer machine's, and could fit
        into its layout, of one same step that ``accept(step)`` takes on every rank, at this world size; None
        otherwise, or with no holder (then every rank reads the disk). Collective (one all-reduce of six numbers
        over every rank); ``load(path, memory=held.decoded)`` then loads it."""
        from plait.components.memory_checkpoint import decode
        from plait.engine.host_copies import find_copies

        strategy = self._require_strategy()
        return find_copies(self.checkpointer.host_copy, self.rank, self.world_size, accept,
                           lambda payload: decode(payload, strategy),
                           lambda t: self.reduce(t, op="sum", over="world"), self.logger)

    @explained
    def load(self, path: str | Path, *, model: nn.Module | None = None, optimizer: Any = None,
             scheduler: Any = None, dataloader: Any = None, verify: bool | None = None,
             memory: Any = None) -> dict[str, Any]:
        """Load a checkpoint written by ``save`` (at any world size or layout) into this run's objects;
        returns its ``extra``. Every file is first checked against the checkpoint's manifest
        (``checkpoint.verify``; ``verify`` overrides it): a damaged one raises ``CheckpointError`` naming
        the file. ``memory``: this rank's in-memory copy of the same checkpoint (``memory_copy``), read instead
        of the disk. Collective: every rank calls it."""
        strategy = self._check_objects(model, optimizer)
        self.phase("checkpoint load")
        self._meet()
        check = self.config.checkpoint.verify if verify is None else verify
        meta, rank_state, shared, same_world = self.checkpointer.load(Path(path), strategy, self.rank,
                                                                      self.world_size, check, memory)
        self.stepper.restore(shared, scheduler, dataloader, path)
        strategy.finish_load()
        if rank_state is not None:  # compressor residuals and the model's stream: the resumed run continues exactly
            self.comm.load_state_dict(rank_state["comm"])
            if "rng" in rank_state:
                self.rng.load_state_dict(rank_state["rng"])
        elif not same_world:
            self.logger.info("checkpoint saved at world size %s, loading at %d: per-rank RNG and compressor "
                             "residuals start fresh", meta.get("world_size"), self.world_size)
        self.logger.info("loaded %s (step %d)%s", path, self.steps, " from host memory" if memory is not None else "")
        self.stepper.write_progress()  # where this attempt starts, for the launcher's no-progress rule
        if self.prometheus is not None:  # training since this checkpoint is what a failure would lose
            self.prometheus.checkpoint_done()
        self.stepper.start_step()
        return meta.get("extra", {})

    def _check_objects(self, model: Any, optimizer: Any) -> Layout:
        strategy = self._require_strategy()
        if model is not None and model is not strategy.model:
            raise PlaitError("save/load got a model other than the one setup() returned; pass that one")
        if optimizer is not None and optimizer is not strategy.optimizer:
            raise PlaitError("save/load got an optimizer other than the one setup() returned; pass that one")
        return strategy

    @explained
    def full_state_dict(self, model: nn.Module | None = None, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's weights under its single-process names, unsharded, on the CPU, on every rank
        (``rank0_only``: only rank 0's is sure to be filled, which spares the others the memory).
        Collective: gathers FSDP, tensor-parallel and pipeline shards."""
        strategy = self._check_objects(model, None)
        self.phase("export")
        return {k: v.detach().cpu() for k, v in strategy.full_model_state(rank0_only).items()}

    def export(self, model: nn.Module | None, path: str | Path, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
        """Write the weights under the single-process names (every rank calls it): ``*.safetensors`` is one file on
        rank 0; any other path a Hugging Face directory written shard by shard (``plait.parallel.weights``)."""
        return export_weights(self, model, Path(path), max_shard_bytes)

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
