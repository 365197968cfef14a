"""Composition of parallelisms, in one documented order.

Build the model, then tensor parallel -> activation checkpointing -> pipeline split -> data/ZeRO/FSDP
wrapping, each step returning the model. This foundation applies the data-parallel step; the
others slot in before it in that order.
"""

from __future__ import annotations

from torch import nn

from plait.comm.collectives import Comm
from plait.config import Config, ConfigError
from plait.parallel.data import GradReducer, LocalGrads, TorchDDP, apply_data_parallel
from plait.topology import Topology


def apply_parallel(model: nn.Module, topo: Topology, cfg: Config,
                   comm: Comm) -> GradReducer | TorchDDP | LocalGrads:
    """Apply the configured layout to ``model``; returns the data-parallel engine wrapping it."""
    p = cfg.parallel
    if p.tp > 1 or p.pp > 1 or p.ep > 1:
        raise ConfigError(
            f"parallel.tp={p.tp}, parallel.pp={p.pp}, parallel.ep={p.ep}: this build of plait trains with "
            "data parallelism only; set them to 1"
        )
    return apply_data_parallel(model, topo.dp_group, topo.dp, p.impl, p.bucket_mb, comm)
