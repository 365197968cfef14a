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


def padding_docs(mask: Any, docs: torch.Tensor | None, seq_len: int) -> torch.Tensor:
    """A padding ``attention_mask`` (B, T), nonzero where a token counts, as the document ids the cp attention masks
    by: real tokens keep their document (``docs``; one document without), each padding token is its own (a
    negative id no real document has), so no query sees a padding key but itself: real tokens' outputs are those
    of the model's own key-padding mask, and a padding query sees one key (finite, unlike a fully masked row)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.size(1) != seq_len:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ContextError(f"parallel.cp > 1 takes a padding attention_mask of shape (batch, {seq_len}), 1 where a "
                           f"token counts, but got {shape} (a 4-D mask of packed documents or a custom pattern cannot "
                           "be split into shards); pass a (batch, sequence) padding mask, or use parallel.cp=1")
    own = -torch.arange(1, seq_len + 1, device=mask.device).expand(mask.size(0), -1)  # (B, T)
    real = docs.to(mask.device) if docs is not None else torch.zeros_like(own)
    return torch.where(mask.bool(), real, own)
