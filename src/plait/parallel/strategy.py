"""The strategy contract: the one interface between the engine and a parallel layout, and its registry.

A strategy takes the user's model and optimizer and trains them over the ranks one way: data parallelism
(plait's reducer or DDP), ZeRO-1/2, ZeRO-3 on FSDP2, tensor, pipeline or expert parallelism, a parameter
server, or a layout of yours. ``plait.Plait`` (the engine) asks the strategy, and only the strategy, how to
build the optimizer, run a micro-step, synchronise and clip gradients, step, checkpoint, export and report;
it holds no ``if`` about any layout. Lightning Fabric's ``Strategy`` is the model: one base class with a
default for everything a layout may have nothing to do for.

Two levels:

* **The class** is what the registry holds (``register_strategy``): ``applies(cfg)`` and ``priority`` choose
  it for a config (``parallel.strategy = "auto"``, the default; or by ``name``), ``check(cfg, degrees)``
  rejects the settings it cannot train with one clear message before any process starts (``plait.validate``
  runs every registered strategy's check), ``resolve_degrees``/``build_topology`` lay out the ranks, and
  ``apply`` builds an instance around a model. ``Wrapper`` classes compose around the chosen strategy
  (expert parallelism around any data-parallel layout; ``plait.parallel.wrapper``): composition is by
  wrapping, in the order of ``plait.parallel.apply``.
* **The instance** does one training run's work. The engine calls, per optimizer step: ``backward`` or
  ``forward_backward`` per micro-step (``set_sync`` / ``no_sync`` keep gradients local on all but the last
  micro-step of an accumulation window), then ``finish`` (complete the gradient synchronisation; its wait
  is the step's exposed communication), ``clip_and_step``, ``after_step`` and ``zero_grad``. Checkpoints go
  through ``state_dicts`` / ``load_state_dicts`` (one format for every layout: the single-process model's
  names) with the hooks around them (``save_planner``, ``begin_save``, ``begin_load``, ``finish_load``,
  ``checkpoint_group``); ``full_model_state`` is the export; ``step_metrics`` and ``report`` feed metrics.

Adding a layout is a new module with a ``Strategy`` subclass decorated with ``@register_strategy`` (its
checks, its state, its tests and docs): nothing in the engine, the trainer or the checkpoint code changes.
``tests/parallel/test_registry.py`` trains a strategy defined in the test itself.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from plait.comm.collectives import Comm
from plait.components.optim import materialize_optimizer_state
from plait.components.precision import LossScaler, autocast
from plait.config import Config, ConfigError, ParallelConfig
from plait.observe.memory import memory_report
from plait.parallel.apply import ModelSpec, check_model, compose_model
from plait.parallel.compile import CompilePlan, compile_model, fusable, fused_loss
from plait.parallel.meta_init import InitFn, ModelFacts, initialise, materialise
from plait.parallel.prepare import broadcast_weights, route_forward, sync_batchnorm
from plait.plan.memory import predict_setup_bytes
from plait.topology import Topology, build_topology, resolve_degrees

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]


class LayoutError(ConfigError):
    """A model or optimizer this layout cannot take; the message says what to do."""


class PlaitError(ConfigError):
    """The API was used in a way that cannot work; the message says what to do instead (``plait.PlaitError``)."""


class RankDone(SystemExit):
    """Raised by ``Plait.setup`` on a rank whose part of the run ends there (a parameter server's server
    ranks, once every worker has finished): the process exits with status 0 unless the caller catches it.
    ``stats`` is that rank's summary, under ``key`` in what ``plait train`` returns."""

    key = "rank_done"

    def __init__(self, stats: dict[str, Any]) -> None:
        super().__init__(0)
        self.stats = stats


class Strategy:
    """One way of training a model over the ranks (see the module docstring); defaults for one process.

    The defaults are those of a replicated model whose gradients need no communication: a strategy
    overrides what it does differently. Subclasses set ``name`` and register with ``register_strategy``.
    """

    name: ClassVar[str] = ""
    # auto selection: the registered strategy with the highest priority whose applies() holds is used
    priority: ClassVar[int] = 0
    # what the rank's copy of the model is called in messages ("data-parallel", "tensor-parallel", ...)
    kind: ClassVar[str] = ""
    # whether torch issues the collectives (DDP, FSDP2, DTensor, pipelining) rather than plait's Comm:
    # the engine counts those with plait.comm.accounting.TorchCollectiveCounter
    torch_collectives: bool = False
    # gradients held are shards of the data-parallel world's (ZeRO, FSDP): a wrapper sums their norms there
    shards_gradients: ClassVar[bool] = False
    # a wrapper (plait.parallel.wrapper.Wrapper) is composed around the chosen strategy instead of chosen
    is_wrapper: ClassVar[bool] = False
    # whether the user's model runs whole on each rank (False: it is split over ranks, like a pipeline's,
    # and ``forward_backward`` runs each micro-step; evaluation batches are then kept whole: drop_last)
    model_whole: ClassVar[bool] = True
    # whether the class takes a model still on the meta device and shards or splits it itself (FSDP2, a
    # pipeline): ``apply`` then allocates what is left on meta after building it, so each rank allocates only
    # its part. Otherwise the composed model (after the tensor-parallel plan) is allocated before it.
    shards_meta: ClassVar[bool] = False
    # why ``train.compile`` compiles this layout's model block by block (empty: the whole model may be one
    # compiled region, with the loss; plait.parallel.compile)
    compile_blocks_because: ClassVar[str] = ""
    # whether ``reduce_loss`` runs at every step, not only at log steps, so that ``StepInfo.loss`` is the
    # replica's on every rank (a pipeline: its last stage's loss, brought to every stage by one small all-reduce)
    reduce_loss_every_step: ClassVar[bool] = False

    @classmethod
    def layout_class(cls, cfg: Config) -> type[Strategy]:
        """The class whose class-level facts (``compile_blocks_because``) describe the layout ``cfg`` trains: this
        one, or for a strategy built around the one a config's other settings choose (``fault.mode=replicas``), that
        one."""
        return cls

    @classmethod
    def wants_sample(cls, cfg: Config) -> bool:
        """Whether ``apply`` uses a sample micro-batch (a pipeline balancing its stages by measured cost)."""
        return False

    # -- the class: selection, checks, ranks ---------------------------------------------------------
    @classmethod
    def applies(cls, p: ParallelConfig) -> bool:
        """Whether ``parallel.strategy = "auto"`` picks this strategy for ``p`` (highest priority first)."""
        return False

    @classmethod
    def chosen_for(cls, cfg: Config | ParallelConfig) -> bool:
        """Whether ``parallel.strategy = "auto"`` picks this strategy for the config (or its [parallel] section
        alone): ``applies`` on the [parallel] section, unless a strategy is chosen by a setting outside it."""
        return cls.applies(cfg.parallel if isinstance(cfg, Config) else cfg)

    @classmethod
    def check(cls, cfg: Config, degrees: dict[str, int]) -> None:
        """Reject the settings this strategy owns that cannot work with these degrees (a ``ConfigError``
        naming the fix). Every registered strategy's check runs for every config: each checks its own keys."""

    @classmethod
    def resolve_degrees(cls, cfg: Config, world_size: int) -> dict[str, int]:
        """Mesh degrees for ``world_size`` ranks (``plait.topology.resolve_degrees`` by default)."""
        return resolve_degrees(cfg, world_size)

    @classmethod
    def build_topology(cls, cfg: Config, device: torch.device) -> Topology:
        """The topology of this process's run (its ranks, mesh and groups); collective on every rank."""
        return build_topology(cfg, device)

    @classmethod
    def apply(cls, model: nn.Module, topo: Topology, cfg: Config, comm: Comm, spec: ModelSpec) -> Strategy:
        """The strategy around ``model`` (on this rank's device). By default: the model checked against the
        layout before any collective, rank 0's weights broadcast, BatchNorm synchronised if asked, then the
        composition order of ``plait.parallel.apply`` (tensor parallel, experts, activation checkpointing,
        compile) and this class built around the result."""
        check_model(model, topo, cfg.parallel, spec)
        facts = ModelFacts.of(model)
        if not facts.meta:  # a meta model has no weights yet: each rank fills its part (prepare_weights)
            broadcast_weights(model, comm, topo.world_size)
        if cfg.parallel.sync_batchnorm and topo.dp > 1:
            model = sync_batchnorm(model, topo.dp_group, topo.device)
        model = compose_model(model, topo, cfg.parallel, cfg.train, cfg.moe.dispatcher, spec)
        if facts.meta and not cls.shards_meta:
            materialise(model, topo.device)
        strategy = cls(model, cfg, topo, comm, spec)
        if facts.meta:
            materialise(strategy.model, topo.device)
        strategy.facts = facts
        return strategy

    # -- the instance --------------------------------------------------------------------------------
    optimizer: Any = None
    _facts: ModelFacts | None = None
    _trainable: list[nn.Parameter] | None = None
    _compiler: Any = None  # the whole-model compile plan's compiler (forward_backward fuses the loss with it)
    _fused: dict[int, Any]
    # what the engine measured of setup on this rank (plait.observe.memory.SetupMeter); ``report`` puts it
    # next to the prediction
    setup_memory: dict[str, Any] | None = None

    def __init__(self, model: nn.Module, cfg: Config, topo: Topology, comm: Comm,
                 spec: ModelSpec | None = None) -> None:
        self.model = model  # what the user runs forward on: their own model object
        self.cfg, self.topo, self.comm = cfg, topo, comm
        self.precision = cfg.train.compute_precision
        self._fused = {}

    # building
    def build_optimizer(self, factory: OptimizerFactory) -> Any:
        """The optimizer from the user's factory, over the parameters this strategy trains."""
        self.optimizer = factory(self.model)
        return self.optimizer

    @property
    def optimizers(self) -> list[Any]:
        """Every optimizer holding state (what memory accounting reads)."""
        return [self.optimizer]

    def scheduler_target(self) -> torch.optim.Optimizer:
        """The torch optimizer an LR scheduler is attached to (and whose hyperparameters a checkpoint keeps)."""
        return self.optimizer

    def start(self, leaving: Callable[[], None]) -> None:
        """After the optimizer is built. A rank that does not run the user's loop (a parameter server's
        server) calls ``leaving()`` (the engine stops bounding its phases), does its part here and ends by
        raising ``RankDone``."""

    def begin(self, run: Any) -> None:
        """At the end of setup, once the optimizer and the LR scheduler exist. ``run`` (``plait.engine.run_access
        .RunAccess``) reads and restores the engine's run state (step count, schedule, loss scale, the training
        loader's position): a strategy whose replicas heal from live peers (``fault.mode=replicas``) joins here."""

    def uses_autocast(self) -> bool:
        """Whether the model's forward runs under autocast (False where the layout casts, e.g. FSDP2's
        mixed-precision policy)."""
        return self.precision != "fp32"

    def forward_wrapper(self) -> Callable | None:
        """A callable running the model's forward through the layout's wrapper (DDP), or None."""
        return None

    def wrap_forward(self, device: torch.device, plan: CompilePlan | None = None) -> None:
        """Make the user's ``model(...)`` run through ``forward_wrapper`` and under autocast; with a whole-model
        compile plan (``plait.parallel.compile``), as one compiled region, which ``forward_backward`` extends over
        the loss."""
        route_forward(self.model, self.forward_wrapper(), self.precision, self.uses_autocast(), device)
        if plan is not None and plan.unit == "model":
            compile_model(self.model, plan.compiler)
            self._compiler = plan.compiler

    # one micro-step
    def set_sync(self, enabled: bool) -> None:
        """Whether the next backward communicates gradients (False on non-final accumulation micro-steps)."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Context for a micro-step whose gradients stay local."""
        return contextlib.nullcontext()

    def context(self) -> contextlib.AbstractContextManager:
        """Context forward and backward run in (tensor parallelism's loss parallelism); none by default."""
        return contextlib.nullcontext()

    def evaluation(self) -> contextlib.AbstractContextManager:
        """Context an evaluation loop runs in: the weights it scores are the model's own by default; a layout whose
        replicas train weights of their own between synchronisations (DiLoCo) puts the ones they agree on in place."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, scale: float | torch.Tensor) -> None:
        """Backward of one micro-batch's loss computed by the user's own forward, times ``scale`` (a float, or the
        loss scaler's device tensor); a scale of 1 multiplies nothing (its gradient would be the same)."""
        (loss if isinstance(scale, float) and scale == 1.0 else loss * scale).backward()

    def forward_backward(self, model: nn.Module, batch: Any, loss: Any, scale: float,
                         before_backward: Callable[[float], None] | None = None,
                         times: dict[str, float] | None = None) -> torch.Tensor:
        """Forward, loss and backward of one micro-batch (already on the device); returns the loss, detached.
        ``before_backward(scale)`` runs just before backward; ``times`` collects forward_s/backward_s."""
        import time

        t0 = time.perf_counter()
        out = self._loss_value(model, batch, loss)
        t1 = time.perf_counter()
        check_loss(out)
        if before_backward is not None:
            before_backward(scale)
        self.backward(out, scale)
        if times is not None:
            times["forward_s"] += t1 - t0
            times["backward_s"] += time.perf_counter() - t1
        return out.detach()

    def _loss_value(self, model: nn.Module, batch: Any, loss: Any) -> torch.Tensor:
        """``loss(model, batch)``; with the whole model compiled, the model and the loss in one region
        (``plait.parallel.compile.fused_loss``, one per loss object)."""
        if self._compiler is None or model is not self.model or not fusable(loss):
            return loss(model, batch)
        run = self._fused.get(id(loss))
        if run is None:
            run = self._fused[id(loss)] = fused_loss(model, loss, self._compiler)
        return run(batch)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch: Any, loss: Any) -> torch.Tensor:
        """One batch's loss without gradients, on the rank's device."""
        with autocast(self.precision, self.topo.device), self.context():
            return loss(model, batch)

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """This rank's losses (any shape: one per step since the last log step) as values every rank of its model
        replica agrees on. Called at log steps only (a collective where the layout needs one), or at every step
        with ``reduce_loss_every_step``."""
        return loss

    # one optimizer step
    def finish(self) -> None:
        """Complete gradient synchronisation (the engine times the wait as exposed communication)."""

    def trainable(self) -> list[nn.Parameter]:
        """This rank's trainable parameters, listed once (the layout does not change them after setup)."""
        if self._trainable is None:
            self._trainable = [p for p in self.model.parameters() if p.requires_grad]
        return self._trainable

    def grads(self) -> list[torch.Tensor]:
        """The gradient tensors the optimizer will read (what loss-scale unscaling divides)."""
        return [p.grad for p in self.trainable() if p.grad is not None]

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor | float:
        """Clip to ``max_norm`` (inf: measure only); returns the global pre-clip norm, a 0-dim tensor on the device
        (nothing read: torch's coefficient ``max_norm / (norm + 1e-6)``, at most 1, multiplies on the device). A
        layout may return a float it read on the host; the step's skip is then decided there."""
        params = self.trainable()
        # foreach=None: torch's choice, the per-tensor loop on the CPU, multi-tensor kernels on a GPU
        if math.isinf(max_norm):  # the norm only: a coefficient of 1 would multiply every gradient for nothing
            grads = [p.grad for p in params if p.grad is not None]
            return torch.nn.utils.get_total_norm(grads, foreach=None) if grads else torch.zeros(())
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=None)

    def step(self) -> None:
        """The optimizer update (the gradients are finite and clipped)."""
        self.optimizer.step()

    def clip_and_step(self, max_norm: float, scaler: LossScaler, before_step: Callable[[], None]
                      ) -> tuple[torch.Tensor | float, torch.Tensor | bool]:
        """Unscale, clip (the global norm over every shard), and step unless the norm is non-finite (after
        ``before_step``); returns (pre-clip norm, skipped). Every rank sees the same norm, so all skip or step
        together. On the device: the norm is a 0-dim tensor and ``skipped`` a 0-dim float tensor (1.0: the update
        did not run), decided by ``step_unless``; a layout whose ``clip_grad_norm`` returns a float decides on
        the host (``skipped`` a bool)."""
        if scaler.enabled:  # no gradient list for a scaler that is off
            scaler.unscale(self.grads())
        norm = self.clip_grad_norm(max_norm)
        if not isinstance(norm, torch.Tensor):
            skipped = not math.isfinite(norm)
            if not skipped:
                before_step()
                self.step()
            return norm, skipped
        found = nonfinite(norm)
        before_step()
        self.step_unless(found)
        return norm, found

    def torch_optimizers(self) -> list[torch.optim.Optimizer] | None:
        """The torch optimizers ``step`` runs (a ZeRO optimizer's inner one), or None where one is not a torch
        optimizer (then the skip of a non-finite step is decided on the host)."""
        out = []
        for o in self.optimizers:
            o = o if isinstance(o, torch.optim.Optimizer) else getattr(o, "optimizer", None)
            if not isinstance(o, torch.optim.Optimizer):
                return None
            out.append(o)
        return out

    def skips_on_device(self) -> bool:
        """Whether every optimizer ``step`` runs takes torch's ``found_inf`` (``step_unless``)."""
        opts = self.torch_optimizers()
        return bool(opts) and all(getattr(o, "_step_supports_amp_scaling", False) for o in opts)

    def step_unless(self, found: torch.Tensor) -> None:
        """``step``, unless ``found`` (a 0-dim float tensor on the device) is 1. Optimizers that take torch's
        ``found_inf`` (fused Adam/AdamW/SGD/Adagrad, ``_step_supports_amp_scaling``: plait's AdamW on a GPU) skip
        on the device, parameters, states and step counts untouched: the host reads nothing. Any other
        optimizer needs the decision on the host: one read of ``found`` per step (on a GPU, a wait for the
        gradients), the only device-to-host read of a non-logging step."""
        opts = self.torch_optimizers()
        if self.skips_on_device():
            for o in opts:
                o.found_inf = found
            try:
                self.step()
            finally:
                for o in opts:
                    del o.found_inf
        elif not bool(found):
            self.step()

    def after_step(self) -> None:
        """After every optimizer step, stepped or skipped, once the LR scheduler has stepped (buffers averaged)."""

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def items_ranks(self) -> int:
        """The data-parallel ranks over which ``num_items_in_batch`` sums the step's token counts (over the data-
        parallel group) and the gradients are averaged: every data-parallel rank unless the layout averages its
        gradients some other way."""
        return self.topo.dp

    def agreement_group(self, default: Any) -> tuple[bool, Any]:
        """Whether the ranks agree on the loss and a stop request at every step boundary, and over which
        group (``default``: the training ranks'). Ranks that run at their own pace do not."""
        return True, default

    def before_collective(self) -> None:
        """Just before a collective among the training ranks that the user's loop calls."""

    def step_metrics(self) -> dict[str, Any]:
        """This rank's strategy-specific figures of the step just taken (merged into the metrics record)."""
        return {}

    # state
    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's trainable parameters under the single-process model's names."""
        return [(n.replace("_checkpoint_wrapped_module.", ""), p) for n, p in self.model.named_parameters()]

    def state_dicts(self) -> tuple[dict, dict]:
        """(model, {"state": optimizer states}) keyed by the single-process model's names: the one checkpoint
        format of every layout. The optimizer state is created first if no step ran, so the result can serve
        as a load template."""
        materialize_optimizer_state(self.optimizer)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        self._param_groups = optim_sd["param_groups"]
        return model_sd, {"state": optim_sd["state"]}

    def load_state_dicts(self, model_sd: dict, optim_sd: dict) -> None:
        """Load a checkpoint's states; hyperparameters stay this run's (an LR scheduler restores its own)."""
        full = {"state": optim_sd["state"], "param_groups": self._param_groups}
        set_state_dict(self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=full)

    def save_planner(self) -> Any:
        """DCP's save planner for this strategy's entries (None: DCP's default)."""
        return None

    def load_planner(self) -> Any:
        """DCP's load planner for this strategy's entries (None: DCP's default)."""
        return None

    def checkpoint_group(self, default: Any) -> Any:
        """The process group a checkpoint's collectives run over (``default``: the engine's)."""
        return default

    def begin_save(self, path: Path) -> None:
        """Before the checkpoint collective of a save (a parameter server's servers join it)."""

    def begin_load(self, path: Path, verify: bool) -> None:
        """Before the checkpoint collective of a load."""

    def finish_load(self) -> None:
        """After a load's collective (a parameter server's workers pull the loaded weights)."""

    def retie(self) -> None:
        """After this rank's weights were written from outside the layout, each rank on its own (a replica group's
        heal from a live peer): make the copies of a parameter the layout keeps on several ranks equal again (a
        pipeline's tied embedding and head, on the first and last stage). Nothing by default: one copy each."""

    # weights of models larger than one process (plait.parallel.weights, plait.parallel.meta_init)
    @property
    def facts(self) -> ModelFacts:
        """What the whole model is (names, shapes, ties), recorded by ``apply`` before the layout."""
        if self._facts is None:
            self._facts = ModelFacts.of(self.model)
        return self._facts

    @facts.setter
    def facts(self, value: ModelFacts) -> None:
        self._facts = value

    def model_entries(self) -> dict[str, torch.Tensor]:
        """This rank's state-dict entries (parameters, persistent buffers) under the single-process model's
        names: DTensors where sharded; the model's own tensors, so writing into them writes the model."""
        sd = self.model.state_dict(keep_vars=True)
        return {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in sd.items() if isinstance(v, torch.Tensor)}

    def prepare_weights(self, weights: str | Path | None, init_fn: InitFn | None, seed: int, group: Any) -> None:
        """Fill this rank's part of the model before the optimizer is built: from the checkpoint at ``weights``
        (each rank reads its own slices; ``group`` is the training ranks'), else, for a model built on the meta
        device, by ``plait.parallel.meta_init.initialise`` (``init_fn(module)`` or the modules' own init, seeded
        by ``seed`` and module name). A model built normally keeps its weights."""
        from plait.parallel.weights import load_weights

        if weights is not None:
            load_weights(self.facts, self.model_entries(), weights, group, self.facts.kind)
        elif self.facts.meta:
            initialise(self.facts, self.model_entries(), seed, init_fn)
        elif init_fn is not None:
            raise PlaitError("init_fn initialises a model built on the meta device (under torch.device('meta')); "
                             "this model has its weights already: drop init_fn, or build it on the meta device")

    def export_weights(self, out: Path, group: Any, coordinator: bool, max_shard_bytes: int) -> Path:
        """Write the model as a Hugging Face directory, as ``save_pretrained`` names it (``model.safetensors``, or
        ``model-0000k-of-0000n.safetensors`` and the index; ``config.json``): every rank writes its own shards;
        collective over ``group``."""
        from plait.parallel.weights import export_weights

        return export_weights(self.facts, self.model_entries(), out, group, coordinator, max_shard_bytes)

    def full_model_state(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights under the single-process names; every rank calls it. With
        ``rank0_only`` other ranks may get an empty dict (layouts that gather save the memory)."""
        return self.model.state_dict()

    # reporting
    def describe(self) -> str:
        """The kinds of parallelism in use, for messages ("tensor-parallel/FSDP"); empty for one process."""
        t, z = self.topo, self.cfg.parallel.zero
        used = (("tensor-parallel", t.degree("tp") > 1), ("pipeline", t.degree("pp") > 1),
                ("expert", t.degree("ep") > 1), ("FSDP", z == 3 and not t.hybrid), ("HSDP", z == 3 and t.hybrid),
                ("ZeRO", z in (1, 2)),
                ("data-parallel", t.dp > 1 and z == 0))
        return "/".join(name for name, on in used if on)

    def report(self, run_dir: Path | None, measured: dict[str, int] | None, device: torch.device) -> dict[str, Any]:
        """This strategy's part of the run summary: the per-rank memory prediction against ``measured``, and
        the peak of setup (``setup_memory``) against its prediction (collective: an all-gather over the
        world); layouts add their own blocks."""
        unique = {id(p): p for _, p in self.named_parameters()}.values()
        params = sum(p.numel() for p in unique)
        precision = "bf16" if self.precision != "fp32" else "fp32"
        data_parallel_only = self.topo.degree("tp") == self.topo.degree("pp") == 1
        t, p = self.topo, self.cfg.parallel
        setup = None
        if data_parallel_only:  # the whole model given on every rank, or (meta-built) each rank allocating its part
            setup = predict_setup_bytes(sum(q.numel() * q.element_size() for q in unique),
                                        sum(b.numel() * b.element_size() for b in self.model.buffers()),
                                        world=t.world_size, zero=p.zero, dp=t.dp, shard=t.shard_degree,
                                        bucket_mb=p.bucket_mb, source="shards" if self.facts.meta else "whole")
        # ZeRO shards over the shard group: every data-parallel rank, or dp_shard of them under HSDP
        return {"memory": memory_report(params, p.zero, t.shard_degree, precision, measured or None, device,
                                        predict=data_parallel_only, setup=self.setup_memory, setup_predicted=setup)}

    def close(self) -> None:
        """At the end of the run (a parameter server's worker tells the servers it is done)."""


def nonfinite(norm: torch.Tensor) -> torch.Tensor:
    """1.0 where ``norm`` is NaN or infinite, else 0.0: a 0-dim float32 tensor on the norm's device (torch's
    ``found_inf``), computed without reading it."""
    return torch.logical_not(torch.isfinite(norm)).to(torch.float32)


def check_loss(loss: Any) -> None:
    """A clear error for a loss that cannot be backpropagated: not a scalar, or not from the model."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise PlaitError(f"backward() needs a scalar loss; got {shape}. Reduce it first (loss.mean()), or "
                          "check the loss function returns one number per batch")
    if not loss.requires_grad:
        raise PlaitError("the loss does not require grad: compute it from the model returned by setup(), "
                          "outside torch.no_grad()")


# -- the registry ------------------------------------------------------------------------------------
_STRATEGIES: dict[str, type[Strategy]] = {}
_WRAPPERS: dict[str, type[Strategy]] = {}


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make ``cls`` selectable (by ``applies`` and ``priority``, or by
    ``parallel.strategy = cls.name``) and run its ``check`` on every config. A ``Wrapper`` subclass is
    composed around the chosen strategy where its ``wraps`` holds."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a name to be registered")
    table: dict = _WRAPPERS if cls.is_wrapper else _STRATEGIES
    if table.get(cls.name, cls) is not cls and table[cls.name].__qualname__ != cls.__qualname__:
        raise ValueError(f"a strategy named {cls.name!r} is already registered ({table[cls.name].__qualname__})")
    table[cls.name] = cls
    return cls


def strategy_table() -> tuple[dict[str, type[Strategy]], dict[str, type[Strategy]]]:
    """The registered strategies and wrappers by name (``plait.parallel.registry`` adds the built-ins)."""
    return _STRATEGIES, _WRAPPERS
