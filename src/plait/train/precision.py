"""Mixed precision: autocast for bf16 and fp16, and a dynamic loss scaler for fp16."""

from __future__ import annotations

import contextlib

import torch

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast context for ``precision``; fp32 runs without one. Parameters stay fp32 throughout."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=_DTYPES[precision])


def build_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """A dynamic loss scaler for fp16 (doubles every 2000 clean steps, halves on overflow);
    disabled (scale 1, no checks) for fp32 and bf16, whose exponent range needs none."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")
