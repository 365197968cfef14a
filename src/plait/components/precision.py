"""Mixed precision: autocast for bf16 and fp16, and a dynamic loss scaler for fp16.

The loss scaler is plait's own rather than ``torch.amp.GradScaler`` because gradients do not always
live in the optimizer's parameters: the ZeRO optimizer holds reduced gradient shards and FSDP2
holds DTensor shards. The scaler only multiplies whatever gradient tensors the layout names, and
the overflow decision comes from the global gradient norm, which every layout already computes
across its shards, so all ranks skip or step together.

Its scale lives on the device (a 0-dim tensor, as ``GradScaler`` keeps it): the loss is multiplied by it, the
gradients by its inverse, and after each step ``torch._amp_update_scale_`` halves or grows it from the step's
non-finite flag without the host reading anything. ``scale`` (a float) reads it, for the user who asks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from plait.config import ConfigError

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_skip(precision: str, skip_nonfinite: bool | str) -> None:
    """``optim.skip_nonfinite=false`` with fp16: its loss scaling lets a step overflow and must not apply it."""
    if precision == "fp16" and skip_nonfinite is False:
        raise ConfigError("optim.skip_nonfinite=false with train.precision=fp16: fp16's loss scaling skips the steps "
                          "whose scaled gradients overflow, then lowers the scale; set optim.skip_nonfinite=auto")


def compute_dtype(precision: str) -> torch.dtype | None:
    """The lower-precision dtype ``precision`` computes in (bfloat16, float16), or None for fp32."""
    return _DTYPES.get(precision)


def autocast(precision: str, device: torch.device, enabled: bool = True) -> contextlib.AbstractContextManager:
    """Autocast context for ``precision``; fp32 (or ``enabled=False``) runs without one."""
    if precision == "fp32" or not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=_DTYPES[precision])


class LossScaler:
    """Dynamic loss scaling: multiply the loss by the scale before backward, divide the gradients after.

    On a non-finite gradient norm the step is skipped and the scale halves; after ``growth_interval``
    clean steps in a row it doubles. Disabled (scale 1, nothing done, no tensor) for fp32 and bf16, whose
    exponent range needs none.
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 2000,
                 device: torch.device | str = "cpu") -> None:
        self.enabled = enabled
        self.growth_interval = growth_interval
        self._scale = torch.full((), init_scale if enabled else 1.0, dtype=torch.float32, device=device)
        self._clean = torch.zeros((), dtype=torch.int32, device=device)  # clean steps in a row

    @property
    def scale(self) -> float:
        """The current scale, read from the device (1.0 when disabled)."""
        return float(self._scale) if self.enabled else 1.0

    def loss_factor(self) -> torch.Tensor | float:
        """What the loss is multiplied by before backward: the device scale, or 1.0 (a float) when disabled."""
        return self._scale if self.enabled else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale if self.enabled else loss

    @torch.no_grad()
    def unscale(self, grads: Sequence[torch.Tensor]) -> None:
        """Divide ``grads`` by the scale in place (a power of two: exact); nothing when disabled."""
        if self.enabled and grads:
            torch._foreach_mul_(list(grads), self._scale.reciprocal())

    def update(self, found_nonfinite: torch.Tensor | bool) -> None:
        """After a step: halve on a non-finite one (a 0-dim float tensor on the device, 1.0 for skipped),
        else count a clean step and double after ``growth_interval`` of them; on the device."""
        if not self.enabled:
            return
        flag = torch.as_tensor(float(found_nonfinite) if isinstance(found_nonfinite, bool) else found_nonfinite,
                               dtype=torch.float32, device=self._scale.device)
        torch._amp_update_scale_(self._scale, self._clean, flag, 2.0, 0.5, self.growth_interval)

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "clean_steps": int(self._clean)}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self._scale.fill_(float(state["scale"]))
        self._clean.fill_(int(state["clean_steps"]))
