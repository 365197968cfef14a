"""A parameter-server worker's state (``ParameterServer.state``): the same ``StateContract`` as every layout's
(``plait.checkpoint.layout_state``), answered from what a worker holds. The servers hold the parameters and the
optimizer states and write their own shards of a checkpoint (``plait.ps.checkpoint``, joined through the layout's
``CheckpointJoin``); a worker writes the model's entries the servers do not hold (buffers: worker 0's are written),
holds no optimizer state, and pulls the servers' parameters after a load, before a full state and before an export.
Filling the model before the optimizer exists (``prepare_weights``) and its entries are every whole model's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from plait.checkpoint.layout_state import LayoutState
from plait.checkpoint.pieces import PiecesSavePlanner
from plait.ps.checkpoint import untrained_state
from plait.ps.shard import FlatLayout


@torch.no_grad()
def install(flat: FlatLayout, values: torch.Tensor) -> None:
    """``values`` (the flat order, as the servers send it) written into the model's parameters, on their device."""
    flat.unflatten_into(values.to(flat.params[0].device) if flat.params else values)


class PsState(LayoutState):
    """A worker's state (see the module docstring); ``layout`` is its ``plait.ps.layout.ParameterServer``."""

    def _pull(self) -> None:
        """The servers' current parameters into this worker's model."""
        install(self.layout.flat, self.layout.client.pull())

    def state_dicts(self) -> tuple[dict, dict]:
        """This worker's part of a checkpoint: the model's entries the servers do not hold (buffers); the
        servers contribute the parameters and optimizer states. A worker holds no optimizer state."""
        return untrained_state(self.layout.model, self.layout.flat), {}

    def load_state_dicts(self, model_sd: dict, optim_sd: dict) -> None:
        """The buffers were read in place; the parameters come from the servers (``finish_load``)."""

    def save_planner(self) -> Any:
        return PiecesSavePlanner()  # replicated buffers: worker 0's are written

    def finish_load(self) -> None:
        """After ``load_state``: the servers' versions and this worker's clock, then pull the loaded weights."""
        self.layout.client.loaded()
        self._pull()

    def full_model_state(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The servers' current parameters (pulled fresh) under the single-process names."""
        self._pull()
        return self.layout.model.state_dict()

    def export_weights(self, out: Path, group: Any, coordinator: bool, max_shard_bytes: int) -> Path:
        """The servers hold the current weights: pulled fresh into this worker's model, then written as any
        whole model is (``LayoutState.export_weights``)."""
        self._pull()
        return super().export_weights(out, group, coordinator, max_shard_bytes)
