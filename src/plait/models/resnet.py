"""A small ResNet for image classification: conv stem, residual ``BasicBlock``s with BatchNorm, pooled head.

The model knows nothing of parallelism. Its residual blocks sit in ``self.blocks``, an ``nn.ModuleList``,
so activation checkpointing and FSDP can wrap them from outside, and its BatchNorm layers are plain
``nn.BatchNorm2d`` that ``plait.nn.convert_sync_batchnorm`` can swap for synchronized ones.
"""

from __future__ import annotations

import torch
from torch import nn


def _conv3x3(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    # No bias: the BatchNorm right after a conv has its own shift.
    return nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus a shortcut, ReLU after the add.

    The shortcut is the identity when shape is kept, else a strided 1x1 conv + BN that matches the
    main path's channels and spatial size.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = _conv3x3(in_channels, out_channels, stride)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = _conv3x3(out_channels, out_channels)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(B, C_in, H, W)`` -> ``(B, C_out, H / stride, W / stride)`` (rounded up)."""
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A ResNet for small images (8x8 digits and up).

    Stem: conv3x3 (``in_channels`` -> ``width``) + BN + ReLU at full resolution. Then ``num_blocks``
    ``BasicBlock``s: the first ``num_blocks // 2`` keep width and spatial size; when ``num_blocks >= 2``
    block ``num_blocks // 2`` halves the spatial size (stride 2) and doubles the width, and the rest keep
    that. Head: global average pool -> optional dropout -> Linear to ``num_classes`` logits.

    ``forward`` takes ``(B, in_channels, H, W)`` float images and returns ``(B, num_classes)`` logits.
    Raises ValueError for non-positive sizes or a dropout outside [0, 1).
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1, width: int = 32, num_blocks: int = 4,
                 dropout: float = 0.0) -> None:
        super().__init__()
        for name, value in (("num_classes", num_classes), ("in_channels", in_channels), ("width", width),
                            ("num_blocks", num_blocks)):
            if value < 1:
                raise ValueError(f"ResNet {name} must be >= 1; got {value}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"ResNet dropout must be in [0, 1); got {dropout}")
        self.stem = nn.Sequential(_conv3x3(in_channels, width), nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        blocks: list[nn.Module] = []
        channels = width
        for i in range(num_blocks):
            downsample = num_blocks >= 2 and i == num_blocks // 2
            out_channels = channels * 2 if downsample else channels
            blocks.append(BasicBlock(channels, out_channels, stride=2 if downsample else 1))
            channels = out_channels
        self.blocks = nn.ModuleList(blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.head = nn.Linear(channels, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        # He init keeps activation variance steady through the ReLU stack; BN starts as the identity map.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(B, C, H, W)`` float images -> ``(B, num_classes)`` logits."""
        x = self.stem(x)  # (B, width, H, W)
        for block in self.blocks:
            x = block(x)  # (B, C', H', W')
        x = torch.flatten(self.pool(x), 1)  # (B, C')
        return self.head(self.dropout(x))  # (B, num_classes)
