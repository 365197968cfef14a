"""Activation memory by measurement: bytes of tensors autograd keeps for the backward.

``SavedTensorMeter`` installs ``torch.autograd.graph.saved_tensors_hooks``: every tensor saved for
backward is counted once per storage while any graph still holds it, so ``live`` is the activation
memory held right now and ``peak`` the most held at once. Parameters saved by a layer count too (once,
since the same storage is shared), which shifts every measurement by the same constant.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor


class _Saved:
    """A saved tensor whose collection (when its graph is freed) releases its bytes in the meter."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor: torch.Tensor, key: int, meter: SavedTensorMeter) -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter._release(self.key)


class SavedTensorMeter:
    """Context manager measuring live and peak bytes of tensors saved for backward inside it."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list[int]] = {}  # storage ptr -> [references, bytes]
        self._hooks: Any = None

    def _pack(self, t: torch.Tensor) -> _Saved:
        if isinstance(t, DTensor):
            with torch.no_grad():
                t_local = t.to_local()
        else:
            t_local = t
        storage = t_local.untyped_storage()
        key = storage.data_ptr()
        entry = self._refs.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        return _Saved(t, key, self)

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    def _release(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._refs[key]

    def __enter__(self) -> SavedTensorMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


class LiveTensorMeter:
    """Context manager measuring the bytes of every tensor created inside it that is still alive: ``live`` now,
    ``peak`` the most at once. Unlike ``SavedTensorMeter`` it sees what selective checkpointing keeps (the
    outputs it caches are not saved tensors) and what a pipeline schedule holds between actions, along with
    every temporary; ``live`` at the end of a forward is the activation memory that forward left behind.

    A dispatch mode: it sees each operator's outputs (a DTensor's local shard), counts each new storage once
    (views and in-place results share an input's storage: parameters seen through ``weight.t()`` do not
    count) and releases it when the storage is freed. Not for compiled code (a dispatch mode would see the graph's
    operators only where dynamo lets it)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()
        self._mode: Any = None

    def _track(self, t: Any) -> None:
        if isinstance(t, DTensor):
            t = t._local_tensor
        t = getattr(t, "elem", t)  # a functional collective's AsyncCollectiveTensor: the tensor it wraps
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._seen or storage.nbytes() == 0:
            return
        self._seen.add(key)
        n = storage.nbytes()
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, n)

    def _free(self, key: int, n: int) -> None:
        self._seen.discard(key)
        self.live -= n

    def __enter__(self) -> LiveTensorMeter:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        meter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
                out = func(*args, **(kwargs or {}))
                if not any(r.alias_info is not None for r in func._schema.returns):  # views share an input's storage
                    for t in tree_flatten(out)[0]:
                        meter._track(t)
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)
