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
``init_fn(module)`` when given, else its ``reset_parameters()`` followed by the root model's
``_init_weights(module)`` where the root has one (Hugging Face models, plait's GPT), so computed buffers
(a rotary embedding's ``inv_freq``, BatchNorm statistics) come out as construction would make them. A tied
tensor takes the value its first owner's init gives it. So the weights are a function of (seed, module
name, module), the same at every layout and world size: *equal*, bit for bit, to ``initialise_like(model,
seed)`` run on the whole model in one process (``tests/engine/test_big_models.py`` checks this at zero=3 and
tp=2). They are not the values a normal construction after ``torch.manual_seed(seed)`` draws (that draws
from one stream in construction order, which a sharded rank cannot replay without building everything);
per module they follow the same distributions.
"""

from __future__ import annotations

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

    ``shapes``/``dtypes``: every state-dict entry (parameters and persistent buffers) by name; ``canonical``:
    name -> the first name of the same tensor (tied weights share one); ``owner``: canonical name -> (module
    name, attribute); ``nonpersistent``: module name -> its buffers that are not in the state dict;
    ``modules`` and ``root``: the module objects, kept only for a meta model."""

    shapes: dict[str, torch.Size] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    canonical: dict[str, str] = field(default_factory=dict)
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
        from plait.components.hf_convert import model_conversions

        facts = cls(meta=is_meta(model), config=getattr(model, "config", None),
                    ignore_unexpected=list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []),
                    base_prefix=str(getattr(model, "base_model_prefix", "") or ""), kind=type(model).__name__,
                    conversions=model_conversions(model))
        first: dict[int, str] = {}
        sd_names = set(model.state_dict(keep_vars=True))
        for mname, m in model.named_modules(remove_duplicate=False):
            for attr, t in list(m._parameters.items()) + list(m._buffers.items()):
                if t is None:
                    continue
                name = f"{mname}.{attr}" if mname else attr
                if name not in sd_names:
                    if attr in m._buffers:
                        facts.nonpersistent.setdefault(mname, []).append(attr)
                    continue
                canon = first.setdefault(id(t), name)
                facts.canonical[name] = canon
                facts.shapes[name], facts.dtypes[name] = t.shape, t.dtype
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


def _module_init(facts: ModelFacts, init_fn: InitFn | None) -> InitFn:
    root = facts.root
    hf = getattr(root, "_init_weights", None) if root is not None else None

    def init(module: nn.Module) -> None:
        if init_fn is not None:
            init_fn(module)
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


def _full_values(facts: ModelFacts, mname: str, seed: int, init: InitFn) -> dict[str, Any]:
    """Every direct tensor of module ``mname`` at full size, initialised as in one process: on the CPU, whose
    random generator is the same on every machine."""
    module = facts.modules[mname]
    # the whole model's shapes, recorded before the layout: expert parallelism replaced the experts' tensors by
    # this rank's (a DTensor's shape is the whole one already)
    full = {attr: torch.empty(tuple(facts.shapes.get(f"{mname}.{attr}" if mname else attr, t.shape)), dtype=t.dtype)
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
    return {k: v.detach() for k, v in out.items()}


def _check_initialisable(facts: ModelFacts, names: list[str], init_fn: InitFn | None) -> None:
    if init_fn is not None or callable(getattr(facts.root, "_init_weights", None)):
        return
    bare = sorted({facts.owner[facts.canonical[n]][0] for n in names
                   if not callable(getattr(facts.modules[facts.owner[facts.canonical[n]][0]], "reset_parameters",
                                           None))})
    if bare:
        raise MetaInitError(f"the model was built on the meta device without weights, and these modules have no "
                            f"reset_parameters() to initialise them: {', '.join(bare[:5])}; pass weights=PATH or "
                            "init_fn=fn(module) to setup")


@torch.no_grad()
def initialise(facts: ModelFacts, entries: dict[str, torch.Tensor], seed: int, init_fn: InitFn | None = None,
               buffers_only: bool = False) -> None:
    """Fill this rank's tensors of a meta-built model (see the module docstring). ``entries``: this rank's
    state-dict entries under the single-process names (``Layout.model_entries``), plain tensors or DTensors;
    the non-persistent buffers of the modules this rank holds are recomputed too. ``buffers_only``: only those
    (the parameters came from a checkpoint)."""
    if not facts.meta:
        return
    init = _module_init(facts, init_fn)
    wanted: dict[str, list[tuple[str, torch.Tensor]]] = {}  # owner module -> (attribute, destination)
    if not buffers_only:
        _check_initialisable(facts, list(entries), init_fn)
        seen: set[tuple] = set()
        for name, t in entries.items():
            if storage_key(t) in seen or name not in facts.canonical:
                continue
            seen.add(storage_key(t))
            mname, attr = facts.owner[facts.canonical[name]]
            wanted.setdefault(mname, []).append((attr, t))
    for mname, attrs in facts.nonpersistent.items():
        module = facts.modules[mname]
        for attr in attrs:
            b = module._buffers.get(attr)
            if b is not None and not b.is_meta:  # held by this rank
                wanted.setdefault(mname, []).append((attr, b))
    for mname in facts.modules:  # model order: deterministic, the same on every rank
        if mname not in wanted:
            continue
        full = _full_values(facts, mname, seed, init)
        for attr, dest in wanted[mname]:
            write_slice(dest, full[attr])


def write_slice(dest: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` (the whole tensor) into ``dest``: a DTensor's local shard (its offset
    from the placements: tp's Megatron shards, FSDP2's dim-0 shards, both at once; tp's packed expert weights
    block by block: ``plait.components.hf_checkpoint.local_boxes``), or a plain tensor whole."""
    from plait.components.hf_checkpoint import local_boxes

    for view, offset in local_boxes(dest):
        view.copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, view.shape, strict=True))])


def initialise_like(model: nn.Module, seed: int, init_fn: InitFn | None = None) -> nn.Module:
    """The reference of ``initialise`` in one process: ``model`` (whole, on the meta device or not) gets the
    weights a meta-built copy of it gets at any layout from the same ``seed``. Returns ``model``, on the CPU."""
    facts = ModelFacts.of(model)
    facts.modules = dict(model.named_modules(remove_duplicate=False))
    facts.root, facts.meta = model, True
    materialise(model, torch.device("cpu"))
    initialise(facts, model.state_dict(keep_vars=True), seed, init_fn)
    return model
