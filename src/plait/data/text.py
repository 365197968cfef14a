"""Token streams as map-style data sets of fixed-length windows, for any loader.

``TokenWindows`` cuts a 1-D token stream into windows of ``seq_len + 1`` tokens and returns each as
``(x, y)``: ``x`` its first ``seq_len`` tokens, ``y`` the next token of each (the window shifted by
one). With ``epoch_offsets`` every epoch starts its windows at another offset in ``[0, seq_len)``,
drawn from the seed and the epoch alone (``set_epoch``, which plait's loader calls), so successive
epochs see the text cut at different places; the number of windows stays the same.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class EpochWindows(Dataset):
    """Windows whose start moves each epoch (``epoch_offsets``): ``set_epoch`` draws the offset in
    ``[0, seq_len)`` from the seed and the epoch alone. Subclasses set ``num_windows``, ``seq_len``, ``seed``,
    ``epoch_offsets`` and ``offset``."""

    num_windows: int
    seq_len: int
    seed: int
    epoch_offsets: bool
    offset: int

    def set_epoch(self, epoch: int) -> None:
        if self.epoch_offsets:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self.offset = int(torch.randint(self.seq_len, (1,), generator=g))

    def __len__(self) -> int:
        return self.num_windows


class TokenWindows(EpochWindows):
    """``(x, y)`` pairs of ``(seq_len,)`` int64 tokens cut from ``tokens``. Every target is a real token (no
    ``-100``): ``targets_per_sample`` says so, and a token-weighted loss's divisor is known without counting."""

    @property
    def targets_per_sample(self) -> int:
        """The targets of every sample that a causal-LM loss counts: all ``seq_len`` of them."""
        return self.seq_len

    def __init__(self, tokens: torch.Tensor, seq_len: int, *, epoch_offsets: bool = False, seed: int = 0,
                 limit: int | None = None) -> None:
        self.tokens, self.seq_len, self.seed, self.epoch_offsets = tokens, seq_len, seed, epoch_offsets
        # With offsets, every offset in [0, seq_len) must still leave this many whole windows.
        n = (len(tokens) - seq_len) // seq_len if epoch_offsets else (len(tokens) - 1) // seq_len
        self.num_windows = min(n, limit) if limit is not None else n
        self.offset = 0


    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.num_windows:
            raise IndexError(i)
        start = self.offset + i * self.seq_len
        w = self.tokens[start: start + self.seq_len + 1]
        return w[:-1], w[1:]
