"""Tensors a rank holds as rectangular boxes of the single-process tensor, written and read by DCP.

``Pieces`` hands DCP the boxes as the chunks of one sharded tensor (the ``__create_write_items__`` /
``__create_chunk_list__`` protocol DTensor itself uses), so a checkpoint holds the single-process tensor under
its name and loads into any layout; a load reads the boxes in place. The planners find a box by its offset.
Used by the parameter server (a server's flat shard cut into boxes, ``plait.ps.checkpoint``) and by tensor
parallelism's strided expert weights (``plait.parallel.tensor.strided``).
"""

from __future__ import annotations

from collections.abc import Callable
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


@dataclass
class Pieces:
    """What this rank holds of one single-process tensor of ``shape``: boxes at global ``offsets`` with
    their local tensors (views of what the rank stores)."""

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
        if index.index is not None and index.index < len(self.boxes) and self.boxes[index.index][0] == index.offset:
            return self.boxes[index.index][1]
        for off, t in self.boxes:
            if off == index.offset:
                return t
        raise ValueError(f"{index.fqn}: this rank holds no chunk at {index.offset}")


class PiecesSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, for state dicts holding ``Pieces``; ``extra`` joins the state dict (a
    server's ``ps`` entries). ``lowest_rank``: replicated tensors are written by the lowest rank holding them."""

    def __init__(self, extra: dict[str, Any] | None = None, lowest_rank: bool = True) -> None:
        super().__init__(dedup_save_to_lowest_rank=lowest_rank)
        self.extra = extra or {}

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        super().set_up_planner({**state_dict, **self.extra}, storage_meta, is_coordinator)

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        return obj.piece(index) if isinstance(obj, Pieces) else super().lookup_object(index)


class PiecesLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, for state dicts holding ``Pieces`` (read in place into the views);
    ``extra(metadata)`` adds entries shaped after what the checkpoint holds (a server's ``ps``)."""

    def __init__(self, extra: Callable[[Metadata], dict[str, Any]] | None = None) -> None:
        super().__init__()
        self.extra = extra

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        # The default's, without its meta-tensor initialisation (there are none), which would replace the
        # ``Pieces`` it does not know by None.
        if self.extra is not None and metadata is not None:
            state_dict.update(self.extra(metadata))
        self.original_state_dict = state_dict
        self.state_dict, self.mappings = flatten_state_dict(state_dict)
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        return obj.piece(index) if isinstance(obj, Pieces) else super().lookup_tensor(index)
