"""Activation memory by measurement: bytes of tensors autograd keeps for the backward.

``SavedTensorMeter`` installs ``torch.autograd.graph.saved_tensors_hooks``: every tensor saved for
backward is counted once per storage while any graph still holds it, so ``live`` is the activation
memory held right now and ``peak`` the most held at once. Parameters saved by a layer count too (once,
since the same storage is shared), which shifts every measurement by the same constant.
"""

from __future__ import annotations

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
