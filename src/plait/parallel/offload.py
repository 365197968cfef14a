"""Activation offload (``train.activation_offload``): what each block saves for backward waits in host memory.

Each of the model's blocks (``plait.parallel.units.find_blocks``) runs its forward inside
``torch.autograd.graph.saved_tensors_hooks``: every tensor an operator saves for backward is copied to host
memory when it is saved and copied back when backward needs it, so between a block's forward and its backward
the device holds none of its activations. What is moved: each distinct storage once per block and forward
(a tensor saved by three operators, or a view of one, is one copy), parameters never (they stay on the device;
autocast's half-precision copies of them are activations and move). A DTensor's local shard moves and the
DTensor is rebuilt around it; a tensor subclass (torchao's float8 tensors under tensor parallelism and FSDP2)
moves the tensors it is made of and is rebuilt from them (``__tensor_flatten__`` / ``__tensor_unflatten__``).

On a GPU the host buffers are pinned and the copies run on a side stream: a block's copies to the host overlap
the forward that follows (the device memory is kept until its copy has finished, ``record_stream``), and when
backward first needs a block's tensors the previous block's are brought back on the side stream, so they
arrive while this block computes its backward (one block ahead, as Megatron's and torchtitan's offload do).
On a CPU the "host" is the same memory: the path runs (and its numerics and bytes are tested) but saves
nothing.

``OffloadStats`` counts the bytes moved each way and the host bytes alive; the planner prices the same
figure (``plait.plan.stages``: every block's saved bytes, its host-link transfer against its compute).
Compiled blocks (``train.compile``) keep it: the hooks that open and close each block's saved-tensor context run
eagerly around the block's compiled region (``torch.compiler.disable``), and the compiled graph's saved tensors go
through the context as any autograd function's do (AOTAutograd saves what its backward needs; the same path moves
them). A whole-model region would hold the hooks inside it, so the layout compiles block by block
(``plait.parallel.compose.compile_blocks_because``).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from plait.parallel.units import find_blocks


@dataclass
class OffloadStats:
    """Bytes moved to the host and back since the start, and the host bytes alive now and at most."""

    to_host: int = 0
    to_device: int = 0
    host_live: int = 0
    host_peak: int = 0


@dataclass
class _Group:
    """One block's forward: its storages on the host (with the device each came from), keyed by the device
    storage they copy, and once backward needs them, their copies back on the device."""

    index: int
    module: nn.Module
    host: dict[int, tuple[torch.Tensor, torch.device]] = field(default_factory=dict)
    back: dict[int, torch.Tensor] = field(default_factory=dict)
    params: set[int] | None = None  # storages of the block's parameters (read at the first save: FSDP2 has
    # gathered them by then)
    # the storages copied, held until the block's forward ends: a freed storage's address could otherwise be
    # reused inside the same forward by a new tensor, which its key would then mistake for the copied one
    holding: list[Any] = field(default_factory=list)
    event: Any = None  # the side stream's copy back (CUDA), waited on before the tensors are used
    prev: Any = None  # weak reference to the previous block's group of the same forward

    def __hash__(self) -> int:
        return id(self)


class _Handle:
    """A saved tensor in host memory: its group, its storage's key, and the view of the storage it was."""

    __slots__ = ("group", "key", "dtype", "size", "stride", "offset", "spec")

    def __init__(self, group: _Group, key: int, t: torch.Tensor, spec: Any) -> None:
        self.group, self.key, self.spec = group, key, spec
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()


class ActivationOffload:
    """The hooks on every block of one model (module docstring). ``stats`` is what was moved."""

    def __init__(self) -> None:
        self.stats = OffloadStats()
        self._last: dict[int, Any] = {}  # block index -> weak reference to its latest forward's group
        self._active: list[Any] = []
        self._stream: Any = None

    # -- forward: the hooks around each block --------------------------------------------------------------
    @torch.compiler.disable
    def enter(self, index: int, module: nn.Module) -> None:
        group = _Group(index, module, prev=self._last.get(index - 1))
        self._last[index] = weakref.ref(group)
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(group, t), self._unpack)
        hooks.__enter__()
        self._active.append((hooks, group))

    @torch.compiler.disable
    def leave(self) -> None:
        hooks, group = self._active.pop()
        hooks.__exit__(None, None, None)
        group.holding = []

    def _pack(self, group: _Group, t: torch.Tensor) -> Any:
        spec, local = None, t
        if isinstance(t, DTensor):
            spec, local = (t.device_mesh, t.placements, t.shape, t.stride()), t._local_tensor
        if isinstance(local, AsyncCollectiveTensor):  # a functional collective's result: the tensor it wraps
            local = local.trigger_wait()
        if group.params is None:
            group.params = {x.untyped_storage().data_ptr() for p in group.module.parameters() for x in _plain(p)}
        if is_traceable_wrapper_subclass(local):  # torchao's float8 tensors: what they are made of moves
            names, ctx = local.__tensor_flatten__()  # type: ignore[attr-defined]
            inner = {n: self._pack(group, getattr(local, n)) for n in names}
            return _Wrapped(type(local), inner, ctx, local.size(), local.stride(), spec)
        storage = local.untyped_storage()
        key = storage.data_ptr()
        if key in group.params or storage.nbytes() == 0:
            return t  # parameters (and views of them) stay where they are
        if key not in group.host:
            group.host[key] = (self._to_host(local, storage), local.device)
            group.holding.append(storage)
            n = storage.nbytes()
            self.stats.to_host += n
            self.stats.host_live += n
            self.stats.host_peak = max(self.stats.host_peak, self.stats.host_live)
        return _Handle(group, key, local, spec)

    def _to_host(self, local: torch.Tensor, storage: Any) -> torch.Tensor:
        src = torch.empty(0, dtype=torch.uint8, device=local.device).set_(storage)
        if local.device.type != "cuda":
            return src.clone()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=local.device)
        host = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(local.device))
        with torch.cuda.stream(self._stream):
            host.copy_(src, non_blocking=True)
        src.record_stream(self._stream)  # the device memory is not reused before the copy has finished
        return host

    # -- backward: bring a group back, and the one before it ahead of time ------------------------------
    def _unpack(self, handle: Any) -> torch.Tensor:
        if isinstance(handle, _Wrapped):
            inner = {n: self._unpack(h) for n, h in handle.inner.items()}
            return _rebuild(handle.cls.__tensor_unflatten__(inner, handle.ctx, handle.size, handle.stride),
                            handle.spec)
        if not isinstance(handle, _Handle):
            return handle
        group = handle.group
        self._bring_back(group)
        if group.event is not None:
            torch.cuda.current_stream().wait_event(group.event)
        prev = group.prev() if group.prev is not None else None
        if prev is not None:
            self._bring_back(prev)  # prefetch: it arrives while this block computes its backward
        raw = group.back[handle.key]
        if raw.is_cuda:  # copied on the side stream, read on this one: not reused before this one is done
            raw.record_stream(torch.cuda.current_stream())
        t = torch.empty(0, dtype=handle.dtype, device=raw.device).set_(
            raw.untyped_storage(), handle.offset, handle.size, handle.stride)
        return _rebuild(t, handle.spec)

    def _bring_back(self, group: _Group) -> None:
        if not group.host:
            return
        cuda = any(dev.type == "cuda" for _, dev in group.host.values())
        if cuda:
            self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream) if cuda else contextlib.nullcontext():
            for key, (host, dev) in group.host.items():
                # on a CPU the host copy is the tensor itself: nothing to copy back
                group.back[key] = host.to(dev, non_blocking=True) if dev.type == "cuda" else host
                self.stats.to_device += host.numel()
                self.stats.host_live -= host.numel()
        if cuda:
            group.event = torch.cuda.Event()
            group.event.record(self._stream)
        group.host = {}


class _Wrapped:
    """A saved tensor subclass (``__tensor_flatten__``): its class and context, and its inner tensors, each packed."""

    __slots__ = ("cls", "inner", "ctx", "size", "stride", "spec")

    def __init__(self, cls: type, inner: dict[str, Any], ctx: Any, size: torch.Size, stride: tuple[int, ...],
                 spec: Any) -> None:
        self.cls, self.inner, self.ctx, self.size, self.stride, self.spec = cls, inner, ctx, size, stride, spec


def _rebuild(t: torch.Tensor, spec: Any) -> torch.Tensor:
    """``t`` again as the DTensor it was saved as (``spec``), or as it is."""
    if spec is None:
        return t
    mesh, placements, shape, stride = spec
    return DTensor.from_local(t, mesh, placements, run_check=False, shape=shape, stride=stride)


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s data: a DTensor's local shard, a tensor subclass's inner tensors, or ``t``."""
    if isinstance(t, DTensor):
        return _plain(t._local_tensor)
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
        return [x for n in names for x in _plain(getattr(t, n))]
    return [t]


def offload_activations(model: nn.Module) -> ActivationOffload:
    """Register the offload hooks on ``model``'s blocks (module docstring); returns the object holding the stats.
    Raises ValueError for a model without repeated blocks."""
    blocks = find_blocks(model)
    if not blocks:
        raise ValueError(f"activation offload moves each block's saved tensors, and {type(model).__name__} has no "
                         "repeated blocks; set train.activation_offload=false")
    offload = ActivationOffload()
    for i, (_, block) in enumerate(blocks):
        block.register_forward_pre_hook(lambda m, _a, i=i: offload.enter(i, m))
        block.register_forward_hook(lambda *_: offload.leave(), always_call=True)
        block.__dict__["_plait_offload"] = offload  # found again by activation_offload_of, after any split
    return offload


def activation_offload_of(model: nn.Module) -> ActivationOffload | None:
    """The offload registered on ``model`` (or on a module holding it), if any."""
    for m in model.modules():
        found = m.__dict__.get("_plait_offload")
        if found is not None:
            return found
    return None
