"""The ``cnn`` recipe: a ResNet-style classifier (BatchNorm included) on scikit-learn's handwritten digits.

Model ``cnn``: ``plait.models.resnet.ResNet`` with ``[model.args]`` (``width``, ``num_blocks``,
``num_classes``, ``in_channels``) and ``model.dropout`` before the classifier; loss
``classification``; data ``digits``: the 1,797 8x8 images scikit-learn ships inside its package
(``pip install 'plait[vision]'``), a fixed 80/20 split, the held-out fifth as the evaluation set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from plait.config import Config, ConfigError

if TYPE_CHECKING:
    from torch import nn


def build_model(cfg: Config) -> nn.Module:
    from plait.models.resnet import ResNet

    args = {"num_classes": 10, "in_channels": 1, "width": 32, "num_blocks": 4, **cfg.model.args}
    try:
        return ResNet(**args, dropout=cfg.model.dropout)
    except TypeError as e:
        raise ConfigError(f"model.name=cnn: [model.args] {cfg.model.args} do not fit ResNet ({e}); it takes width, "
                          "num_blocks, num_classes and in_channels") from None


def build_digits(cfg: Config) -> tuple[Any, Any]:
    from plait.data.digits import load_digits_splits

    return load_digits_splits(**{"test_fraction": 0.2, "seed": 0, **cfg.data.args})
