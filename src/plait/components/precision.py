"""Mixed precision: autocast for bf16 and fp16, and a dynamic loss scaler for fp16.

The loss scaler is plait's own rather than ``torch.amp.GradScaler`` because gradients do not always
live in the optimizer's parameters: the ZeRO optimizer holds reduced gradient shards and FSDP2
holds DTensor shards. The scaler only multiplies whatever gradient tensors the layout names, and
the overflow decision comes from the global gradient norm, which every layout already computes
across its shards, so all ranks skip or step together.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device, enabled: bool = True) -> contextlib.AbstractContextManager:
    """Autocast context for ``precision``; fp32 (or ``enabled=False``) runs without one."""
    if precision == "fp32" or not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=_DTYPES[precision])


class LossScaler:
    """Dynamic loss scaling: multiply the loss by ``scale`` before backward, divide the gradients after.

    On a non-finite gradient norm the step is skipped and the scale halves; after ``growth_interval``
    clean steps in a row it doubles. Disabled (scale 1, nothing done) for fp32 and bf16, whose
    exponent range needs none.
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.clean_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    @torch.no_grad()
    def unscale(self, grads: Iterable[torch.Tensor]) -> None:
        if self.enabled:
            for g in grads:
                g.mul_(1.0 / self.scale)

    def update(self, found_nonfinite: bool) -> None:
        if not self.enabled:
            return
        if found_nonfinite:
            self.scale /= 2.0
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= 2.0
            self.clean_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
