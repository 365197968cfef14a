"""What a replica group's heal copies and how it travels: torchft's HTTP checkpoint transport reading a peer's state
without pickle's code execution, the mesh axes along which a group's ranks hold the same local entries (each rank of
a replacement group takes its own part from the peer rank at its place), and a peer's optimizer state made loadable
into this rank's optimizer."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from plait.parallel.errors import PlaitError
from plait.topology import AXIS_ORDER, MeshAxis, Topology


def weights_only_transport(timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport, reading a peer's state with ``torch.load(weights_only=True)``: torchft's
    own reads it with pickle's code execution (``weights_only=False``), which plait never does. What a heal sends
    (tensors, numbers, strings, lists, tuples, dicts) needs nothing more."""
    import urllib.request

    from torchft.checkpointing._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport

    class WeightsOnlyHTTPTransport(HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                return _streaming_load(f, weights_only=True)

    return WeightsOnlyHTTPTransport(timeout=timeout, num_chunks=0)


def mesh_axes(name: str) -> list[str]:
    """The group topology's axes a DTensor mesh dimension spans: its own name, or a flattened one's parts
    (``dp_replicate_dp_shard``: torch joins the flattened names with ``_``, which the names themselves contain)."""
    axes, rest = [], name
    while rest:
        axis = next((a for a in sorted(map(str, AXIS_ORDER), key=len, reverse=True)
                     if rest == a or rest.startswith(a + "_")), None)
        if axis is None:
            raise PlaitError(f"fault.mode=replicas: a parameter is laid out on a device mesh dimension {name!r} that "
                             "is not one of the group topology's axes; build sharded models through Plait.setup")
        axes.append(axis)
        rest = rest[len(axis) + 1:]
    return axes


def held_alike(topo: Topology, t: torch.Tensor) -> tuple[str, ...]:
    """The mesh axes of the group's topology along which its ranks hold the same local ``t`` (in mesh order; empty:
    no other rank does): every axis of more than one rank but the pipeline's (each stage holds entries of its
    own), less those a DTensor is sharded on (a Megatron shard's tp, an FSDP shard's data-parallel axes, an expert
    weight's ep: ``ExpertSync.entries`` gives it as the ``Shard(0)`` of the global ``(E, ...)`` tensor over ep, so it
    is the same only along the expert-data-parallel axes). Along cp every rank holds the same entries: the cp ranks
    cut the sequence, not the model."""
    sharded: set[str] = set()
    if isinstance(t, DTensor):
        names = t.device_mesh.mesh_dim_names
        if names is None:
            raise PlaitError("fault.mode=replicas: a parameter is laid out on a device mesh without axis names; build "
                             "sharded models through Plait.setup")
        for name, placement in zip(names, t.placements, strict=True):
            if not placement.is_replicate():
                sharded.update(mesh_axes(name))
    return tuple(str(a) for a in AXIS_ORDER if a != MeshAxis.PP and str(a) not in sharded and topo.degree(a) > 1)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard (a view: writing it writes the DTensor), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def optimizer_template(o: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
    """A peer's optimizer state of plain local tensors, made loadable into ``o``: state entries of a DTensor
    parameter's local shape become DTensors laid out like it."""
    params = [p for g in o.param_groups for p in g["params"]]
    state = {}
    for i, entries in sd["state"].items():
        p = params[int(i)]
        state[i] = {k: (DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                        if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and k != "step"
                        and v.shape == p.to_local().shape else v) for k, v in entries.items()}
    return {"state": state, "param_groups": sd["param_groups"]}
