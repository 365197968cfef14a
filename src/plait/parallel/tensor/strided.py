"""Checkpoint entries for tensors split with torch's ``_StridedShard`` (packed ``[gate; up]`` expert weights
under tensor parallelism, ``plait.parallel.tensor.hf``), which DCP cannot write as DTensors.

A weight of global size ``G`` on the split dim, packed from ``s`` blocks (gate and up: ``s = 2``) and split
over ``n`` ranks, leaves rank ``r`` the rows ``[b G/s + r G/(s n), b G/s + (r+1) G/(s n))`` of every block
``b``, stored one after another: ``s`` rectangular boxes of the single-process tensor, each a view of the
local shard. ``strided_entries`` hands those boxes to DCP as ``plait.checkpoint.pieces.Pieces``, so the
checkpoint holds the single-process tensor under its name and loads into any layout (with that module's
planners).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from plait.checkpoint.hf import local_boxes
from plait.checkpoint.pieces import Pieces


def is_strided(t: Any) -> bool:
    """Whether ``t`` is a DTensor split with ``_StridedShard`` on a 1-D mesh (a packed expert weight over tp). On
    a 2-D mesh it is FSDP2's dp shard of a tp shard (tp with ZeRO-3 or HSDP), which DCP writes as it is."""
    return (isinstance(t, DTensor) and t.device_mesh.ndim == 1
            and any(isinstance(p, _StridedShard) for p in t.placements))


def strided_boxes(t: DTensor) -> Pieces:
    """``t``'s local shard as boxes of the global tensor (see the module docstring)."""
    if t.device_mesh.ndim != 1 or len(t.placements) != 1:
        raise ValueError("strided checkpoints take DTensors on a 1-D mesh")
    return Pieces(t.shape, [(torch.Size(offset), view.detach()) for view, offset in local_boxes(t)])


def strided_entries(entries: dict[str, Any]) -> dict[str, Any]:
    """``entries`` with every strided DTensor replaced by its boxes (a new dict; other values as they are)."""
    return {k: strided_boxes(v) if is_strided(v) else v for k, v in entries.items()}
