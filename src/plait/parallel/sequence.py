"""Marks a Hugging Face decoder's base model carries under sequence parallelism, read by the tensor and pipeline
packages alike: over how many tp ranks its residual stream is split, the mesh, and whether its first layer's input
is this rank's slice already. Here, below both, so neither imports the other.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

SHARDS_ATTR = "_plait_sequence_shards"
MESH_ATTR = "_plait_sequence_mesh"
SLICED_ATTR = "_plait_input_sliced"


def sequence_shards(base: nn.Module) -> int:
    """Over how many ranks the residual stream of ``base`` (a decoder's base model) is split along the sequence."""
    return int(base.__dict__.get(SHARDS_ATTR, 1))


def sequence_mesh(base: nn.Module) -> DeviceMesh | None:
    """The tp mesh the residual stream of ``base`` (a decoder's base model) is split over; None without sequence
    parallelism."""
    ref = base.__dict__.get(MESH_ATTR)
    return ref() if ref is not None else None


def slice_sequence(mesh: DeviceMesh, x: torch.Tensor) -> torch.Tensor:
    """This tp rank's slice ``(B, T / tp, C)`` of the whole sequence ``x`` every rank of ``mesh`` holds (the
    embedding's output), as the first layer takes it (forward: no communication; backward: an all-gather of the
    gradient)."""
    return DTensor.from_local(x, mesh, (Replicate(),), run_check=False).redistribute(mesh, (Shard(1),)).to_local()


def mark_first_layer_sliced(base: nn.Module, layers: nn.Module | None) -> None:
    """Tell the first of ``layers`` that its input is this rank's slice already (a pipeline's first stage slices the
    embedding's output itself: ``slice_sequence``); no effect without sequence parallelism."""
    if layers is not None and len(layers) and sequence_shards(base) > 1:
        layers[0].__dict__[SLICED_ATTR] = True
