"""plait: distributed training on PyTorch, one typed config for the whole layout.

``plait.Plait`` is the keep-your-loop API, ``plait.Trainer`` plait's loop on top of it; the config
sections are ``plait.Config`` and its dataclasses; loss functions are in ``plait.losses``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from plait.components import losses
    from plait.config import Config, ConfigError, load_config
    from plait.engine import Plait, StepInfo
    from plait.parallel.errors import PlaitError
    from plait.parallel.model_specs import register_train_spec
    from plait.parallel.train_spec import TrainSpec
    from plait.train.trainer import Trainer

_EXPORTS = {
    "Config": ("plait.config", "Config"), "ConfigError": ("plait.config", "ConfigError"),
    "load_config": ("plait.config", "load_config"), "Plait": ("plait.engine", "Plait"),
    "StepInfo": ("plait.engine", "StepInfo"), "Trainer": ("plait.train.trainer", "Trainer"),
    "losses": ("plait.components.losses", None),
    "register_train_spec": ("plait.parallel.model_specs", "register_train_spec"),
    "TrainSpec": ("plait.parallel.train_spec", "TrainSpec"),
    "PlaitError": ("plait.parallel.errors", "PlaitError"),
}
__all__ = ["Config", "ConfigError", "Plait", "PlaitError", "StepInfo", "TrainSpec", "Trainer", "load_config", "losses",
           "register_train_spec"]


def __getattr__(name: str) -> Any:
    """Imported on first use, so ``import plait`` stays light (the CLI parses arguments before torch)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'plait' has no attribute {name!r}")
    import importlib

    module, attr = _EXPORTS[name]
    value = importlib.import_module(module)
    return getattr(value, attr) if attr else value
