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
single process otherwise. ``setup`` applies the layout in the documented order (``plait.parallel.apply``)
and builds the optimizer afterwards from a factory, so it holds the parameters the layout trains. The
returned model is the user's own object (plait's reducer, ZeRO and FSDP2 work in place; DDP runs
behind its ``forward``): attribute access and ``state_dict()`` keys are unchanged. Under pipeline
parallelism the model is split over ranks and ``forward_backward(model, batch)`` runs a step.

Accumulation: ``train.global_batch_size / (micro batch x dp)`` micro-steps per optimizer step; every
``backward`` scales the loss by ``loss scale / accumulation`` and communicates gradients only on the
last micro-step of the window; ``step()`` returns None until the window is complete.
"""

from __future__ import annotations

import math
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
from plait.comm.watchdog import StepWatchdog
from plait.config import Config, ConfigError, from_sections, load_config
from plait.data.loader import DeviceLoader, to_device
from plait.fault.preempt import PreemptionFlag
from plait.fault.restart import write_pid, write_progress
from plait.launch import error_dir_from_env, error_file, init_distributed, write_error
from plait.observe.log import get_logger
from plait.parallel.apply import ModelSpec, apply_parallel, check_model
from plait.parallel.layout import Layout
from plait.parallel.prepare import broadcast_weights, route_forward, sync_batchnorm, unwrap_compiled
from plait.plan.memory import memory_report
from plait.topology import Topology, build_topology
from plait.train.losses import Loss, infer_loss, resolve_loss
from plait.train.optim import hyperparameters, optimizer_factory, set_hyperparameters
from plait.train.precision import LossScaler, autocast
from plait.validate import validate


class PlaitError(ConfigError):
    """The API was used in a way that cannot work; the message says what to do instead."""


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
    # parallel.mode=ps: this worker's clock, shard versions, push/pull bytes and waits (plait.ps.layout).
    ps: dict[str, Any] | None = None

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
        # parallel.mode=ps: the last ps.servers ranks serve (plait.ps); the topology and every collective of
        # this API span the workers only (self.group), and rank 0 is a worker.
        self.ps: Any = None
        if cfg.parallel.mode == "ps":
            from plait.ps.roles import make_groups, ps_topology

            self.ps = make_groups(cfg)
            self.topology: Topology = ps_topology(cfg, self.ps, self.device)
        else:
            self.topology = build_topology(cfg, self.device)
        self.group = self.ps.workers if self.ps is not None else None
        self.rank, self.world_size = self.topology.rank, self.topology.world_size
        self.logger = get_logger(self.rank)
        self.run_dir = self._agree_run_dir()
        self.error_dir = error_dir_from_env(self.run_dir / "errors")
        error_file(self.error_dir, self.rank).unlink(missing_ok=True)
        self.comm = comm_from_config(cfg.comm, cfg.train.seed, self.rank, self.world_size)
        # Where the launcher looks for progress and worker pids: the error directory's parent.
        self.state_dir = self.error_dir.parent if self.error_dir is not None else None
        self.saved_step: int | None = None
        self.resumed_from = 0
        self.finish_blocking_s = 0.0  # seconds spent completing asynchronous saves (the Trainer records them)
        if self.state_dir is not None:
            write_pid(self.state_dir, self.rank)
        self.preemption = PreemptionFlag()
        self.preemption.install()
        self.watchdog = self._build_watchdog()
        self.scaler = LossScaler(enabled=cfg.train.precision == "fp16")
        self.auto = AutoCompress() if cfg.comm.compress == "auto" and self.topology.dp > 1 else None
        self.accumulation = cfg.grad_accum
        self.layout: Layout | None = None
        self.moe: Any = None  # plait.parallel.expert.MoeMonitor when the model has MoE layers
        self.scheduler: Any = None
        self.loss: Loss | None = None
        self.steps = 0
        self.skipped_steps = 0
        self.memory: dict[str, int] = {}
        self._micro = 0
        self._window_loss: list[torch.Tensor] = []
        self._times = {"forward_s": 0.0, "backward_s": 0.0}
        self._boundary_t = time.perf_counter()
        self._counter: TorchCollectiveCounter | None = None
        self._torch_bytes: int | None = None
        self._metrics: Any = None
        self._bar: Any = None
        self._closed = False
        self._in_window = False
        self._pending: Any = None
        self.last_save_blocking_s = 0.0
        self.shares: list[int] | None = None
        # An asynchronous save runs DCP's collectives on a background thread: on a group of their own, so
        # they never interleave with training's on the same channels (not with ps: its servers write, synchronously).
        self._ckpt_group = dist.new_group(backend="gloo") if self.world_size > 1 and cfg.checkpoint.async_save \
            else None

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

    def _agree_run_dir(self) -> Path:
        """``run.dir``, or ``runs/plait-<time>`` chosen by rank 0 and shared with every rank."""
        cfg = self.config
        if cfg.run.dir:
            return Path(cfg.run.dir)
        run_id = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID")
        name = [f"runs/plait-{run_id or time.strftime('%Y%m%d-%H%M%S')}"]
        if self.world_size > 1:
            dist.broadcast_object_list(name, src=0)
        cfg.run.dir = name[0]
        return Path(name[0])

    def _build_watchdog(self) -> StepWatchdog:
        """The step watchdog (``plait.comm.watchdog``): bounds the waits in the collectives PyTorch issues
        for the layout (DTensor, pipeline P2P, FSDP2, DCP), which ``Comm``'s guard does not see."""
        store = dist.distributed_c10d._get_default_store() if self.world_size > 1 else None
        return StepWatchdog(store, self.config.comm.timeout_s, self.rank, self.world_size,
                            error_file(self.error_dir, self.rank), "")

    def _kinds(self) -> str:
        t, z = self.topology, self.config.parallel.zero
        used = (("tensor-parallel", t.degree("tp") > 1), ("pipeline", t.degree("pp") > 1),
                ("expert", t.degree("ep") > 1), ("FSDP", z == 3), ("ZeRO", z in (1, 2)),
                ("data-parallel", t.dp > 1 and z == 0))
        return "/".join(name for name, on in used if on)

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
        if self.layout is not None:
            raise PlaitError("setup() was already called on this Plait: one Plait trains one model")
        if not isinstance(model, nn.Module):
            raise PlaitError(f"setup() takes a torch.nn.Module; got {type(model).__name__}")
        if scheduler is not None and (not callable(scheduler) or hasattr(scheduler, "step")):
            raise PlaitError("scheduler must be a factory fn(optimizer) -> LR scheduler (plait builds the optimizer "
                             "in setup, so a scheduler made before cannot reference it)")
        self.phase("setup")
        model, compiled = unwrap_compiled(model)
        factory = optimizer_factory(model, optimizer, self.config.optim)
        self.loss = resolve_loss(loss_fn)
        if self.config.train.compile:
            from plait.parallel.compile import compile_loss

            compile_loss(self.loss, self.config)  # in place: the caller's Loss object runs compiled too
        p = self.config.parallel
        if self.topology.degree("pp") > 1 and self.loss is None:
            if sample is None:
                raise PlaitError("with parallel.pp > 1 the last stage computes the loss: pass loss_fn= to setup "
                                 "(a name such as 'causal_lm', or fn(output, target))")
            self.loss = infer_loss(model, sample)
        spec = ModelSpec(tp_plan=tp_plan if tp_plan is not None else p.tp_plan, parallelize_fn=parallelize_fn,
                         pp_split=list(pp_split if pp_split is not None else p.pp_split), stage_fn=stage_fn,
                         loss=self.loss, sample=self.to_device(sample) if sample is not None else None)
        check_model(model, self.topology, self.config, spec)  # before the first collective
        model = model.to(self.device)
        from plait.nn.moe import moe_layers

        moe = moe_layers(model)  # the whole model's, the same on every rank (a pipeline stage keeps some)
        if self.ps is not None:  # worker 0's weights go to the servers in build_optimizer; every worker pulls them
            from plait.ps.layout import PsLayout

            self.layout = layout = PsLayout(model, self.config, self.topology, self.comm, self.ps)
        else:
            broadcast_weights(model, self.comm, self.world_size)
            if self.config.parallel.sync_batchnorm and self.dp > 1:
                model = sync_batchnorm(model, self.topology.dp_group, self.device)
            self.layout = layout = apply_parallel(model, self.topology, self.config, self.comm, spec)
        if moe:
            from plait.parallel.expert import MoeMonitor

            self.moe = MoeMonitor(layout.model, self.topology, self.comm, self.config.train.log_every,
                                  bias=any(layer.balance == "bias" for layer in moe))
        opt = layout.build_optimizer(factory)
        if self.ps is not None and self.ps.is_server:
            self._serve()
        if scheduler is not None:
            self.scheduler = scheduler(layout.scheduler_target())
        if not layout.pipelined:
            precision = self.config.train.precision
            # ZeRO-3 with bf16 runs forward in bf16 through FSDP2's mixed-precision policy instead of autocast.
            amp = precision != "fp32" and not (self.config.parallel.zero == 3 and precision == "bf16")
            route_forward(layout.model, layout.forward_wrapper(), precision, amp, self.device, compiled)
        layout.set_sync(self.accumulation == 1)  # DDP arms its reducer in the next forward
        # Dropout streams per model replica and pipeline stage; tensor-parallel ranks (tp is the innermost
        # axis) share one, so replicated activations get one mask.
        torch.manual_seed(self.config.train.seed + 7919 * (self.rank // self.topology.degree("tp") + 1))
        self.watchdog.kinds = self._kinds()
        self._start_step()
        return layout.model, opt

    def _serve(self) -> None:
        """A server rank of ``parallel.mode=ps``: answer the workers until every one has finished, then end
        with ``ServerDone`` (exit status 0): servers never run the user's loop."""
        from plait.ps.roles import ServerDone

        self.watchdog.close()  # a server waits for as long as the workers compute: no step phases to bound
        try:
            stats = self.layout.serve()
        except BaseException as e:
            write_error(e, self.rank, self.error_dir)
            raise
        self.ps_stats = stats
        self.logger.info("parameter server %d: done after %d updates", self.ps.server_index, stats["updates"])
        self.close()
        raise ServerDone(stats)

    # -- data --------------------------------------------------------------------------------------
    def setup_dataloader(self, data: Any, batch_size: int | None = None, *, collate_fn: Callable | None = None,
                         shuffle: bool = True, drop_last: bool | None = None, seed: int | None = None,
                         **dataloader_kwargs: Any) -> Any:
        """This rank's share of ``data`` in micro-batches of ``batch_size`` (default
        ``train.micro_batch_size``): a deterministic, resumable loader (``plait.data.loader``).

        ``data`` is a map-style data set (a Hugging Face ``datasets.Dataset`` too) or a DataLoader (whose
        data set, collate function and worker settings are kept); an iterable data set (Hugging Face or
        torch), a ``StatefulDataLoader``, plait's streamed documents or a plain iterable are read through
        ``plait.data.resumable.loader_for`` (sharded over data-parallel ranks, per-rank state). A DataLoader
        whose sampler is already rank-aware (``DistributedSampler``) is returned as it is. Training
        (``shuffle=True``) yields whole global batches of ``batch_size x dp x accumulation`` samples, each
        data-parallel rank a disjoint share; ``shuffle=False`` is for evaluation: every sample once (but at
        most dp-1), the same number of batches on every rank. A ``batch_size`` other than the config's changes
        the accumulation so the global batch stays.
        """
        from torch.utils.data import DataLoader

        from plait.data.loader import DistributedLoader, is_rank_aware

        if data is None:
            raise PlaitError("setup_dataloader() got None; pass a data set or a DataLoader")
        t = self.config.train
        from plait.data.resumable import loader_for

        special = loader_for(data, dp_rank=self.dp_rank, dp_size=self.dp, batch_size=batch_size or t.micro_batch_size,
                             num_workers=dataloader_kwargs.get("num_workers", self.config.data.num_workers),
                             collate_fn=collate_fn, pin_memory=self.device.type == "cuda",
                             prefetch_factor=dataloader_kwargs.get("prefetch_factor"))
        if special is not None:  # streamed, iterable or Hugging Face data (plait.data.resumable)
            return special if self.device.type == "cpu" else DeviceLoader(special, self.device)
        if isinstance(data, DataLoader):
            if is_rank_aware(data):
                self.logger.info("the DataLoader's sampler is already rank-aware: used as it is (not resumable)")
                return data
            collate_fn = collate_fn or data.collate_fn
            for key in ("num_workers", "pin_memory", "timeout", "worker_init_fn", "prefetch_factor",
                        "persistent_workers"):
                if key not in dataloader_kwargs and hasattr(data, key):
                    value = getattr(data, key)
                    if key == "prefetch_factor" and data.num_workers == 0:
                        continue
                    dataloader_kwargs[key] = value
            batch_size = batch_size or data.batch_size
            data = data.dataset
        batch_size = batch_size or t.micro_batch_size
        accumulation = 1
        if shuffle:
            per_step = batch_size * self.dp
            if t.global_batch_size % per_step:
                raise PlaitError(f"batch_size={batch_size} x dp={self.dp} does not divide train.global_batch_size="
                                 f"{t.global_batch_size}; choose a batch size that divides "
                                 f"{t.global_batch_size // self.dp} or change train.global_batch_size")
            accumulation = t.global_batch_size // per_step
            if accumulation != self.accumulation:
                self.logger.info("batch size %d per rank: %d accumulation micro-steps per optimizer step", batch_size,
                              accumulation)
                self.accumulation = accumulation
        dataloader_kwargs.setdefault("num_workers", self.config.data.num_workers)
        if self.device.type == "cuda":
            dataloader_kwargs.setdefault("pin_memory", True)
        loader = DistributedLoader(data, batch_size, dp_rank=self.dp_rank, dp_size=self.dp, accumulation=accumulation,
                                   seed=t.seed if seed is None else seed, shuffle=shuffle,
                                   drop_last=shuffle if drop_last is None else drop_last, collate_fn=collate_fn,
                                   **dataloader_kwargs)
        return loader if self.device.type == "cpu" else DeviceLoader(loader, self.device)

    def to_device(self, batch: Any) -> Any:
        """``batch`` (tensors in tuples, lists, dicts) moved to this rank's device."""
        return to_device(batch, self.device) if self.device.type != "cpu" else batch

    # -- one step ----------------------------------------------------------------------------------
    def _require_layout(self) -> Layout:
        if self.layout is None:
            raise PlaitError("call p.setup(model, ...) first")
        return self.layout

    @property
    def sync_gradients(self) -> bool:
        """True when the next ``backward`` is the last micro-step of the accumulation window."""
        return self._micro % self.accumulation == self.accumulation - 1

    def _enter_window(self) -> None:
        """The watchdog's phase is this step's forward/backward (after another phase ran between steps)."""
        if not self._in_window:
            self._in_window = True
            self.watchdog.enter(self.steps + 1, "forward/backward")

    def _begin_micro(self) -> bool:
        """Bookkeeping before a micro-step's backward; returns whether it ends the window."""
        self._enter_window()
        if self._micro and self._micro % self.accumulation == 0:
            raise PlaitError(f"backward() ran {self._micro} times without step(): call p.step() after every "
                             f"backward (it steps once every {self.accumulation} micro-steps)")
        final = self.sync_gradients
        self._require_layout().set_sync(final)
        return final

    def _end_micro(self, loss: torch.Tensor) -> None:
        self._micro += 1
        self._window_loss.append(loss.detach().float().reshape(()).cpu())
        self._require_layout().set_sync(self.sync_gradients)  # DDP reads it in the next forward

    @_explained
    def backward(self, loss: torch.Tensor, num_samples: int | None = None) -> None:
        """Backward of one micro-batch's ``loss`` (a scalar): scaled by loss scale / accumulation, with
        gradient communication only on the last micro-step of the window."""
        layout = self._require_layout()
        if layout.pipelined:
            raise PlaitError("with parallel.pp > 1 forward and backward interleave over pipeline micro-batches: "
                             "use loss = p.forward_backward(model, batch) instead of model(...) and p.backward")
        self.backward_checks(loss)
        with layout.context():
            self._backward(loss, self._weight(num_samples))

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
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise PlaitError(f"backward() needs a scalar loss; got {shape}. Reduce it first (loss.mean()), or "
                             "check the loss function returns one number per batch")
        if not loss.requires_grad:
            raise PlaitError("the loss does not require grad: compute it from the model returned by setup(), "
                             "outside torch.no_grad()")

    def _backward(self, loss: torch.Tensor, weight: float = 1.0) -> None:
        self._begin_micro()
        t0 = time.perf_counter()
        scale = self.scaler.scale * weight / self.accumulation
        if self.moe is not None:  # the auxiliary losses get the main loss's scale in this backward
            self.moe.set_grad_scale(scale)
        (loss * scale).backward()
        self._times["backward_s"] += time.perf_counter() - t0
        self._end_micro(loss)

    @_explained
    def forward_backward(self, model: nn.Module, batch: Any, loss_fn: Any = None) -> torch.Tensor:
        """Forward and backward of one micro-batch with ``loss_fn`` (default: the one given to setup,
        else inferred from the batch); returns this micro-batch's loss, detached. Works for every layout,
        pipeline parallelism included (where it returns 0 on ranks without the last stage)."""
        layout = self._require_layout()
        loss = self._loss_for(model, batch, loss_fn)
        batch = self.to_device(batch)
        self._enter_window()
        if layout.pipelined:
            self._begin_micro()
            t0 = time.perf_counter()
            if self.moe is not None:  # each pipeline micro-batch's auxiliary losses, scaled like its loss
                self.moe.set_grad_scale(self.scaler.scale / self.accumulation / self.config.parallel.microbatches)
            with autocast(self.config.train.precision, self.device):
                value = layout.forward_backward(batch, self.scaler.scale / self.accumulation)
            self._times["backward_s"] += time.perf_counter() - t0  # interleaved: all of it counts as backward
            self._end_micro(value)
            return value
        with layout.context():
            t0 = time.perf_counter()
            out = loss(model, batch)
            self._times["forward_s"] += time.perf_counter() - t0
            self.backward_checks(out)
            self._backward(out, self._weight(_batch_size(batch, loss) if self.shares is not None else None))
        return out.detach()

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
        from plait.parallel.tensor import local_value

        layout = self._require_layout()
        loss = self._loss_for(model, batch, loss_fn)
        batch = self.to_device(batch)
        with autocast(self.config.train.precision, self.device), layout.context():
            value = layout.evaluate(batch) if layout.pipelined else loss(model, batch)
        return layout.reduce_loss(local_value(value).detach().double().cpu().reshape(()))

    def _start_step(self) -> None:
        """Open the next step: phase, comm counters, and the torch-collective counter when it counts."""
        self.comm.stats.reset()
        self.comm.step = self.steps + 1  # named by a collective timeout
        self._in_window = False
        self._enter_window()
        layout = self.layout
        mode = self.config.observe.count_torch_collectives if layout is not None and layout.torch_collectives else "off"
        if mode == "every_step" or (mode == "first_step" and self._torch_bytes is None):
            self._counter = TorchCollectiveCounter(CommStats())
            self._counter.__enter__()

    @_explained
    def step(self) -> StepInfo | None:
        """At the end of an accumulation window: wait for gradient sync, unscale, clip (``optim.grad_clip``),
        skip the update if the gradients hold NaN/inf, optimizer step, scheduler step, zero grads. Returns
        the step's ``StepInfo``; None between boundaries."""
        layout = self._require_layout()
        if self._micro == 0 or self._micro % self.accumulation:
            return None
        self._micro = 0
        f = self.config.fault
        if self.rank == f.slow_rank and f.slow_factor > 1:  # testing aid: a slower worker, as on mixed hardware
            extra = (f.slow_factor - 1) * (self._times["forward_s"] + self._times["backward_s"])
            time.sleep(extra)
            self._times["backward_s"] += extra  # it stands for slower compute
        t0 = time.perf_counter()
        layout.finish()
        exposed = time.perf_counter() - t0
        self.watchdog.enter(self.steps + 1, "optimizer")
        self._in_window = False
        t1 = time.perf_counter()
        self.scaler.unscale(layout.grads())
        clip = self.config.optim.grad_clip if self.config.optim.grad_clip > 0 else float("inf")
        norm = layout.clip_grad_norm(clip)
        finite = math.isfinite(norm)
        target = layout.scheduler_target()
        lr = float(target.param_groups[0]["lr"]) if target is not None and target.param_groups else float("nan")
        if finite:
            if not self.memory and getattr(layout.optimizer, "state", None):
                # Parameters, reduced gradients and optimizer states all exist only here, from the
                # second update on: measure what this rank holds once.
                from plait.plan.memory import measure_model_state_bytes

                self.memory = measure_model_state_bytes(layout.model, getattr(layout, "optimizers", layout.optimizer))
            layout.step()
            if self.scheduler is not None:
                self.scheduler.step()
        else:
            self.skipped_steps += 1
            self.logger.warning("step %d: gradient norm is %s; update skipped", self.steps + 1, norm)
        self.scaler.update(not finite)
        layout.after_step()
        moe = self.moe.after_step(self.steps + 1) if self.moe is not None else None
        layout.zero_grad()
        self.finish_saves()  # an asynchronous save of the previous steps completes here, on every rank
        now = time.perf_counter()
        info = self._finish_step(norm, not finite, lr, exposed, now - t1, now - self._boundary_t)
        info.moe = moe
        info.ps = layout.step_metrics() if self.ps is not None else None
        self._boundary_t = now
        self._start_step()
        return info

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
        losses = self._window_loss
        # The pipeline's loss exists on the last stage only: summed over the pp group, every stage has it.
        loss = float(self.layout.reduce_loss(torch.stack(losses).mean())) if losses else float("nan")
        self._window_loss = []
        global_loss, preempted = self._agree(loss)
        info = StepInfo(step=self.steps, loss=loss, grad_norm=norm, skipped=skipped, lr=lr,
                        comm_bytes=stats.bytes_sent, comm_wait_s=stats.wait_s, comm_exposed_s=exposed,
                        optimizer_s=optimizer_s, step_s=step_s, **self._times, global_loss=global_loss,
                        preempted=preempted)
        self._write_progress()
        self._times = {"forward_s": 0.0, "backward_s": 0.0}
        if self.auto is not None and self.auto.observe(self.steps, exposed, step_s, stats.bytes_sent, stats.wait_s):
            decision = self.auto.decide(self.comm, self.topology.dp_group)
            self.logger.info("comm.compress=auto after step %d: %s", self.steps, decision["reason"])
        return info

    def _agree(self, loss: float) -> tuple[float, bool]:
        """What every rank must see alike at a step boundary: the loss averaged over the data-parallel
        replicas and whether any rank was asked to stop. Communication: one all-reduce of two numbers
        over the world (every rank of a replica holds the replica's loss, so the sum / world size is
        the mean over replicas)."""
        t = torch.tensor([loss, float(self.preemption.requested)], dtype=torch.float64)
        # A parameter server's workers meet only in sync mode (and ssp with staleness 0, which is sync): the
        # others run at their own pace (their loss is their own; a stop request is seen by the rank that got it).
        ps = self.config.ps
        if self.world_size > 1 and (self.ps is None or ps.mode == "sync" or (ps.mode == "ssp" and ps.staleness == 0)):
            self.comm.all_reduce_sum(t, self.group, name="step agreement")
            t[0] /= self.world_size
        return float(t[0]), bool(t[1] > 0)

    @property
    def preempted(self) -> bool:
        """Whether SIGTERM/SIGINT reached this rank (``StepInfo.preempted`` is the agreed value)."""
        return self.preemption.requested

    def _write_progress(self) -> None:
        """Rank 0 notes how far the run got, for the launcher's restart decision (``plait.fault.restart``)."""
        if self.is_main and self.state_dir is not None:
            write_progress(self.state_dir, steps=self.steps, saved=self.saved_step, start=self.resumed_from)

    # -- small collectives --------------------------------------------------------------------------
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
        from plait.data.resumable import checkpoint_state
        from plait.train.checkpoint import save_state

        layout = self._check_objects(model, optimizer)
        self.finish_saves()
        self.phase("checkpoint save")
        t0 = time.perf_counter()
        sched = scheduler or self.scheduler
        shared = {"scheduler": sched.state_dict() if sched is not None else None,
                  "dataloader": checkpoint_state(dataloader, self.group) if dataloader is not None else None,
                  "scaler": self.scaler.state_dict(), "steps": self.steps, "skipped_steps": self.skipped_steps,
                  "micro": self._micro, "param_groups": hyperparameters(layout.scheduler_target()),
                  "auto": self.auto.state_dict() if self.auto is not None else None}
        if self.ps is not None:  # the servers join this save and write their own shards (plait.ps.checkpoint)
            layout.begin_save(Path(path))
        meta = {"extra": extra or {}, "world_size": self.world_size, "dp": self.dp,
                "layout": self._kinds() or "single process", "steps": self.steps}
        rank_state = {"comm": self.comm.state_dict()}
        async_ = self.config.checkpoint.async_save
        group = self.ps.world if self.ps is not None else self._ckpt_group if self._ckpt_group is not None \
            else self.group
        pending = save_state(Path(path), layout, meta, self.rank, rank_state, shared, async_=async_, group=group)
        self.last_save_blocking_s = time.perf_counter() - t0
        if async_:
            self._pending = (pending, on_complete, self.steps)
        else:
            self._completed(pending.path, on_complete, self.steps)
        return pending.path

    def finish_saves(self) -> None:
        """Complete an asynchronous save still being written (collective; nothing when there is none)."""
        if getattr(self, "_pending", None) is None:
            return
        pending, on_complete, step = self._pending
        self._pending = None
        self.phase("checkpoint save")
        t0 = time.perf_counter()
        self._completed(pending.finish(), on_complete, step)
        self.finish_blocking_s += time.perf_counter() - t0  # the wait for the background completion

    def _completed(self, path: Path, on_complete: Callable[[Path], None] | None, step: int) -> None:
        self.logger.info("checkpoint saved: %s", path)
        self.saved_step = step
        self._write_progress()
        if on_complete is not None and self.is_main:
            on_complete(path)

    @_explained
    def load(self, path: str | Path, *, model: nn.Module | None = None, optimizer: Any = None,
             scheduler: Any = None, dataloader: Any = None, verify: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint written by ``save`` (at any world size or layout) into this run's objects;
        returns its ``extra``. Every file is first checked against the checkpoint's manifest
        (``checkpoint.verify``; ``verify`` overrides it): a damaged one raises ``CheckpointError`` naming
        the file. Collective: every rank calls it."""
        from plait.train.checkpoint import load_state

        layout = self._check_objects(model, optimizer)
        self.phase("checkpoint load")
        meta_path = Path(path) / "meta.json"
        same_world = True
        if meta_path.is_file():
            import json

            same_world = json.loads(meta_path.read_text()).get("world_size") == self.world_size
        check = self.config.checkpoint.verify if verify is None else verify
        self._meet()
        if self.ps is not None:  # the servers join this load and read their own shards
            layout.begin_load(Path(path), check)
        meta, rank_state, shared = load_state(Path(path), layout, self.rank, restore_rank=same_world, verify=check,
                                              group=self.ps.world if self.ps is not None else self.group)
        set_hyperparameters(layout.scheduler_target(), shared.get("param_groups"))
        sched = scheduler or self.scheduler
        if sched is not None and shared.get("scheduler") is not None:
            sched.load_state_dict(shared["scheduler"])
            if hasattr(sched, "get_last_lr"):  # the optimizer's lr is the one the schedule reached
                for g, lr in zip(layout.scheduler_target().param_groups, sched.get_last_lr(), strict=False):
                    g["lr"] = lr
        if dataloader is not None:
            if shared.get("dataloader") is None:
                raise PlaitError(f"{path} holds no data-loader position (it was saved without dataloader=)")
            dataloader.load_state_dict(shared["dataloader"])
        self.scaler.load_state_dict(shared["scaler"])
        self.steps, self.skipped_steps = int(shared["steps"]), int(shared["skipped_steps"])
        self.resumed_from = self.steps  # the launcher's no-progress rule compares where attempts started
        if self.ps is not None:  # the servers' versions and this worker's clock; every worker pulls the weights
            layout.finish_load()
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

    def _check_objects(self, model: Any, optimizer: Any) -> Layout:
        layout = self._require_layout()
        if model is not None and model is not layout.model:
            raise PlaitError("save/load got a model other than the one setup() returned; pass that one")
        if optimizer is not None and optimizer is not layout.optimizer:
            raise PlaitError("save/load got an optimizer other than the one setup() returned; pass that one")
        return layout

    @_explained
    def full_state_dict(self, model: nn.Module | None = None, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's weights under its single-process names, unsharded, on the CPU, on every rank
        (``rank0_only``: only rank 0's is sure to be filled, which spares the others the memory).
        Collective: gathers FSDP, tensor-parallel and pipeline shards."""
        layout = self._check_objects(model, None)
        self.phase("export")
        return {k: v.detach().cpu() for k, v in layout.full_model_state(rank0_only).items()}

    def export(self, model: nn.Module | None, path: str | Path) -> Path:
        """Write the full weights as safetensors at ``path`` (rank 0 writes; every rank calls it)."""
        from plait.train.export import export_safetensors

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
        if not self.is_main:
            return
        from plait.observe.metrics import MetricsWriter, ProgressBar

        rec = {"step": step if step is not None else record.get("step", self.steps), **record}
        if self._metrics is None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._metrics = MetricsWriter(self.run_dir, True, self.config.observe.tensorboard)
        self._metrics.log(rec)
        if self._bar is None and self.config.observe.progress:
            self._bar = ProgressBar(self.config.train.steps, 0, True)
        if self._bar is not None and "loss" in rec:
            self._bar.update(int(rec["step"]), float(rec["loss"]), float(rec.get("tokens_per_s", 0.0)), rec.get("mfu"))

    @_explained
    def truncate_metrics(self, step: int) -> None:
        """Rank 0: drop ``metrics.jsonl`` records of steps after ``step`` (they belong to a timeline a
        restart or a rollback undid), so the file reads as one run."""
        if not self.is_main:
            return
        path = self.run_dir / "metrics.jsonl"
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if path.is_file():
            import json

            kept = []
            for line in path.read_text().splitlines():
                try:
                    if int(json.loads(line).get("step", 0)) <= step:
                        kept.append(line)
                except (ValueError, AttributeError):
                    continue
            path.write_text("".join(x + "\n" for x in kept))

    def report(self) -> dict[str, Any]:
        """Layout results (pipeline bubble, memory predicted against measured, communication) for a
        summary; collective."""
        layout = self._require_layout()
        self.phase("report")
        out: dict[str, Any] = dict(layout.report(self.run_dir if self.is_main else None))
        precision = "bf16" if self.config.train.precision != "fp32" else "fp32"
        data_parallel_only = self.topology.degree("tp") == self.topology.degree("pp") == 1
        if self.ps is None:  # its all-gather spans the world, where a parameter server's servers have ended
            out["memory"] = memory_report(sum(p.numel() for p in _unique_params(layout)), self.config.parallel.zero,
                                          self.dp, precision, self.memory or None, self.device,
                                          predict=data_parallel_only)
        c = self.config.comm
        out["comm"] = {"allreduce": c.allreduce, "compress": c.compress, "compress_active": self.comm.compress_active}
        if self.auto is not None:
            out["comm_auto"] = self.auto.decision or {
                "decision": "undecided", "reason": f"the run ended before the measurement window "
                f"(steps {self.auto.first}-{self.auto.last}) was complete; compression stayed off"}
        return out

    def _meet(self) -> None:
        """Before a collective among a parameter server's workers (``PsLayout.meet``)."""
        if self.ps is not None and self.layout is not None and not self.ps.is_server:
            self.layout.meet()

    def explain(self, exc: BaseException) -> BaseException:
        """A backend timeout or lost peer as the error naming the ranks that did not arrive; the ranks it
        names that run on this host and are stuck (stopped, hung) are ended, so the attempt ends within
        seconds and the restart policy applies (``StepWatchdog.end_stuck_peers``)."""
        from plait.comm.guard import CollectiveTimeout

        named = self.watchdog.explain(exc)
        if isinstance(named, CollectiveTimeout) and named.ranks:
            # This rank's report first: the peers ended next fail at once, and the launcher names the
            # earliest report as the cause.
            write_error(named, self.rank, self.error_dir)
            self.watchdog.end_stuck_peers(named.ranks)
        return named

    def close(self) -> None:
        """Stop the watchdog and the comm thread, close metrics files; the process group stays."""
        if self._closed:
            return
        self.finish_saves()
        self._closed = True
        if self.ps is not None and self.layout is not None:
            self.layout.close()  # a worker tells the servers it is done: they end when every worker has
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None
        if self._bar is not None:
            self._bar.close()
        if self._metrics is not None:
            self._metrics.close()
        self.watchdog.close()
        self.comm.close()
        self.preemption.uninstall()

    def __enter__(self) -> Plait:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unique_params(layout: Layout) -> list[nn.Parameter]:
    return list({id(p): p for _, p in layout.named_parameters()}.values())


def _batch_size(batch: Any, loss: Loss) -> int:
    """Samples in a micro-batch: the first dimension of its first input."""
    args, kwargs, _ = loss.split(batch)
    x = args[0] if args else next(iter(kwargs.values()))
    return int(x.shape[0])
