"""What the cost model records from the real code on the meta device, for a configured model: the
tensor-parallel collectives of the real plan over PyTorch's fake process group, the dispatcher operators per
block, and the optimizer's traffic (``plait.plan.derive`` holds what these return; its module docstring says
why the simulator takes them from the code that trains). Above the code that trains: it applies the real
plans (``plait.parallel``) to models built by the caller's ``models`` (``plait.recipes``: its
``build_model``), or to plait's GPT.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from plait.components.optim import adamw
from plait.config import Config, ConfigError
from plait.data.tokenize import resolve_vocab_size
from plait.models.gpt import GPT
from plait.parallel.activation_checkpoint import apply_activation_checkpointing
from plait.parallel.model_specs import model_shape
from plait.parallel.spec import ModelSpec
from plait.parallel.tensor.apply import tp_function
from plait.parallel.tensor.plan import loss_context
from plait.plan.derive import Collective, OperatorCounts
from plait.plan.shapes import ModelShape


def meta_model(cfg: Config, models: Any = None) -> Any:
    """The configured model built on the meta device (parameters without memory): by ``models.build_model``
    (``plait.recipes``, the recipe or factory ``plait train`` uses), or plait's GPT from ``[model]``."""
    with torch.device("meta"):
        if models is not None:
            return models.build_model(cfg)
        if not cfg.model.factory and cfg.model.name == "gpt":
            return GPT(cfg.model, cfg.moe)
    raise ConfigError(f"model.{'factory' if cfg.model.factory else 'name'} builds the model through plait's recipes: "
                      "pass models=plait.recipes (plait simulate and plait plan do)")


def shape_from_config(cfg: Config, models: Any = None) -> ModelShape:
    """The configured model's shape, from the model built on the meta device (``meta_model``): the shape of the spec
    registered for its class (plait's GPT, with the ``[moe]`` section's experts), else its Hugging Face config's
    (``plait.parallel.train_spec.model_shape``); its exact parameter count either way."""
    m = cfg.model
    if not m.factory and m.name == "gpt" and m.vocab_size == 0:
        cfg = copy.deepcopy(cfg)  # the tokenizer's vocabulary, as the run resolves it (on a copy: cfg stays as given)
        resolve_vocab_size(cfg)
    return model_shape(meta_model(cfg, models), m.seq_len, cfg)


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


def _scaled_config(cfg: Config, layers: int, models: Any = None) -> tuple[Config, Any]:
    """``cfg`` with a model of ``layers`` blocks, and that model built on the meta device."""
    small = copy.deepcopy(cfg)
    if not small.model.factory and small.model.name == "gpt":
        small.model.n_layer = layers
        return small, meta_model(small, models)
    model = meta_model(cfg, models)
    config = copy.deepcopy(model.config)
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if hasattr(config, key):
            setattr(config, key, layers)
    with torch.device("meta"):
        return small, type(model)(config)


def tensor_parallel(cfg: Config, model: nn.Module, mesh: Any) -> tuple[nn.Module, Any]:
    """``model`` with the tensor-parallel plan ``plait train`` applies for ``cfg`` over ``mesh`` (a ``fake_world``
    mesh on cpu or meta tensors), and the context its loss runs in (loss parallelism)."""
    model = tp_function(model, cfg.parallel, ModelSpec(tp_plan=cfg.parallel.tp_plan))(model, mesh)
    return model, loss_context(model)


def _record(cfg: Config, model: nn.Module, mesh: Any, micro_batch: int, checkpointing: str = "none") -> _Recorder:
    """One forward and backward of the real model (tensor-parallel plan applied when ``mesh``) on meta tensors."""
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


def tp_collectives(cfg: Config, micro_batch: int, models: Any = None) -> tuple[list[Collective], list[Collective]]:
    """(per-block collectives, collectives of everything else) one tensor-parallel rank issues in one
    forward and backward of ``micro_batch`` sequences, sizes in the parameters' dtype (scale by the
    activation bytes for mixed precision). See the module docstring."""
    tp = cfg.parallel.tp
    with fake_world(tp) as mesh:
        small1, m1 = _scaled_config(cfg, 1, models)
        one = _record(small1, m1, mesh, micro_batch).seen
        small2, m2 = _scaled_config(cfg, 2, models)
        two = _record(small2, m2, mesh, micro_batch).seen
    block = _difference(two, one)
    rest = _difference(one, block)
    return block, rest


def operator_counts(cfg: Config, micro_batch: int, models: Any = None) -> OperatorCounts:
    """Count operators on the real model (see the module docstring)."""
    tp = cfg.parallel.tp
    context = fake_world(tp) if tp > 1 else contextlib.nullcontext(None)
    with context as mesh:
        runs = {}
        # DTensor's sharding propagation runs extra operators the first time it meets an operator: warm up
        for layers in (2, 2, 3):  # checkpointing wraps a model's blocks only where it has two or more
            for ckpt in ("none", "full"):
                small, model = _scaled_config(cfg, layers, models)
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
    params = [nn.Parameter(torch.ones(2, 2)), nn.Parameter(torch.ones(4))]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = adamw([("w", params[0]), ("b", params[1])], cfg.optim)
    opt.step()  # states exist from here on; the second step is the steady state
    counter = _Counter()
    with counter:
        opt.step()
    return counter.ops / len(params), 4.0 * counter.elements / len(params)
