"""The gradient-synchronisation policy: how the gradients of the data-parallel ranks become one, and the registry
of policies.

``plait.parallel.compose.parallelize`` applies exactly one policy to a model after its model-side dimensions
(tensor, expert, context, checkpointing, compile) and its pipeline split: plait's bucketed reducer
(``plait.parallel.data.sync``), PyTorch DDP (same module), ZeRO-1/2's sharded optimizer (``plait.parallel.zero.sync``),
FSDP2/HSDP (``plait.parallel.fsdp.sync``), a parameter server (``plait.ps.strategy``) or one of yours
(``register_grad_sync``). A policy never knows which model-parallel dimensions ran before it: it receives the
modules a rank holds (the whole model, or its pipeline stages) and their parameters, some of them DTensors (tensor
parallelism) or expert shards, and works on each parameter's local tensor over the process group it is given.

What every policy answers (the base class's defaults are those of one rank with nothing to communicate):

* ``wrap(module, blocks)`` before a stage or the model runs (FSDP2 makes its units here), ``attach(holder, params)``
  once this rank's modules exist (the reducer's hooks, DDP's wrapper), ``build_optimizer`` (ZeRO builds its own over
  flat shards);
* per micro-step ``set_sync`` / ``no_sync`` (accumulation) and ``schedule_context`` (a pipeline's micro-batches);
  ``finish`` completes the reduction;
* ``grads`` (what the optimizer reads, for loss-scale unscaling), ``norm_pieces`` (this rank's gradient squares with
  the groups they are summed over, for the global norm) and ``scale_grads``; ``zero_grad``;
* ``optimizer_state`` / ``load_optimizer_state`` keyed by the single-process names, ``full_state`` (gathering).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from plait.comm.collectives import Comm
from plait.components.optim import materialize_optimizer_state
from plait.config import Config, ConfigError, ParallelConfig
from plait.parallel.data.reducer import local_grad
from plait.parallel.units import batchnorm_buffers
from plait.topology import Topology

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
# (sum of squares as a 0-dim float tensor on the device, the process groups it is summed over)
NormPiece = tuple[torch.Tensor, tuple[Any, ...]]

# The elementwise torch optimizers: sharding their flat buffers computes exactly what they compute whole.
ELEMENTWISE = ("Adam", "AdamW", "SGD", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop", "Adadelta", "ASGD",
               "Rprop")


class LayoutError(ConfigError):
    """A model or optimizer this layout cannot take; the message says what to do."""


def check_elementwise(cls: type, what: str, instead: str) -> None:
    """A ``LayoutError`` unless ``cls`` is one of torch's elementwise optimizers, whose update on flat
    shards equals the unsharded one."""
    if cls.__name__ not in ELEMENTWISE or not cls.__module__.startswith("torch.optim"):
        raise LayoutError(f"{what} shards each optimizer state into flat slices, which computes the unsharded "
                          f"update only for elementwise optimizers ({', '.join(ELEMENTWISE)} from torch.optim); "
                          f"{cls.__module__}.{cls.__name__} is not one of them. {instead}")


def shard_groups(t: torch.Tensor) -> tuple[Any, ...]:
    """The process groups a DTensor (a parameter or its gradient) is sharded over: its sum of squares is summed
    there (tp for a Megatron shard, the data-parallel axes for an FSDP shard, both for a 2-D one). Empty for a
    plain tensor: every rank holding it holds all of it."""
    if not isinstance(t, DTensor):
        return ()
    mesh = t.device_mesh
    return tuple(mesh.get_group(i) for i, pl in enumerate(t.placements)
                 if pl.is_shard() or isinstance(pl, _StridedShard))


def squares_by_groups(pieces: Iterable[NormPiece]) -> torch.Tensor:
    """The global squared norm: each piece's sum of squares all-reduced over its groups (pieces with the same
    groups added first: one all-reduce per distinct set of groups), then added; float64, on the device."""
    sums: dict[tuple[int, ...], tuple[torch.Tensor, tuple[Any, ...]]] = {}
    for sq, groups in pieces:
        key = tuple(id(g) for g in groups)
        if key in sums:
            sums[key] = (sums[key][0] + sq.double(), groups)
        else:
            sums[key] = (sq.double(), groups)
    total = None
    for sq, groups in sums.values():
        for g in groups:
            dist.all_reduce(sq, group=g)
        total = sq if total is None else total + sq
    return total if total is not None else torch.zeros((), dtype=torch.float64)


def param_pieces(pairs: Iterable[tuple[nn.Parameter, torch.Tensor]]) -> list[NormPiece]:
    """(parameter, its local gradient) pairs as norm pieces: each gradient's squares over the groups its
    parameter is sharded on."""
    return [(g.detach().double().pow(2).sum(), shard_groups(p)) for p, g in pairs]


def scale_down(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Multiply ``grads`` by torch's clipping coefficient ``max_norm / (norm + 1e-6)``, at most 1, and by 1 where
    ``norm`` is not finite (the step is skipped): on the device, nothing read."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    coef = torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))
    for g in grads:
        g.mul_(coef.to(g.dtype) if g.dtype != coef.dtype else coef)


def reduce_in_place(tensors: list[torch.Tensor], comm: Comm, group: Any, divisor: float, name: str) -> None:
    """Sum ``tensors`` over ``group`` in one all-reduce of them flattened (float32; none when ``group`` is
    None), divide by ``divisor`` and write the result back into each tensor."""
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    if group is not None:
        comm.all_reduce_sum(flat, group, name=name)
    flat /= divisor
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


class GradSync:
    """One gradient-synchronisation policy (see the module docstring). Subclasses set ``name`` and register with
    ``register_grad_sync``; ``chosen(p)`` says when ``parallel.strategy = "auto"`` picks it."""

    name: ClassVar[str] = ""
    # takes modules still on the meta device and allocates this rank's part after wrapping them (FSDP2)
    shards_meta: ClassVar[bool] = False
    # the gradients it leaves are shards of the data-parallel world's (ZeRO, FSDP)
    shards_gradients: ClassVar[bool] = False
    # torch issues its collectives (DDP, FSDP2): the engine counts them with TorchCollectiveCounter
    torch_collectives: ClassVar[bool] = False
    # train.precision=bf16 computes through the policy's own cast (FSDP2's mixed precision), not autocast
    casts_bf16: ClassVar[bool] = False
    # why train.compile compiles block by block under this policy (empty: the whole model may be one region)
    compile_blocks_because: ClassVar[str] = ""
    # a pipeline's tied copies are summed in this rank's local gradients before the reduction (flat buckets that
    # hold every micro-batch's gradient), not after it
    ties_first: ClassVar[bool] = False
    # the rank's copy of the model in messages ("data-parallel", "FSDP", ...)
    kind: ClassVar[str] = "data-parallel"
    # ``wrap`` turns modules into something else (FSDP2's units): a pipeline passes each stage through it
    wraps_modules: ClassVar[bool] = False

    @classmethod
    def chosen(cls, p: ParallelConfig) -> bool:
        """Whether ``parallel.strategy = "auto"`` picks this policy for ``p``."""
        return False

    @classmethod
    def check(cls, cfg: Config, degrees: dict[str, int]) -> None:
        """Reject settings this policy owns that cannot work (a ``ConfigError`` naming the fix); every registered
        policy's check runs for every config, each checking its own keys."""

    def __init__(self, cfg: Config, topo: Topology, comm: Comm, group: Any, ranks: int, mesh: Any = None) -> None:
        """``group``: the ranks whose gradients are averaged (None: one rank); ``ranks``: how many; ``mesh``: the
        device mesh over them (1-D, or under hybrid sharding 2-D: replicated, sharded) for a policy that shards
        DTensors (FSDP2)."""
        self.cfg, self.topo, self.comm, self.group, self.ranks, self.mesh = cfg, topo, comm, group, ranks, mesh
        self.optimizer: Any = None
        self.params: list[nn.Parameter] = []
        self._bn: list[torch.Tensor] = []

    # -- building ------------------------------------------------------------------------------------
    def wrap(self, module: nn.Module, blocks: list[nn.Module]) -> nn.Module:
        """``module`` (the whole model, or one pipeline stage holding ``blocks``) as it will run; by default
        itself."""
        return module

    def attach(self, holder: nn.Module, params: list[nn.Parameter]) -> None:
        """Start synchronising the gradients of ``params`` (this rank's trainable parameters, each once, the
        expert-parallel ones left out) held by ``holder``."""
        self.holder, self.params = holder, params
        if self.ranks > 1 and not self.cfg.parallel.sync_batchnorm:
            self._bn = batchnorm_buffers(holder)

    def forward_wrapper(self) -> Callable | None:
        """A callable running the model's forward through the policy's wrapper (DDP), or None."""
        return None

    def build_optimizer(self, factory: OptimizerFactory, model: nn.Module) -> Any:
        """The optimizer from the user's factory (called with ``model``, whose parameters are this rank's)."""
        self.optimizer = factory(model)
        return self.optimizer

    def scheduler_target(self) -> torch.optim.Optimizer:
        """The torch optimizer an LR scheduler is attached to."""
        return self.optimizer

    @property
    def optimizers(self) -> list[Any]:
        return [self.optimizer]

    # -- one step ------------------------------------------------------------------------------------
    def set_sync(self, enabled: bool) -> None:
        """Whether the next backward communicates gradients (False on non-final accumulation micro-steps)."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def schedule_context(self) -> contextlib.AbstractContextManager:
        """The context one pipeline schedule step runs in (each pipeline micro-batch runs its own backward)."""
        return self.no_sync()

    def gather_local(self) -> None:
        """Before a pipeline sums its tied copies (``ties_first``): gradients in ``.grad`` into the policy's own
        storage."""

    def local_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        """Where ``p``'s gradient lives on this rank (what a pipeline's tied-copy sum adds into)."""
        return p.grad

    def finish(self) -> None:
        """Complete the gradient synchronisation (the engine times the wait as exposed communication)."""

    def grads(self) -> list[torch.Tensor]:
        """The gradient tensors the optimizer will read (what loss-scale unscaling divides and clipping scales)."""
        return [g for p in self.params if (g := local_grad(p)) is not None]

    def norm_pieces(self, skip: set[int] = frozenset()) -> list[NormPiece]:
        """This rank's gradient squares with the groups each is summed over; ``skip``: ids of parameters left out
        (a pipeline's later copies of a tied parameter)."""
        pieces = []
        for p in self.params:
            if id(p) in skip or (g := local_grad(p)) is None:
                continue
            groups = shard_groups(p)
            if self.shards_gradients and not isinstance(p, DTensor) and self.group is not None:
                groups = (*groups, self.group)
            pieces.append((g.detach().double().pow(2).sum(), groups))
        return pieces

    def clip_alone(self, max_norm: float) -> torch.Tensor | float | None:
        """The clip when these gradients are the only ones and none is sharded beyond this policy (no tensor or
        pipeline parallelism, no experts): the policy's own, with torch's numerics; None: the generic one."""
        return None

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def after_step(self) -> None:
        """After every optimizer step: BatchNorm running statistics averaged over the data-parallel ranks (each
        normalised with its own batch's, as DDP does); nothing with ``parallel.sync_batchnorm`` or one rank.
        Communication: one all-reduce of every running mean and variance, flattened."""
        if self._bn:
            reduce_in_place(self._bn, self.comm, self.group, self.ranks, "batchnorm statistics")

    # -- state ---------------------------------------------------------------------------------------
    def optimizer_state(self, named: list[tuple[str, nn.Parameter]]) -> dict[str, Any]:
        """The optimizer's state keyed by the single-process names of ``named`` (each parameter of this rank, a
        tied copy under the name of the parameter it copies): the tensors themselves, which a load writes into."""
        materialize_optimizer_state(self.optimizer)
        state: dict[str, Any] = {}
        for name, p in named:
            if name not in state and p in self.optimizer.state:
                state[name] = self.optimizer.state[p]
        return state

    def load_optimizer_state(self, named: list[tuple[str, nn.Parameter]], state: dict[str, Any]) -> None:
        """Load ``state`` (keyed like ``optimizer_state``) into the optimizer: values DCP already read into the
        tensors handed out stay; others (an in-memory copy's) are copied in. A rank holding several copies of a tied
        parameter gives the later copies the first one's state."""
        materialize_optimizer_state(self.optimizer)
        first: dict[str, nn.Parameter] = {}
        for name, p in named:
            if p not in self.optimizer.state:
                continue
            own = self.optimizer.state[p]
            if name in first:
                if p is not first[name]:
                    for k, v in self.optimizer.state[first[name]].items():
                        own[k].copy_(v) if isinstance(v, torch.Tensor) else own.__setitem__(k, v)
                continue
            first[name] = p
            for k, v in state.get(name, {}).items():
                if isinstance(v, torch.Tensor) and isinstance(own.get(k), torch.Tensor):
                    if v is not own[k]:
                        own[k].copy_(v)
                else:
                    own[k] = v

    def full_state(self, holder: nn.Module, rank0_only: bool) -> dict[str, torch.Tensor] | None:
        """The whole model's entries gathered from this policy's shards (None: the model's own entries, whole or
        tensor-parallel, are gathered by the layout)."""
        return None

    def describe(self) -> str:
        return self.kind if self.ranks > 1 else ""

    def close(self) -> None:
        """At the end of the run."""


def is_finite_norm(norm: Any) -> bool:
    return math.isfinite(norm)


_POLICIES: dict[str, type[GradSync]] = {}


def register_grad_sync(cls: type[GradSync]) -> type[GradSync]:
    """Class decorator: make ``cls`` selectable (by ``chosen``, or by ``parallel.strategy = cls.name``) and run its
    ``check`` on every config."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a name to be registered")
    if _POLICIES.get(cls.name, cls) is not cls and _POLICIES[cls.name].__qualname__ != cls.__qualname__:
        raise ValueError(f"a gradient-sync policy named {cls.name!r} is already registered "
                         f"({_POLICIES[cls.name].__qualname__})")
    _POLICIES[cls.name] = cls
    return cls


def policies() -> dict[str, type[GradSync]]:
    """The registered policies by name (``plait.parallel.compose`` imports the built-ins)."""
    return _POLICIES
