"""What the simulator takes from the code that trains, so that it cannot drift from the trainer.

* ``reducer_buckets``: the data-parallel reducer's buckets, from ``plait.parallel.data._make_buckets``
  itself run on meta tensors of the rank's parameter shapes (25 MB buckets, the first capped at 1 MiB,
  reverse registration order).
* ``zero_buckets``: ZeRO-1/2's flat buckets and their padding, from ``plait.parallel.zero._build_buckets``
  on meta parameters.
* ``fsdp_units``: ZeRO-3's units as ``plait.parallel.fsdp.apply_fsdp`` wraps them: each block
  (``plait.parallel.units.find_blocks``) and the root with everything else.
* ``tp_collectives``: the tensor-parallel collectives of one block and of the rest of the model, recorded
  from a forward and backward of the real model with the real tensor-parallel plan applied, built on the
  meta device and run over PyTorch's fake process group (no memory, no peers). A model with one block
  and one with two give the per-block pattern as their difference.
* ``operator_counts``: how many operators the dispatcher runs per block and for the rest of the model,
  forward and backward (recomputation included when the blocks are checkpointed), and how many of them
  are DTensor operators under tensor parallelism, and the fraction of parameter tensors that are DTensors
  (each optimizer operator on one goes through DTensor too): counted on the real model built on the meta
  device, like the collectives. On a CPU each costs the calibrated per-operator overhead.
* ``optimizer_traffic``: operators per parameter tensor and bytes per element of one step of the
  optimizer plait builds from ``[optim]`` (``plait.components.optim.adamw``), counted on tiny real tensors.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from plait.config import Config
from plait.plan.params import Param


def _meta_params(params: list[Param], tp: int) -> list[nn.Parameter]:
    return [nn.Parameter(torch.empty(p.local_shape(tp), device="meta")) for p in params]


def reducer_buckets(params: list[Param], tp: int, bucket_mb: float) -> list[list[int]]:
    """Indices into ``params`` of each data-parallel bucket, in launch order (the reducer's own grouping)."""
    from plait.parallel.data import _make_buckets

    metas = _meta_params(params, tp)
    index = {id(m): i for i, m in enumerate(metas)}
    buckets = _make_buckets(list(reversed(metas)), int(bucket_mb * 2**20))
    return [[index[id(p)] for p in b.params] for b in buckets]


class _Holder(nn.Module):
    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        self.params = nn.ParameterList(params)


def zero_buckets(params: list[Param], tp: int, bucket_mb: float, world: int) -> list[tuple[list[int], int]]:
    """ZeRO-1/2 buckets: (indices into ``params``, padded element count) in launch order."""
    from plait.parallel.zero import _build_buckets

    metas = _meta_params(params, tp)
    index = {id(m): i for i, m in enumerate(metas)}
    holder = _Holder(metas)
    buckets = _build_buckets(holder, [{"params": list(metas)}], bucket_mb, world, 0)
    return [([index[id(p)] for p in b.params], b.numel) for b in buckets]


def fsdp_units(params: list[Param], n_layer: int) -> list[list[int]]:
    """ZeRO-3 units: one per block (in model order), then the root unit (embedding, final norm, head)."""
    blocks: dict[int, list[int]] = {}
    root: list[int] = []
    for i, p in enumerate(params):
        if 0 <= p.layer < n_layer:
            blocks.setdefault(p.layer, []).append(i)
        else:
            root.append(i)
    return [blocks[k] for k in sorted(blocks)] + [root]


def fsdp_shard_numel(p: Param, tp: int, world: int) -> int:
    """Elements of ``p`` one rank holds under FSDP2: dim 0 of the (tp-local) tensor split in ``world``
    equal padded chunks."""
    shape = p.local_shape(tp)
    rest = 1
    for d in shape[1:]:
        rest *= d
    return -(-shape[0] // world) * rest


# -- tensor-parallel collectives --------------------------------------------------------------------
@dataclass(frozen=True)
class Collective:
    """One collective a rank issued: ``op`` (all_reduce, all_gather, reduce_scatter), the bytes of its
    full buffer and whether it ran in backward."""

    op: str
    nbytes: int
    backward: bool


_KINDS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
          "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all"}


class _Recorder(TorchDispatchMode):
    """Collectives, operators and DTensor operators seen, split by forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Collective] = []
        self.backward = False
        self.ops = [0, 0]
        self.dtensor_ops = [0, 0]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            self.dtensor_ops[self.backward] += 1
            return NotImplemented
        self.ops[self.backward] += 1
        name = func._overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name in _KINDS:
            t = args[0]
            size = t.numel() * t.element_size()
            if _KINDS[name] == "all_gather":
                size *= args[1]  # the gathered output
            self.seen.append(Collective(_KINDS[name], int(size), self.backward))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def fake_world(size: int) -> Iterator[Any]:
    """A fake process group of ``size`` ranks (this process is rank 0) and a 1-D cpu mesh over it.
    Refuses to run inside a real distributed job (a default process group exists)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group already exists; the fake-world dry run needs a fresh process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield init_device_mesh("cpu", (size,))
    finally:
        dist.destroy_process_group()


def _scaled_config(cfg: Config, layers: int) -> tuple[Config, Any]:
    """``cfg`` with a model of ``layers`` blocks, and that model built on the meta device."""
    from plait.plan.shapes import meta_model

    small = copy.deepcopy(cfg)
    if not small.model.factory and small.model.name == "gpt":
        small.model.n_layer = layers
        return small, meta_model(small)
    model = meta_model(cfg)
    config = copy.deepcopy(model.config)
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if hasattr(config, key):
            setattr(config, key, layers)
    with torch.device("meta"):
        return small, type(model)(config)


def tensor_parallel(cfg: Config, model: nn.Module, mesh: Any) -> tuple[nn.Module, Any]:
    """``model`` with the tensor-parallel plan ``plait train`` applies for ``cfg`` over ``mesh`` (a ``fake_world``
    mesh on cpu or meta tensors), and the context its loss runs in (loss parallelism)."""
    from plait.parallel.apply import ModelSpec, _tp_function
    from plait.parallel.tensor import loss_context

    model = _tp_function(model, cfg.parallel, ModelSpec(tp_plan=cfg.parallel.tp_plan))(model, mesh)
    return model, loss_context(model)


def _record(cfg: Config, model: nn.Module, mesh: Any, micro_batch: int, checkpointing: str = "none") -> _Recorder:
    """One forward and backward of the real model (tensor-parallel plan applied when ``mesh``) on meta tensors."""
    from plait.parallel.checkpointing import apply_activation_checkpointing
    from plait.parallel.tensor import loss_context

    if mesh is not None:
        model, _ = tensor_parallel(cfg, model, mesh)
    model = apply_activation_checkpointing(model, checkpointing)
    ids = torch.zeros(micro_batch, cfg.model.seq_len, dtype=torch.long, device="meta")
    rec = _Recorder()
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    rec.dtensor_params = sum(isinstance(q, DTensor) for q in params) / max(len(params), 1)
    with rec, loss_context(model):
        out = model(ids, ids) if hasattr(model, "cfg") else model(input_ids=ids, labels=ids).loss
        loss = out if out.dim() == 0 else out.float().mean()
        rec.backward = True
        loss.backward()
    return rec


def tp_collectives(cfg: Config, micro_batch: int) -> tuple[list[Collective], list[Collective]]:
    """(per-block collectives, collectives of everything else) one tensor-parallel rank issues in one
    forward and backward of ``micro_batch`` sequences, sizes in the parameters' dtype (scale by the
    activation bytes for mixed precision). See the module docstring."""
    tp = cfg.parallel.tp
    with fake_world(tp) as mesh:
        small1, m1 = _scaled_config(cfg, 1)
        one = _record(small1, m1, mesh, micro_batch).seen
        small2, m2 = _scaled_config(cfg, 2)
        two = _record(small2, m2, mesh, micro_batch).seen
    block = _difference(two, one)
    rest = _difference(one, block)
    return block, rest


@dataclass(frozen=True)
class OperatorCounts:
    """Dispatcher operators per block (``block``, checkpointed ``block_recomputed``) and for the rest of
    the model, each ``(forward, backward)``; ``dtensor_*`` the DTensor operators among them (tp > 1)."""

    block: tuple[int, int]
    block_recomputed: tuple[int, int]
    rest: tuple[int, int]
    dtensor_block: tuple[int, int] = (0, 0)
    dtensor_rest: tuple[int, int] = (0, 0)
    dtensor_params: float = 0.0  # fraction of the parameter tensors that are DTensors (the optimizer's steps)


def operator_counts(cfg: Config, micro_batch: int) -> OperatorCounts:
    """Count operators on the real model (see the module docstring)."""
    tp = cfg.parallel.tp
    context = fake_world(tp) if tp > 1 else contextlib.nullcontext(None)
    with context as mesh:
        runs = {}
        # DTensor's sharding propagation runs extra operators the first time it meets an operator: warm up
        for layers in (2, 2, 3):  # checkpointing wraps a model's blocks only where it has two or more
            for ckpt in ("none", "full"):
                small, model = _scaled_config(cfg, layers)
                runs[(layers, ckpt)] = _record(small, model, mesh, micro_batch, ckpt)

    def diff(ckpt: str, attr: str) -> tuple[int, int]:
        three, two = getattr(runs[(3, ckpt)], attr), getattr(runs[(2, ckpt)], attr)
        return (three[0] - two[0], three[1] - two[1])

    def rest(block: tuple[int, int], attr: str) -> tuple[int, int]:
        two = getattr(runs[(2, "none")], attr)
        return (two[0] - 2 * block[0], two[1] - 2 * block[1])

    block, dblock = diff("none", "ops"), diff("none", "dtensor_ops")
    return OperatorCounts(block=block, block_recomputed=diff("full", "ops"), rest=rest(block, "ops"),
                          dtensor_block=dblock, dtensor_rest=rest(dblock, "dtensor_ops"),
                          dtensor_params=runs[(2, "none")].dtensor_params)


def _difference(more: list[Collective], less: list[Collective]) -> list[Collective]:
    pool = list(less)
    out = []
    for c in more:
        if c in pool:
            pool.remove(c)
        else:
            out.append(c)
    return out


# -- optimizer --------------------------------------------------------------------------------------
def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x] if x.numel() == 4 else []  # the parameters' size here; step counters are scalars
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


class _Counter(TorchDispatchMode):
    """Operators that touch parameter-sized tensors, and the tensors they read and write."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.elements = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        reads = _tensors(list(args) + list(kwargs.values()))
        written = 0
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                written += len(_tensors(value))
        fresh = [o for o in _tensors(out) if all(o is not t for t in reads)]
        if reads or fresh:
            self.ops += 1
            self.elements += len(reads) + written + len(fresh)
        return out


def optimizer_traffic(cfg: Config) -> tuple[float, float]:
    """(operators per parameter tensor, bytes read + written per fp32 element) of one step of the
    optimizer plait builds from ``cfg.optim``, counted on two parameters of 4 elements each."""
    from plait.components.optim import adamw

    params = [nn.Parameter(torch.ones(2, 2)), nn.Parameter(torch.ones(4))]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = adamw([("w", params[0]), ("b", params[1])], cfg.optim)
    opt.step()  # states exist from here on; the second step is the steady state
    counter = _Counter()
    with counter:
        opt.step()
    return counter.ops / len(params), 4.0 * counter.elements / len(params)
