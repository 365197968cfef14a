"""Reusable layers that user models can use too."""

from plait.nn.moe import MoE, max_violation, moe_layers
from plait.nn.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

__all__ = ["MoE", "SyncBatchNorm", "convert_sync_batchnorm", "max_violation", "moe_layers"]
