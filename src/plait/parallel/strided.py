"""Checkpoint entries for tensors split with torch's ``_StridedShard`` (packed ``[gate; up]`` expert weights
under tensor parallelism, ``plait.parallel.hf_tp``), which DCP cannot write as DTensors.

A weight of global size ``G`` on the split dim, packed from ``s`` blocks (gate and up: ``s = 2``) and split
over ``n`` ranks, leaves rank ``r`` the rows ``[b G/s + r G/(s n), b G/s + (r+1) G/(s n))`` of every block
``b``, stored one after another: ``s`` rectangular boxes of the single-process tensor, each a view of the
local shard. ``strided_entries`` hands those boxes to DCP as the chunks of one tensor (the
``__create_write_items__`` / ``__create_chunk_list__`` protocol DTensor itself uses), so the checkpoint holds
the single-process tensor under its name and loads into any layout; a load reads the boxes in place. The
planners find a box by its offset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard


def is_strided(t: Any) -> bool:
    """Whether ``t`` is a DTensor split with ``_StridedShard`` on a 1-D mesh (a packed expert weight over tp). On
    a 2-D mesh it is FSDP2's dp shard of a tp shard (tp with ZeRO-3 or HSDP), which DCP writes as it is."""
    return (isinstance(t, DTensor) and t.device_mesh.ndim == 1
            and any(isinstance(p, _StridedShard) for p in t.placements))


@dataclass
class StridedBoxes:
    """This rank's boxes of one single-process tensor of ``shape``: ``(offsets, view)`` pairs."""

    shape: torch.Size
    boxes: list[tuple[torch.Size, torch.Tensor]]

    def size(self) -> torch.Size:
        return self.shape

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=off, sizes=t.shape),
                                                      properties=TensorProperties.create_from_tensor(t),
                                                      size=self.shape))
                for off, t in self.boxes]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=off, sizes=t.shape) for off, t in self.boxes]

    def piece(self, index: MetadataIndex) -> torch.Tensor:
        for off, t in self.boxes:
            if off == index.offset:
                return t
        raise ValueError(f"{index.fqn}: this rank holds no box at {index.offset}")


def strided_boxes(t: DTensor) -> StridedBoxes:
    """``t``'s local shard as boxes of the global tensor (see the module docstring)."""
    if t.device_mesh.ndim != 1 or len(t.placements) != 1:
        raise ValueError("strided checkpoints take DTensors on a 1-D mesh")
    (placement,) = t.placements
    d, s = placement.dim, placement.split_factor
    n, r = t.device_mesh.size(), t.device_mesh.get_local_rank()
    block = t.shape[d] // s
    chunk = block // n
    local = t.to_local().detach()
    boxes = []
    for b in range(s):
        offsets = [0] * t.dim()
        offsets[d] = b * block + r * chunk
        boxes.append((torch.Size(offsets), local.narrow(d, b * chunk, chunk)))
    return StridedBoxes(t.shape, boxes)


def strided_entries(entries: dict[str, Any]) -> dict[str, Any]:
    """``entries`` with every strided DTensor replaced by its boxes (a new dict; other values as they are)."""
    return {k: strided_boxes(v) if is_strided(v) else v for k, v in entries.items()}


class StridedSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, for state dicts holding ``StridedBoxes``."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        return obj.piece(index) if isinstance(obj, StridedBoxes) else super().lookup_object(index)


class StridedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, for state dicts holding ``StridedBoxes`` (read in place into the views)."""

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        # The default's, without its meta-tensor initialisation (there are none), which does not know the boxes.
        self.original_state_dict = state_dict
        self.state_dict, self.mappings = flatten_state_dict(state_dict)
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        return obj.piece(index) if isinstance(obj, StridedBoxes) else super().lookup_tensor(index)
