"""scikit-learn's handwritten digits (1797 8x8 grey images, 10 classes) as torch datasets.

The images ship inside the scikit-learn package, so nothing is downloaded; scikit-learn itself is an
optional dependency (the ``vision`` extra) and is imported only when the data set is asked for.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

_MAX_PIXEL = 16.0  # the digits' grey levels are the integers 0..16


def load_digits_splits(test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Return ``(train, test)`` datasets of the digits, split deterministically by ``seed``.

    Contract: each item is ``(x, y)`` with ``x`` a float32 ``(1, 8, 8)`` image and ``y`` a 0-dim int64
    label, so the default collate gives ``(B, 1, 8, 8)`` and ``(B,)``. Pixels are scaled to [0, 1] and
    then standardised with one scalar mean and std measured on the train split only (the test split uses
    the same two numbers). The split is stratified: each class puts ``round(test_fraction * its count)``
    of its images, chosen by a ``torch.Generator`` seeded with ``seed``, in the test split, and both
    splits are in that shuffled order. The same arguments always give the same tensors.

    Raises ``plait.config.ConfigError`` if ``test_fraction`` is not in (0, 1), if it leaves a split
    empty, or if scikit-learn is not installed.
    """
    from plait.config import ConfigError

    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"digits test_fraction must be strictly between 0 and 1; got {test_fraction}")
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise ConfigError(
            "the digits data set needs scikit-learn; install it with: pip install 'plait[vision]' "
            "(or pip install scikit-learn)"
        ) from e

    bunch = load_digits()
    images = torch.as_tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / _MAX_PIXEL  # (N, 1, 8, 8)
    labels = torch.as_tensor(bunch.target, dtype=torch.int64)  # (N,)

    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))  # (N,)
    shuffled = labels[order]
    is_test = torch.zeros(len(labels), dtype=torch.bool)  # over positions in `order`
    for c in torch.unique(labels):
        positions = torch.nonzero(shuffled == c).flatten()
        is_test[positions[: round(test_fraction * len(positions))]] = True
    train_idx, test_idx = order[~is_test], order[is_test]
    if len(train_idx) == 0 or len(test_idx) == 0:
        raise ConfigError(f"digits test_fraction={test_fraction} leaves an empty split; use a value nearer 0.2")

    # Statistics from the train split only, so nothing about the test images leaks into training.
    std, mean = torch.std_mean(images[train_idx], correction=0)
    images = (images - mean) / std
    return (TensorDataset(images[train_idx], labels[train_idx]),
            TensorDataset(images[test_idx], labels[test_idx]))
