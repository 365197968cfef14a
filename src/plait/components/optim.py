"""AdamW with decoupled weight decay on matrices only, the warmup-then-cosine schedule, and how a user's
optimizer (a factory, or an instance without state) is rebuilt over the parameters a layout trains."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from plait.config import ConfigError, OptimConfig


class OptimizerError(ConfigError):
    """An optimizer plait cannot take; the message says what to pass instead."""


def param_groups(named_params: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """Matrices decay; biases, norms and embeddings do not. Each parameter appears once (the first
    name of a tied parameter decides, as in ``named_parameters()``)."""
    decay, no_decay, seen = [], [], set()
    for name, p in named_params:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        is_matrix = p.dim() >= 2 and "emb" not in name
        (decay if is_matrix else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def use_fused(cfg: OptimConfig, params: Iterable[torch.Tensor]) -> bool:
    """``optim.fused``, where "auto" means: fused when the parameters are on a GPU."""
    if isinstance(cfg.fused, bool):
        return cfg.fused
    return any(p.device.type == "cuda" for p in params)


def adamw_options(cfg: OptimConfig, fused: bool | None = None) -> dict:
    """AdamW keyword arguments from ``optim.*``: the fused kernel when ``fused`` (default: ``optim.fused`` is
    true), else torch's default, which is the plain per-parameter loop on the CPU (bit-repeatable across layouts)
    and the multi-tensor (foreach) kernels on a GPU (the per-parameter loop there launches ~10 kernels per
    parameter: on an H100 it took a 124M-parameter GPT's step from 40 to 69 ms, a host-bound step). The fused
    kernel also takes torch's ``found_inf``: a non-finite step is skipped on the device, the host reads nothing."""
    fused = cfg.fused is True if fused is None else fused
    kernel = {"fused": True} if fused else {}
    return {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), **kernel}


def adamw(named_params: Iterable[tuple[str, nn.Parameter]], cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over the named parameters (``param_groups`` decides weight decay by name), fused on a GPU
    (``use_fused``).

    The fused kernel takes a whole group at once and cannot mix DTensors with plain tensors (tensor
    parallelism leaves norms plain): fused, each group is split by kind."""
    groups = param_groups(named_params, cfg.weight_decay)
    fused = use_fused(cfg, (p for g in groups for p in g["params"]))
    if fused:
        from torch.distributed.tensor import DTensor

        groups = [{**g, "params": [p for p in g["params"] if isinstance(p, DTensor) == kind]}
                  for g in groups for kind in (False, True)]
        groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(groups, **adamw_options(cfg, fused))


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over ``model``'s trainable parameters."""
    return adamw(model.named_parameters(), cfg)


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then cosine to min_lr."""
    decay_steps = cfg.decay_steps or total_steps
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, decay_steps - cfg.warmup_steps))
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def materialize_optimizer_state(optimizer: torch.optim.Optimizer, keep_grads: bool = True) -> None:
    """Create the optimizer's state tensors (a step with zero gradients and lr 0) so DCP has
    destinations to load into; parameters do not change. With ``keep_grads`` existing gradient
    tensors are kept (zeroed, not dropped), because the data-parallel reducer's gradients are views
    into its buckets; otherwise every gradient is dropped afterwards."""
    if optimizer.state:
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs, strict=True):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=not keep_grads)


def single_names(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``named_parameters()`` under the single-process names (no activation-checkpointing wrapper level)."""
    return [(n.replace("_checkpoint_wrapped_module.", ""), p) for n, p in model.named_parameters()]


def optimizer_recipe(optimizer: torch.optim.Optimizer) -> tuple[type, dict[str, Any], list[dict[str, Any]]]:
    """(class, constructor arguments, groups with their hyperparameters) of a torch optimizer, to rebuild
    it over other tensors. ``defaults`` can hold entries the constructor does not take (AdamW's
    ``decoupled_weight_decay``): only those it takes are kept."""
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return cls, defaults, [dict(g) for g in optimizer.param_groups]


def optimizer_factory(model: nn.Module, optimizer: Any, cfg: OptimConfig) -> Callable[[nn.Module], Any]:
    """What ``Plait.setup`` builds the optimizer with, once the layout is applied: the user's factory
    ``fn(model)`` or ``fn(params)`` (see ``takes_params``; checked), an instance without state (rebuilt by
    parameter name), or plait's AdamW."""
    if optimizer is None:
        return lambda m: adamw(single_names(m), cfg)
    if isinstance(optimizer, torch.optim.Optimizer):
        if optimizer.state:
            raise OptimizerError("the optimizer passed to setup() already holds state (it has stepped); plait "
                                 "rebuilds it over the parallelized parameters and would lose that state. Pass a "
                                 "factory instead: optimizer=lambda model: torch.optim.AdamW(model.parameters(), ...)")
        return _rebuild_by_name(model, optimizer)
    if callable(optimizer):
        return _checked(optimizer)
    raise OptimizerError(f"optimizer must be a factory fn(model) or fn(params) -> torch.optim.Optimizer, an "
                         f"optimizer without state, or None; got {type(optimizer).__name__}")


# A factory's first parameter under one of these names gets the parameters, not the model (DeepSpeed's
# convention: ``optimizer=lambda params: AdamW(params)``).
PARAMS_NAMES = frozenset({"params", "parameters", "param_groups", "model_params", "model_parameters"})


def takes_params(factory: Callable[..., Any]) -> bool:
    """Whether ``factory`` is called with the model's trainable parameters rather than the model: its first
    parameter is named as in ``PARAMS_NAMES``, or annotated as an iterable (not a module). Anything else,
    and a callable without a signature, gets the model."""
    try:
        first = next(iter(inspect.signature(factory).parameters.values()), None)
    except (TypeError, ValueError):
        return False
    if first is None:
        return False
    if first.annotation is not inspect.Parameter.empty:
        note = first.annotation if isinstance(first.annotation, str) else str(first.annotation)
        if "Module" in note:
            return False
        if any(word in note for word in ("Iterable", "Parameter", "Tensor")):
            return True
    return first.name in PARAMS_NAMES


def _checked(factory: Callable[..., Any]) -> Callable[[nn.Module], Any]:
    """The user's factory, called with the model, or with its trainable parameters (a list) where
    ``takes_params`` says so; its result checked."""
    params = takes_params(factory)

    def build(model: nn.Module) -> Any:
        if params:
            opt = factory([p for p in model.parameters() if p.requires_grad])
        else:
            try:
                opt = factory(model)
            except TypeError as e:  # a factory over parameters under another name iterated the model
                raise OptimizerError(
                    f"the optimizer factory failed when called with the model ({type(e).__name__}: {e}); plait "
                    f"calls fn(model), or fn(params) with the trainable parameters when the factory's parameter "
                    f"is named params (lambda params: torch.optim.AdamW(params)) or annotated as an iterable"
                ) from e
        if not isinstance(opt, torch.optim.Optimizer):
            raise OptimizerError(f"the optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer")
        return opt
    return build


def _rebuild_by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[nn.Module], Any]:
    """A factory rebuilding ``optimizer`` (no state yet) over the parallelized model: same class,
    hyperparameters and groups, each parameter found again by its single-process name."""
    names = {id(p): n for n, p in single_names(model)}
    groups = []
    for g in optimizer.param_groups:
        if any(id(p) not in names for p in g["params"]):
            raise OptimizerError("the optimizer passed to setup() holds parameters that are not the model's; build "
                                 "it over model.parameters(), or pass a factory")
        groups.append(({k: v for k, v in g.items() if k != "params"}, [names[id(p)] for p in g["params"]]))
    cls, defaults, _ = optimizer_recipe(optimizer)

    def build(wrapped: nn.Module) -> Any:
        by_name: dict[str, list[nn.Parameter]] = {}
        for n, p in single_names(wrapped):
            by_name.setdefault(n, []).append(p)
        new_groups = [{**hp, "params": [p for n in ns for p in by_name.get(n, [])]} for hp, ns in groups]
        return cls([g for g in new_groups if g["params"]], **defaults)
    return build


def hyperparameters(optimizer: Any) -> list[dict[str, Any]] | None:
    """Each group's hyperparameters (lr, betas, ...), for a checkpoint."""
    if optimizer is None:
        return None
    keep = (int, float, bool, str, tuple, type(None))
    return [{k: v for k, v in g.items() if k != "params" and isinstance(v, keep)} for g in optimizer.param_groups]


def set_hyperparameters(optimizer: Any, saved: list[dict[str, Any]] | None) -> None:
    """The saved learning rate and other hyperparameters onto the optimizer's groups (as torch's
    ``Optimizer.load_state_dict`` restores them); skipped when the group count changed."""
    if optimizer is None or not saved or len(saved) != len(optimizer.param_groups):
        return
    for group, values in zip(optimizer.param_groups, saved, strict=True):
        group.update(values)
