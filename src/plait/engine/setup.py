"""What ``Plait`` checks and resolves before a layout is applied: the config it is given, the device, the
arguments of ``setup`` and the loss a strategy computes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.components.losses import Loss, infer_loss, resolve_loss
from plait.config import Config, from_sections, load_config
from plait.parallel.errors import PlaitError


def coerce_config(config: Config | str | Path | None, sections: dict[str, Any]) -> Config:
    if isinstance(config, Config):
        base = config
    elif config is None:
        base = Config()
    elif isinstance(config, str | Path):
        base = load_config(config)
    else:
        raise PlaitError(f"Plait takes a plait.Config, a TOML path or keyword sections; got {type(config).__name__}")
    return from_sections(sections, base)


def select_device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def batch_size(batch: Any, loss: Loss) -> int:
    """Samples in a micro-batch: the first dimension of its first input."""
    args, kwargs, _ = loss.split(batch)
    x = args[0] if args else next(iter(kwargs.values()))
    return int(x.shape[0])


def check_setup_args(strategy: Any, model: Any, scheduler: Any) -> None:
    """A clear error for a second ``setup``, a model that is not a module, or a scheduler instance."""
    if strategy is not None:
        raise PlaitError("setup() was already called on this Plait: one Plait trains one model")
    if not isinstance(model, nn.Module):
        raise PlaitError(f"setup() takes a torch.nn.Module; got {type(model).__name__}")
    if scheduler is not None and (not callable(scheduler) or hasattr(scheduler, "step")):
        raise PlaitError("scheduler must be a factory fn(optimizer) -> LR scheduler (plait builds the optimizer "
                         "in setup, so a scheduler made before cannot reference it)")


def setup_loss(model: nn.Module, loss_fn: Any, sample: Any, config: Config, model_whole: bool,
               plan: Any = None) -> Loss | None:
    """The loss ``forward_backward`` computes: ``loss_fn``, or inferred from ``sample`` where the strategy
    computes the loss itself (a model split over ranks: the pipeline's last stage); compiled on its own when the
    model's blocks are (``plan``, a ``plait.parallel.compile.CompilePlan``; a whole-model plan compiles it with
    the model in ``forward_backward``)."""
    loss = resolve_loss(loss_fn)
    if plan is not None and plan.unit == "blocks":
        from plait.parallel.compile import compile_loss

        # in place: the caller's Loss object runs compiled too
        compile_loss(loss, config.parallel, plan.compiler)
    if not model_whole and loss is None:
        if sample is None:
            raise PlaitError("with parallel.pp > 1 the last stage computes the loss: pass loss_fn= to setup "
                             "(a name such as 'causal_lm', or fn(output, target))")
        loss = infer_loss(model, sample)
    return loss


def skip_note(on_host: bool, device: torch.device) -> str:
    """What setup says of an optimizer that cannot skip a non-finite step on the device (no ``found_inf``)."""
    if on_host:
        where = "one read on the host per step" + (" (a wait for the GPU)" if device.type != "cpu" else "")
        return (f"optim.skip_nonfinite: this optimizer cannot skip a non-finite step on the device (no found_inf), so "
                f"each step decides on the host: {where}; a fused optimizer (AdamW(fused=True)) skips on the device")
    return ("optim.skip_nonfinite=auto: this optimizer cannot skip a non-finite step on the device (no found_inf); its "
            "updates are applied as in your own loop, and a non-finite gradient norm is reported at the next log step. "
            "Set optim.skip_nonfinite=true to skip them (one read on the host per step), or use a fused optimizer "
            "(AdamW(fused=True)), which skips on the device")
