"""A deterministic, resumable sampler over fixed-length windows of a token stream.

Every epoch cuts the stream into windows of ``seq_len + 1`` tokens at an epoch-specific offset and
shuffles their order, both from ``seed`` and the epoch number alone. Global batch ``k`` of an epoch
is the slice ``[k * G, (k + 1) * G)`` of that order; data-parallel rank ``r`` takes the ``r``-th
contiguous share of it and splits its share into accumulation micro-batches. So the data a global
step sees does not depend on the number of ranks (a 2-rank run and a 1-process run train on the same
sequences), ranks never overlap, and the whole position is one integer: global batches consumed.
"""

from __future__ import annotations

import torch


class WindowSampler:
    """Yields this rank's micro-batches of (inputs, targets), each (micro_batch_size, seq_len) int64."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, seed: int) -> None:
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError("global_batch_size must divide by micro_batch_size * dp_size")
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        # Windows per epoch, chosen so every epoch offset in [0, seq_len) still fits.
        self.windows_per_epoch = (len(tokens) - seq_len) // seq_len
        self.batches_per_epoch = self.windows_per_epoch // global_batch_size
        if self.batches_per_epoch < 1:
            raise ValueError(
                f"the training split holds {self.windows_per_epoch} windows of {seq_len + 1} tokens, fewer "
                f"than one global batch of {global_batch_size}; lower train.global_batch_size or use more data"
            )
        self.consumed = 0  # global batches consumed so far: the sampler's whole state
        self._epoch_cache: tuple[int, int, torch.Tensor] | None = None

    def _epoch(self, epoch: int) -> tuple[int, torch.Tensor]:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            offset = int(torch.randint(self.seq_len, (1,), generator=g))
            order = torch.randperm(self.windows_per_epoch, generator=g)
            self._epoch_cache = (epoch, offset, order)
        return self._epoch_cache[1], self._epoch_cache[2]

    def rank_indices(self, batch: int) -> torch.Tensor:
        """Window starts (token offsets) of this rank's share of global batch number ``batch``."""
        epoch, k = divmod(batch, self.batches_per_epoch)
        offset, order = self._epoch(epoch)
        share = self.global_batch_size // self.dp_size
        lo = k * self.global_batch_size + self.dp_rank * share
        return offset + order[lo: lo + share] * self.seq_len

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches for the next optimizer step; advances the position."""
        starts = self.rank_indices(self.consumed)
        self.consumed += 1
        ar = torch.arange(self.seq_len + 1)
        windows = self.tokens[starts[:, None] + ar[None, :]]  # (share, T + 1)
        micro = windows.split(self.micro_batch_size)
        return [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in micro]

    def peek(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The next step's micro-batches without advancing (e.g. to profile layer costs)."""
        batches = self.next_batch()
        self.consumed -= 1
        return batches

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed, "seed": self.seed, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seed"] != self.seed or state["global_batch_size"] != self.global_batch_size:
            raise ValueError(
                "the checkpoint's data order was made with train.seed="
                f"{state['seed']} and train.global_batch_size={state['global_batch_size']}; resume with "
                "those values to continue the same data order"
            )
        self.consumed = int(state["consumed"])


def validation_batches(tokens: torch.Tensor, seq_len: int, micro_batch_size: int, num_sequences: int,
                       dp_rank: int, dp_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed validation set: the first ``num_sequences`` windows of the split (the same set whatever
    the layout, so validation losses compare across runs), cut into micro-batches dealt round-robin
    to the data-parallel ranks."""
    n_windows = (len(tokens) - 1) // seq_len
    starts = torch.arange(min(num_sequences, n_windows)) * seq_len
    ar = torch.arange(seq_len + 1)
    out = []
    for i, chunk in enumerate(starts.split(micro_batch_size)):
        if i % dp_size == dp_rank:
            w = tokens[chunk[:, None] + ar[None, :]]  # (b, T + 1)
            out.append((w[:, :-1].contiguous(), w[:, 1:].contiguous()))
    return out
