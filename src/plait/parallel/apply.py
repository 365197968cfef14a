"""Composition of parallelisms, in one documented order.

Build the model, then tensor parallel -> activation checkpointing -> pipeline split ->
data/ZeRO/FSDP wrapping, each step returning the model. The result is a ``Layout`` (``layout.py``,
``mp_layout.py``): the one object the trainer talks to, whatever the strategy underneath.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.comm.collectives import Comm
from plait.config import Config
from plait.parallel.checkpointing import apply_activation_checkpointing
from plait.parallel.data import apply_data_parallel
from plait.parallel.layout import FsdpLayout, Layout, ZeroLayout
from plait.topology import Topology


def apply_parallel(model: nn.Module, topo: Topology, cfg: Config, comm: Comm,
                   sample: tuple[torch.Tensor, torch.Tensor]) -> Layout:
    """Apply the configured layout to ``model`` in the composition order; returns the trainer's Layout.

    ``sample`` is one micro-batch, used to profile per-layer costs for the pipeline split.
    Unsupported combinations were rejected by ``config.validate``.
    """
    p, t = cfg.parallel, cfg.train
    if p.tp > 1:
        from plait.parallel.tensor import apply_tensor_parallel

        model = apply_tensor_parallel(model, topo.mesh["tp"], sequence_parallel=p.sequence_parallel,
                                      loss_parallel=p.loss_parallel)
    model = apply_activation_checkpointing(model, t.activation_checkpointing, t.checkpoint_every_k)
    if p.tp > 1 and p.zero == 3:
        from plait.parallel.mp_layout import TensorFsdpLayout

        return TensorFsdpLayout(model, cfg, topo)
    if p.pp > 1 or p.tp > 1:
        from plait.parallel.mp_layout import PipelineLayout, TensorLayout

        return PipelineLayout(model, cfg, topo, comm, sample) if p.pp > 1 else TensorLayout(model, cfg, topo, comm)
    if p.zero in (1, 2):
        return ZeroLayout(model, cfg, topo, comm)
    if p.zero == 3:
        return FsdpLayout(model, cfg, topo)
    engine = apply_data_parallel(model, topo.dp_group, topo.dp, p.impl, p.bucket_mb, comm)
    return Layout(model, cfg, engine)
