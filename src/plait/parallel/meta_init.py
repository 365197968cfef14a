"""Models built on the meta device: what the model is (recorded before any layout), its materialisation on
this rank, and its initialisation without weights.

A model built under ``torch.device("meta")`` has shapes and no storage. ``plait.parallel.compose.parallelize`` applies
the layout to it while it is still on the meta device (tensor-parallel plan, pipeline split, FSDP2 sharding all work on
meta tensors), then ``materialise`` allocates what this rank holds: its tp/FSDP shards as DTensor local tensors, its
pipeline stages' layers; never the whole model (data parallelism and ZeRO-1/2 hold the whole model on every rank by
design, so there it is allocated whole).

``ModelFacts`` records, before the layout changes anything, what every rank needs to agree on: every
state-dict name with its shape and dtype, which names are one tied tensor, the non-persistent buffers, the
Hugging Face config, and (for a meta model) the module objects themselves, which cost nothing on meta and
let a rank initialise a tensor another module owns (a pipeline stage's copy of a tied embedding).

Initialisation (``initialise``), and how it relates to one process. Each module that owns a parameter or
buffer this rank holds is initialised on a *full-size* temporary copy of its own tensors (one module at a
time: the transient memory is the largest module, never the model), with the random generator seeded by
``seed`` and the module's name (``module_seed``); the rank then keeps its slice. The init of a module is
``init_fn(module)`` when given; else, for a torchtitan module (``_init_self_parameters`` /
``_init_self_buffers``: the two halves of its ``init_states``, which its ``init_weights`` runs), those two; else its
``reset_parameters()`` followed by the root model's ``_init_weights(module)`` where the root has one (Hugging Face
models, plait's GPT). The temporaries start as NaN, so what an init leaves unwritten is seen, never trained as
``torch.empty`` memory: a buffer no init computed (a rotary cache made in ``__init__``) is taken from the module
built again on the CPU (``_rebuilt``: its class called with its own attributes as the constructor's arguments, for
a module without parameters); a tied tensor takes the value of the first of its owners whose init writes it (a
torchtitan embedding tied to its head skips its own init: the head's gives it); anything still unwritten is
refused (``MetaInitError``, on every rank, before the first step) naming the tensor and the fix. So
computed buffers come out as construction makes them. So the weights are a function of (seed, module
name, module), the same at every layout and world size: *equal*, bit for bit, to ``initialise_like(model,
seed)`` run on the whole model in one process (``tests/engine/test_big_models.py`` checks this at zero=3 and
tp=2). They are not the values a normal construction after ``torch.manual_seed(seed)`` draws (that draws
from one stream in construction order, which a sharded rank cannot replay without building everything);
per module they follow the same distributions.
"""

from __future__ import annotations

import inspect
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from plait.config import ConfigError

InitFn = Callable[[nn.Module], None]


class MetaInitError(ConfigError):
    """A meta-device model that plait cannot initialise or place; the message says what to pass instead."""


def uninitialised_message(names: list[str]) -> str:
    """The one line refusing a meta-built model whose init leaves ``names`` (tensors) unwritten."""
    return (f"the model was built on the meta device and nothing initialises {', '.join(names[:3])}"
            f"{f' (and {len(names) - 3} more)' if len(names) > 3 else ''}: no init_fn, reset_parameters, _init_weights "
            "or _init_self_buffers writes it, and its module cannot be built again from its attributes; pass "
            "init_fn=fn(module) that sets it (or weights=PATH for parameters), or build the model on the CPU")


def is_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in _tensors(model))


def _tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from (b for b in model.buffers() if b is not None)


def place(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` on ``device``; a model with meta tensors stays as it is (the strategy materialises this
    rank's part of it after applying the layout)."""
    return model if is_meta(model) else model.to(device)


@torch.no_grad()
def materialise(module: nn.Module, device: torch.device) -> None:
    """Allocate (uninitialised) storage on ``device`` for every meta tensor of ``module``; tensors already real
    are left as they are. Every tensor keeps its identity (``torch.utils.swap_tensors``): tied parameters stay
    one object, and references a layout took (a pipeline's parameter lists, BatchNorm statistics to average)
    stay valid. DTensor parameters (tensor parallelism, FSDP2) go through ``Module._apply`` as ``to_empty``
    does, which swaps them in place too and lets FSDP2 re-register its padded shards. The attributes a layout
    set on a tensor (expert parallelism's mark and global shape) are kept: a swap exchanges them too."""
    marks = {(id(m), name): dict(t.__dict__) for m, name, t in _slots(module) if t.is_meta and t.__dict__}
    done: set[int] = set()
    for m in module.modules():
        for t in list(m._parameters.values()) + list(m._buffers.values()):
            if t is None or id(t) in done or not t.is_meta or type(t) not in (torch.Tensor, nn.Parameter):
                continue
            done.add(id(t))
            new = torch.empty_like(t, device=device)
            torch.utils.swap_tensors(t, nn.Parameter(new, t.requires_grad) if type(t) is nn.Parameter else new)
    if any(p.is_meta for p in module.parameters()) or any(b is not None and b.is_meta for b in module.buffers()):
        module._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
    for m, name, t in _slots(module):
        for k, v in marks.get((id(m), name), {}).items():
            t.__dict__.setdefault(k, v)


def _slots(module: nn.Module) -> Iterator[tuple[nn.Module, str, torch.Tensor]]:
    """(module, attribute, tensor) for every parameter and buffer held directly by each module."""
    for m in module.modules():
        for name, t in list(m._parameters.items()) + list(m._buffers.items()):
            if t is not None:
                yield m, name, t


def storage_key(t: torch.Tensor) -> tuple:
    """Identifies the memory a tensor (a DTensor: its local shard) writes to: one key for two names of a tied
    tensor, whatever objects ``state_dict`` handed out for them."""
    local = t._local_tensor if hasattr(t, "_local_tensor") else t
    return local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape), local.dtype


def module_seed(seed: int, module_name: str) -> int:
    """The random seed of one module's initialisation: stable across processes and Python runs."""
    return (int(seed) * 1_000_003 + zlib.crc32(module_name.encode())) % (2**63 - 1)


@dataclass
class ModelFacts:
    """What the whole model is, recorded on every rank before the layout is applied (see the module docstring).

    Two views. The checkpoint's: ``shapes``/``dtypes``, every entry of ``model.state_dict()`` by name (the names
    its state-dict hooks give: torchtitan's fused ``wqkv`` saved as ``wq``/``wk``/``wv``), and ``canonical``:
    name -> the first name of the same tensor (tied weights share one). The model's own tensors', for
    initialisation: ``own``: each parameter's and persistent buffer's attribute path -> the first path of the same
    tensor, ``own_shapes`` their whole shapes, ``owner``: first path -> (module name, attribute);
    ``nonpersistent``: module name -> its buffers that are not in the state dict. Without renaming hooks the two
    views name the same tensors. ``modules`` and ``root``: the module objects, kept only for a meta model."""

    shapes: dict[str, torch.Size] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    canonical: dict[str, str] = field(default_factory=dict)
    own: dict[str, str] = field(default_factory=dict)
    own_shapes: dict[str, torch.Size] = field(default_factory=dict)
    owner: dict[str, tuple[str, str]] = field(default_factory=dict)
    nonpersistent: dict[str, list[str]] = field(default_factory=dict)
    modules: dict[str, nn.Module] = field(default_factory=dict)
    root: nn.Module | None = None
    config: Any = None
    meta: bool = False
    ignore_unexpected: list[str] = field(default_factory=list)
    base_prefix: str = ""
    kind: str = "the model"
    conversions: list[Any] = field(default_factory=list)

    @classmethod
    def of(cls, model: nn.Module) -> ModelFacts:
        from plait.checkpoint.hf_convert import model_conversions

        facts = cls(meta=is_meta(model), config=getattr(model, "config", None),
                    ignore_unexpected=list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []),
                    base_prefix=str(getattr(model, "base_model_prefix", "") or ""), kind=type(model).__name__,
                    conversions=model_conversions(model))
        first: dict[int, str] = {}
        for name, t in model.state_dict(keep_vars=True).items():
            if isinstance(t, torch.Tensor):
                facts.canonical[name] = first.setdefault(id(t), name)
                facts.shapes[name], facts.dtypes[name] = t.shape, t.dtype
        own_first: dict[int, str] = {}
        for mname, m in model.named_modules(remove_duplicate=False):
            for attr, t in list(m._parameters.items()) + list(m._buffers.items()):
                if t is None:
                    continue
                name = f"{mname}.{attr}" if mname else attr
                if attr in m._buffers and attr in m._non_persistent_buffers_set:
                    facts.nonpersistent.setdefault(mname, []).append(attr)
                    continue
                canon = own_first.setdefault(id(t), name)
                facts.own[name], facts.own_shapes[name] = canon, t.shape
                if canon == name:
                    facts.owner[name] = (mname, attr)
        if facts.meta:  # free on meta: lets any rank initialise any tensor (see the module docstring)
            facts.modules = dict(model.named_modules(remove_duplicate=False))
            facts.root = model
        return facts

    def groups(self) -> dict[str, list[str]]:
        """canonical name -> every state-dict name of that tensor, in model order."""
        out: dict[str, list[str]] = {}
        for name, canon in self.canonical.items():
            out.setdefault(canon, []).append(name)
        return out

    def owners(self) -> dict[str, list[tuple[str, str]]]:
        """The model's own tensors (by first path) -> (module name, attribute) of each of their names, in model
        order: a tied tensor has several."""
        out: dict[str, list[tuple[str, str]]] = {}
        for name, canon in self.own.items():
            mname, _, attr = name.rpartition(".")
            out.setdefault(canon, []).append((mname, attr))
        return out


def _titan(module: nn.Module) -> bool:
    """Whether ``module`` follows torchtitan's init protocol (its ``Module``'s ``init_states`` halves)."""
    return callable(getattr(module, "_init_self_parameters", None)) and callable(
        getattr(module, "_init_self_buffers", None))


def _module_init(facts: ModelFacts, init_fn: InitFn | None) -> InitFn:
    root = facts.root
    hf = getattr(root, "_init_weights", None) if root is not None else None

    def init(module: nn.Module) -> None:
        if init_fn is not None:
            init_fn(module)
            return
        if _titan(module):  # init_states without its recursion: this module's own tensors, on the CPU
            try:
                module._init_self_parameters()
            except ValueError as e:  # torchtitan's own refusal: a parameter without an initialiser
                raise MetaInitError(f"{e}; or pass init_fn=fn(module) to setup") from None
            module._init_self_buffers(buffer_device=torch.device("cpu"))
            return
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        if callable(hf):
            hf(module)

    return init


def _swap(module: nn.Module, tensors: dict[str, Any], wrap: bool = True) -> dict[str, Any]:
    """Put ``tensors`` in ``module`` under their attribute names (bypassing ``__setattr__``, which a layout may
    have wrapped), parameters as ``nn.Parameter`` when ``wrap``; returns what was there."""
    old = {}
    for attr, t in tensors.items():
        table = module._parameters if attr in module._parameters else module._buffers
        old[attr] = table[attr]
        table[attr] = nn.Parameter(t, requires_grad=False) if wrap and table is module._parameters else t
    return old


def _unset(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A temporary an init writes into: NaN where the dtype has one, so what the init leaves is seen."""
    if dtype.is_floating_point or dtype.is_complex:
        return torch.full(shape, float("nan"), dtype=dtype)
    return torch.zeros(shape, dtype=dtype)


def written(t: torch.Tensor) -> bool:
    """Whether an init wrote every element of ``t`` (one of ``_unset``'s temporaries, or what replaced it)."""
    return not (t.is_floating_point() or t.is_complex()) or not bool(torch.isnan(t).any())


def _rebuilt(module: nn.Module) -> nn.Module | None:
    """``module`` constructed again on the CPU, its class called with its own attributes of the constructor's
    parameter names (torchtitan's ``config``, Hugging Face's rotary ``config``, a user's ``dim``): what its
    ``__init__`` computes into buffers. None for a module holding parameters (that would build them whole) or
    whose constructor's arguments it does not keep."""
    if next(module.parameters(), None) is not None:
        return None
    try:
        params = list(inspect.signature(type(module).__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    kwargs = {}
    for prm in params:
        if prm.kind in (prm.VAR_POSITIONAL, prm.VAR_KEYWORD):
            continue
        value = module.__dict__.get(prm.name, getattr(type(module), prm.name, None))
        if value is not None and not callable(value) and prm.kind != prm.POSITIONAL_ONLY:
            kwargs[prm.name] = value
        elif prm.default is prm.empty:
            return None
    try:
        with torch.device("cpu"):
            return type(module)(**kwargs)
    except Exception:  # noqa: BLE001  a constructor that does not take its attributes back: refused by the caller
        return None


def _full_values(facts: ModelFacts, mname: str, seed: int, init: InitFn) -> tuple[dict[str, Any], set[str]]:
    """Every direct tensor of module ``mname`` at full size, initialised as in one process (on the CPU, whose
    random generator is the same on every machine), and the attributes nothing wrote (module docstring)."""
    module = facts.modules[mname]
    # the whole model's shapes, recorded before the layout: expert parallelism replaced the experts' tensors by
    # this rank's (a DTensor's shape is the whole one already)
    full = {attr: _unset(tuple(facts.own_shapes.get(f"{mname}.{attr}" if mname else attr, t.shape)), t.dtype)
            for attr, t in list(module._parameters.items()) + list(module._buffers.items()) if t is not None}
    old = _swap(module, full)
    try:
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(module_seed(seed, mname))
        with torch.no_grad():
            init(module)
        out = {attr: (module._parameters.get(attr) if attr in module._parameters else module._buffers[attr])
               for attr in full}
    finally:
        _swap(module, old, wrap=False)  # the model's own objects back, exactly
        torch.random.set_rng_state(gen_state)
    out = {k: v.detach() for k, v in out.items()}
    missing = {k for k, v in out.items() if not written(v)}
    if missing & set(module._buffers):  # computed by construction only: built again, seeded alike
        torch.manual_seed(module_seed(seed, mname))
        try:
            again = _rebuilt(module)
        finally:
            torch.random.set_rng_state(gen_state)
        for attr in missing & set(module._buffers):
            b = again._buffers.get(attr) if again is not None else None
            if b is not None and not b.is_meta and b.shape == full[attr].shape and b.dtype == full[attr].dtype:
                out[attr] = b.detach()
                missing.discard(attr)
    return out, missing


def _check_initialisable(facts: ModelFacts, init_fn: InitFn | None) -> None:
    if init_fn is not None or callable(getattr(facts.root, "_init_weights", None)):
        return
    bare = sorted({mname for mname, _ in facts.owner.values()
                   if not callable(getattr(facts.modules[mname], "reset_parameters", None))
                   and not _titan(facts.modules[mname]) and facts.modules[mname]._parameters})
    if bare:
        raise MetaInitError(f"the model was built on the meta device without weights, and these modules have no "
                            f"reset_parameters() to initialise them: {', '.join(bare[:5])}; pass weights=PATH or "
                            "init_fn=fn(module) to setup")


@torch.no_grad()
def initialise(facts: ModelFacts, entries: dict[str, torch.Tensor], seed: int, init_fn: InitFn | None = None,
               buffers_only: bool = False) -> list[str]:
    """Fill this rank's tensors of a meta-built model (see the module docstring). ``entries``: this rank's
    state-dict entries under the single-process names (``LayoutState.model_entries``), plain tensors or DTensors;
    the model's own tensors that no entry names (a state-dict hook renamed them) are taken from their modules.
    The non-persistent buffers of the modules this rank holds are computed too. ``buffers_only``: only those (the
    parameters came from a checkpoint). Returns the names of this rank's tensors nothing initialised (the caller
    refuses the model on every rank: ``uninitialised_message``); they are left NaN."""
    if not facts.meta:
        return []
    init = _module_init(facts, init_fn)
    # owner module -> [(attribute, destination, the tensor's name, the owners left to try)]
    wanted: dict[str, list[tuple[str, torch.Tensor, str, list[tuple[str, str]]]]] = {}
    if not buffers_only:
        _check_initialisable(facts, init_fn)
        held: dict[str, torch.Tensor] = {}
        for name, t in entries.items():
            if name in facts.own:
                held.setdefault(facts.own[name], t)
        for canon, ((mname, attr), *rest) in facts.owners().items():
            module = facts.modules[mname]
            t = held.get(canon, module._parameters.get(attr, module._buffers.get(attr)))
            if t is not None and not t.is_meta:  # held by this rank
                wanted.setdefault(mname, []).append((attr, t, canon, rest))
    for mname, attrs in facts.nonpersistent.items():
        module = facts.modules[mname]
        for attr in attrs:
            name = f"{mname}.{attr}" if mname else attr
            b = entries.get(name, module._buffers.get(attr))
            if b is not None and not b.is_meta:  # held by this rank
                wanted.setdefault(mname, []).append((attr, b, name, []))
    missing = []
    for mname in facts.modules:  # model order: deterministic, the same on every rank; a tie's later owners later
        if mname not in wanted:
            continue
        full, unset = _full_values(facts, mname, seed, init)
        for attr, dest, name, rest in wanted[mname]:
            if attr not in unset:
                write_slice(dest, full[attr])
            elif rest:  # a tied tensor this owner's init skips: the next owner's init gives it
                wanted.setdefault(rest[0][0], []).append((rest[0][1], dest, name, rest[1:]))
            else:
                write_slice(dest, full[attr])
                missing.append(name)
    return missing


def refuse_uninitialised(missing: list[str], group: Any, device: torch.device) -> None:
    """Raise ``MetaInitError`` on every rank of ``group`` when ``initialise`` left a tensor unwritten on any of
    them, naming the tensors. Collective where a process group exists: two all-gathers (the names' lengths, then
    their UTF-8 bytes; nothing is unpickled)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        mine = torch.tensor(list("\n".join(missing).encode()), dtype=torch.uint8, device=device)
        lengths = [torch.zeros((), dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))]
        dist.all_gather(lengths, torch.tensor(mine.numel(), device=device), group=group)
        width = max(int(n) for n in lengths)
        if width == 0:
            return
        parts = [torch.zeros(width, dtype=torch.uint8, device=device) for _ in lengths]
        dist.all_gather(parts, torch.cat([mine, mine.new_zeros(width - mine.numel())]), group=group)
        missing = sorted({n for part, k in zip(parts, lengths, strict=True)
                          for n in bytes(part[:int(k)].tolist()).decode().split("\n") if n})
    if missing:
        raise MetaInitError(uninitialised_message(missing))


def write_slice(dest: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` (the whole tensor) into ``dest``: a DTensor's local shard (its offset
    from the placements: tp's Megatron shards, FSDP2's dim-0 shards, both at once; tp's packed expert weights
    block by block: ``plait.checkpoint.hf.local_boxes``), or a plain tensor whole."""
    from plait.checkpoint.hf import local_boxes

    for view, offset in local_boxes(dest):
        view.copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, view.shape, strict=True))])


def initialise_like(model: nn.Module, seed: int, init_fn: InitFn | None = None) -> nn.Module:
    """The reference of ``initialise`` in one process: ``model`` (whole, on the meta device or not) gets the
    weights a meta-built copy of it gets at any layout from the same ``seed``. Returns ``model``, on the CPU."""
    facts = ModelFacts.of(model)
    facts.modules = dict(model.named_modules(remove_duplicate=False))
    facts.root, facts.meta = model, True
    materialise(model, torch.device("cpu"))
    missing = initialise(facts, model.state_dict(keep_vars=True), seed, init_fn)
    if missing:
        raise MetaInitError(uninitialised_message(missing))
    return model
