"""A rank's checkpoint as bytes for the in-memory copy (``plait.fault.holder``), and back.

``pack`` takes what this rank writes to disk at a save (its share of the model and optimizer state as the
layout's state, ``Layout.state.state_dicts``, gives them, with DTensors as their local shards; its RNG and
per-rank state; the shared run state and metadata) and returns ``torch.save`` bytes. ``decode`` reads them with
``torch.load(weights_only=True)`` (tensors and plain values only: nothing is unpickled as code) and fits them
into this run's layout's state-dict template, so that every rank can agree before any loads; ``load`` then
goes through the same ``load_state_dicts`` a disk load ends with. Each tensor goes into the template's place
(a DTensor rebuilt from its local shard with the template's mesh and placements). A copy only fits the layout
and world size it was taken at, which a restart of the same job keeps; anything else (another world size)
loads from disk.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from plait.checkpoint.dcp import rng_state, set_rng_state


def _local(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by its local shard (detached: the bytes are a copy)."""
    if isinstance(tree, dict):
        return {k: _local(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_local(v) for v in tree)
    if isinstance(tree, torch.Tensor):
        local = tree.to_local() if hasattr(tree, "to_local") else tree
        return local.detach()
    return tree


def _fill(template: Any, saved: Any, where: str = "") -> Any:
    """``saved`` in the shape of ``template``: DTensors rebuilt around the saved local shards."""
    if isinstance(template, dict):
        if not isinstance(saved, dict) or set(saved) != set(template):
            raise ValueError(f"the in-memory copy's entries differ from this run's at {where or 'the top'}")
        return {k: _fill(v, saved[k], f"{where}.{k}") for k, v in template.items()}
    if isinstance(template, list | tuple):
        return type(template)(_fill(t, s, f"{where}[{i}]") for i, (t, s) in enumerate(zip(template, saved,
                                                                                            strict=True)))
    if isinstance(template, torch.Tensor) and hasattr(template, "to_local"):
        from torch.distributed.tensor import DTensor

        if saved.shape != template.to_local().shape:
            raise ValueError(f"the in-memory copy's shard of {where} has shape {tuple(saved.shape)}, not "
                             f"{tuple(template.to_local().shape)}")
        return DTensor.from_local(saved.to(template.device), template.device_mesh, template.placements,
                                  shape=template.shape, stride=template.stride())
    if isinstance(template, torch.Tensor) and saved.shape != template.shape:
        raise ValueError(f"the in-memory copy's {where} has shape {tuple(saved.shape)}, not {tuple(template.shape)}")
    return saved


def pack(state: Any, meta: dict[str, Any], rank_state: dict[str, Any] | None, shared: dict[str, Any]) -> memoryview:
    """This rank's checkpoint as bytes (see the module docstring; a view of the buffer: no second copy)."""
    model_sd, optim_sd = state.state_dicts()
    buffer = io.BytesIO()
    torch.save({"model": _local(model_sd), "optim": _local(optim_sd), "rng": rng_state(),
                "rank_state": rank_state, "shared": shared, "meta": meta}, buffer)
    return buffer.getbuffer()


class Decoded:
    """A copy read back and fitted to this run's layout (``decode``), not yet loaded (``load``)."""

    def __init__(self, model_sd: dict, optim_sd: dict, saved: dict[str, Any]) -> None:
        self.model_sd, self.optim_sd, self.saved = model_sd, optim_sd, saved


def decode(payload: bytes | bytearray, state: Any) -> Decoded:
    """Read ``pack``'s bytes (``torch.load(weights_only=True)``) and fit them into ``state``'s state-dict
    template; nothing is loaded yet. Raises ``ValueError`` (or torch's ``UnpicklingError`` for bytes that are
    not a plain copy) when the copy does not fit: the caller then reads the disk."""
    saved = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
    model_sd, optim_sd = state.state_dicts()
    return Decoded(_fill(model_sd, saved["model"], "model"), _fill(optim_sd, saved["optim"], "optim"), saved)


def load(decoded: Decoded, state: Any) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
    """Load a decoded copy into ``state`` (a layout's) and this rank's RNG; returns (meta, rank_state, shared) as
    ``plait.checkpoint.dcp.load_state`` does."""
    state.load_state_dicts(decoded.model_sd, decoded.optim_sd)
    set_rng_state(decoded.saved["rng"])
    return decoded.saved["meta"], decoded.saved["rank_state"], decoded.saved["shared"]
