"""Models and data sets by name: the registry ``plait train`` resolves ``model.name`` and ``data.name`` in.

Built in: the ``gpt`` model with the ``text`` data (plait's GPT on the embedded corpus, the default)
and the ``cnn`` model with the ``digits`` data (a ResNet-style classifier on scikit-learn's handwritten
digits). ``model.factory`` / ``data.factory`` name any ``package.module:function`` instead, called with
``[model.args]`` / ``[data.args]``. Third-party packages register models and data sets under the
``plait.models`` and ``plait.data`` entry-point groups (``name = "package.module:function"``), which
are called like factories.

A data factory returns the training set, a ``(train, eval)`` pair, or a dict with ``"train"`` and
``"eval"``; each a map-style data set (or a DataLoader, used as it is when its sampler is rank-aware).

A registered model may change plait's defaults for the runs that train it (``ModelRecipe.defaults``: the
``gpt`` and ``cnn`` recipes clip the gradient norm at 1.0, where plait's own default, for a user's loop, is
no clipping). ``load_recipe_config`` reads a config with them as a layer between plait's defaults and the
user's file and overrides, so a key the user sets keeps the user's value; ``plait train --help`` shows them.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plait.config import Config, ConfigError, load_config
from plait.recipes import cnn, gpt

if TYPE_CHECKING:  # the registry itself is data: what trains is imported where it is used (plait --help stays light)
    from torch import nn

    from plait.train.trainer import Trainer


@dataclass
class ModelRecipe:
    """A registered model: how to build it from the config, its default data set and loss, and the
    checks of its shape against the layout that can run before any worker starts."""

    build: Callable[[Config], nn.Module]
    data: str = ""
    loss: str = "auto"
    check: Callable[[Config, dict[str, int]], None] | None = None
    describe: str = ""
    # {section: {key: value}}: this model's defaults where they differ from plait's (see the module docstring)
    defaults: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class DataRecipe:
    """A registered data set: ``build(cfg)`` returns ``(train, eval or None)``."""

    build: Callable[[Config], tuple[Any, Any]]
    check: Callable[[Config], None] | None = None
    describe: str = ""


MODELS: dict[str, ModelRecipe] = {}
DATA: dict[str, DataRecipe] = {}


def register_model(name: str, recipe: ModelRecipe) -> None:
    MODELS[name] = recipe


def register_data(name: str, recipe: DataRecipe) -> None:
    DATA[name] = recipe


def _entry_points(group: str) -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=group)}


def _import_path() -> None:
    """Factories in the working directory import like ``python -m`` would find them."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)


def _call(fn: Callable, args: Mapping[str, Any], what: str) -> Any:
    """Call a user's factory with ``args``; its own error is shown, attributed to it."""
    import inspect

    try:
        inspect.signature(fn).bind(**args)
    except TypeError as e:
        raise ConfigError(f"{what} cannot be called with {dict(args)}: {e}") from None
    except ValueError:  # no signature to check (a builtin): let the call decide
        pass
    try:
        return fn(**args)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{what} raised {type(e).__name__}: {e}") from e


def model_recipe(cfg: Config) -> ModelRecipe | None:
    """The registered recipe behind ``model.name`` (None when ``model.factory`` is set)."""
    if cfg.model.factory:
        return None
    name = cfg.model.name
    if name in MODELS:
        return MODELS[name]
    eps = _entry_points("plait.models")
    if name in eps:
        ep = eps[name]
        return ModelRecipe(build=lambda c, ep=ep: _call(ep.load(), c.model.args, f"model.name={name} ({ep.value})"))
    known = sorted(set(MODELS) | set(eps))
    raise ConfigError(f"unknown model.name {name!r}; registered models: {', '.join(known)}; or set model.factory "
                      "to package.module:function")


def recipe_defaults(cfg: Config) -> dict[str, dict[str, Any]]:
    """The defaults of the model ``cfg`` names (none for ``model.factory`` or an entry-point model)."""
    recipe = model_recipe(cfg)
    return recipe.defaults if recipe is not None else {}


def load_recipe_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """``plait.config.load_config`` with the named model's defaults under the file and the overrides: the
    config ``plait train`` runs."""
    return load_config(path, overrides, defaults=recipe_defaults)


def defaults_by_key() -> dict[str, dict[str, Any]]:
    """``{"section.key": {"recipe gpt": value, ...}}``: the registered models' own defaults, for ``--help``."""
    out: dict[str, dict[str, Any]] = {}
    for name, recipe in MODELS.items():
        for section, values in recipe.defaults.items():
            for key, value in values.items():
                out.setdefault(f"{section}.{key}", {})[f"recipe {name}"] = value
    return out


def build_model(cfg: Config) -> nn.Module:
    """The model named by ``model.factory`` or ``model.name``."""
    from torch import nn

    from plait.components.losses import import_object

    recipe = model_recipe(cfg)
    if recipe is not None:
        model = recipe.build(cfg)
        what = f"model.name={cfg.model.name}"
    else:
        _import_path()
        fn = import_object(cfg.model.factory, "model.factory")
        what = f"model.factory={cfg.model.factory}"
        model = _call(fn, cfg.model.args, what)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{what} returned {type(model).__name__}, not a torch.nn.Module")
    from plait.data.tokenize import check_model_vocab

    check_model_vocab(model, cfg)  # a factory's model against data.tokenizer (the GPT's is model.vocab_size)
    return model


def data_name(cfg: Config) -> str:
    """``data.name``, or the model's own data set when it is empty."""
    if cfg.data.name:
        return cfg.data.name
    recipe = model_recipe(cfg)
    if recipe is None or not recipe.data:
        raise ConfigError("this model has no default data set: set data.name (text, digits) or data.factory")
    return recipe.data


def build_data(cfg: Config) -> tuple[Any, Any]:
    """``(train, eval or None)`` from ``data.factory`` or the registered data set."""
    from plait.components.losses import import_object

    if cfg.data.factory:
        _import_path()
        what = f"data.factory={cfg.data.factory}"
        out = _call(import_object(cfg.data.factory, "data.factory"), cfg.data.args, what)
    else:
        name = data_name(cfg)
        if name in DATA:
            return DATA[name].build(cfg)
        eps = _entry_points("plait.data")
        if name not in eps:
            raise ConfigError(f"unknown data.name {name!r}; registered data sets: "
                              f"{', '.join(sorted(set(DATA) | set(eps)))}; or set data.factory")
        what = f"data.name={name} ({eps[name].value})"
        out = _call(eps[name].load(), cfg.data.args, what)
    if isinstance(out, Mapping):
        if "train" not in out:
            raise ConfigError(f"{what} returned a dict without 'train'")
        return out["train"], out.get("eval")
    if isinstance(out, tuple):
        if len(out) != 2:
            raise ConfigError(f"{what} returned a tuple of {len(out)}; return train or (train, eval)")
        return out
    return out, None


def default_loss(cfg: Config) -> str:
    """``train.loss``, with ``auto`` resolved to the registered model's loss where it has one."""
    if cfg.train.loss != "auto":
        return cfg.train.loss
    recipe = model_recipe(cfg)
    return recipe.loss if recipe is not None else "auto"


def check_model(cfg: Config, degrees: dict[str, int]) -> None:
    """The registered model's own check of its shape against the layout (no data set, no factory import):
    what the simulator and planner need."""
    recipe = model_recipe(cfg)
    if recipe is not None and recipe.check is not None:
        recipe.check(cfg, degrees)


def check_recipe(cfg: Config, degrees: dict[str, int]) -> None:
    """The registered model's and data set's own checks (shape against layout, files), before launch."""
    from plait.components.losses import import_object

    for ref, what in ((cfg.model.factory, "model.factory"), (cfg.data.factory, "data.factory")):
        if ref:  # importable now, before any worker starts (it is called in the workers)
            _import_path()
            import_object(ref, what)
    recipe = model_recipe(cfg)
    if recipe is not None and recipe.check is not None:
        recipe.check(cfg, degrees)
    if cfg.model.weights:
        check_weights(cfg)
    if not cfg.data.factory:
        name = data_name(cfg)
        if name in DATA and DATA[name].check is not None:
            DATA[name].check(cfg)


# The recipes keep the gradient clipping their other defaults were tuned with (a user's own loop gets none
# unless it asks: optim.grad_clip defaults to 0), and skip a step whose gradient is not finite (plait's loop: a read
# of one flag per step where the optimizer cannot skip on the device, which a user's own loop does not pay unless
# it asks: optim.skip_nonfinite defaults to auto).
CLIPPED = {"optim": {"grad_clip": 1.0, "skip_nonfinite": True}}
register_model("gpt", ModelRecipe(build=gpt.build_model, data="text", loss="causal_lm", check=gpt.check_model,
                                  describe="plait's GPT (pre-LayerNorm decoder, tied embeddings)", defaults=CLIPPED))
register_data("text", DataRecipe(build=gpt.build_text, check=gpt.check_text,
                                 describe="a token corpus in model.seq_len windows (embedded by default)"))
register_model("cnn", ModelRecipe(build=cnn.build_model, data="digits", loss="classification",
                                  describe="a ResNet-style CNN with BatchNorm", defaults=CLIPPED))
register_data("digits", DataRecipe(build=cnn.build_digits, describe="scikit-learn's 8x8 handwritten digits"))


def check_weights(cfg: Config) -> None:
    """``model.weights`` against the model the config names, before any worker starts: the model is built on the
    meta device (shapes only) and the checkpoint's headers are read (``plait.checkpoint.weights.check_weights``)."""
    import torch  # lazily, as every training import here: plait --help imports no torch

    from plait.checkpoint.weights import check_weights as check

    with torch.device("meta"):
        model = build_model(cfg)
    check(model, cfg.model.weights)


def validate_config(cfg: Config, world_size: int, *, model_checks: bool = True) -> Config:
    """``plait.validate.validate`` with the registered model's and data set's own checks (``check_recipe``);
    ``model_checks=False`` leaves them out (a model passed to ``Plait.setup`` rather than named in the config)."""
    from plait.validate import validate

    return validate(cfg, world_size, check_recipe if model_checks else None)


def build_trainer(cfg: Config, trainer_class: type[Trainer] | None = None) -> Trainer:
    """A ``Trainer`` (or the ``trainer_class`` subclass given) on the model and data the config names
    (``model.name`` / ``model.factory``, ``data.*``), seeded by ``train.seed`` so every rank builds the same
    weights."""
    import torch

    from plait.engine import Plait
    from plait.train.trainer import Trainer

    trainer_class = trainer_class or Trainer
    p = Plait(cfg)
    torch.manual_seed(cfg.train.seed)
    weights = cfg.model.weights or None
    with torch.device("meta") if weights else contextlib.nullcontext():  # weights: each rank reads its part
        model = build_model(cfg)
    train_data, held_out = build_data(cfg)
    if hasattr(train_data, "source"):
        p.logger.info("data: %s, %s training samples", train_data.source,
                      len(train_data) if hasattr(train_data, "__len__") else "streamed")
    return trainer_class(model, train_data, loss_fn=default_loss(cfg), eval_data=held_out, plait=p, weights=weights)


def train(cfg: Config, run_dir: Path, resume: bool = False) -> dict[str, Any]:
    """``plait train`` on this worker: the configured model and data through ``Trainer`` (the process
    group, if any, is already initialised)."""
    from plait.parallel.errors import RankDone

    cfg.run.dir = str(run_dir)
    try:
        trainer = build_trainer(cfg)
    except RankDone as e:  # a rank whose part ended in setup (a parameter server's, once every worker finished)
        return {e.key: e.stats}
    try:
        if resume:
            trainer.resume()
        return trainer.fit()
    finally:
        trainer.p.watchdog.close()
