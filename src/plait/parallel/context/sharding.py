"""The load-balanced causal split of a sequence over the context-parallel ranks.

Under a causal mask the last tokens attend to the most keys: split in ``N`` contiguous pieces, the last rank
would do ``2N - 1`` times the first one's work. The sequence is cut into ``2N`` chunks instead and rank ``i``
holds chunks ``i`` and ``2N - 1 - i``: every rank gets one early and one late chunk, the same causal work.
"""

from __future__ import annotations

from typing import Any

import torch

from plait.config import ConfigError


class ContextError(ConfigError):
    """A batch or model that context parallelism cannot split; the message says what to change."""


def check_length(seq_len: int, cp: int, what: str = "the sequence length") -> None:
    """A clear error unless ``seq_len`` splits into ``2 x cp`` equal chunks (the load-balanced causal split)."""
    if seq_len % (2 * cp):
        fits = [n for n in range(1, seq_len // 2 + 1) if seq_len % (2 * n) == 0]
        raise ContextError(f"parallel.cp={cp} splits each sequence into 2 x cp = {2 * cp} equal chunks (two per rank, "
                           f"load-balanced for the causal mask), but {what} is {seq_len}; use a length that is a "
                           f"multiple of {2 * cp}, or parallel.cp in {fits[:8]}")


def shard_index(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The positions rank ``rank`` holds: chunks ``rank`` and ``2 cp - 1 - rank`` of ``2 cp`` (in order)."""
    check_length(seq_len, cp)
    c = seq_len // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])  # (T / cp,)


def shard(value: Any, index: torch.Tensor, seq_len: int) -> Any:
    """``value``'s positions ``index`` along dim 1 where it is a (B, T, ...) tensor of this sequence length;
    anything else as it is (a (B, 1, T, T) mask is refused by the caller)."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.size(1) == seq_len:
        return value.index_select(1, index.to(value.device))
    return value
