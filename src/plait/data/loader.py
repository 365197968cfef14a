"""A deterministic, resumable distributed data loader over a user's map-style dataset.

Two styles of epoch, chosen by ``drop_last``:

* train style (``drop_last=True``): the epoch's order is cut into whole global batches of
  ``G = batch_size * dp_size * accumulation`` samples (the tail that does not fill one is dropped).
  Global batch ``k`` is ``order[k * G:(k + 1) * G]``; data-parallel rank ``r`` takes the ``r``-th
  contiguous share of it and yields it as ``accumulation`` micro-batches of ``batch_size``. The order
  depends on ``(seed, epoch)`` alone, so the samples behind each optimizer step do not depend on how
  the global batch is split (a 2-rank run and a 1-process run with the same global batch train on the
  same samples), ranks never overlap, and an epoch visits each sample at most once.
* eval style (``drop_last=False``): ``accumulation`` is ignored (treated as 1) and only the first
  ``floor(N / dp_size) * dp_size`` samples of the order are used (at most ``dp_size - 1`` dropped), cut
  into global batches of ``batch_size * dp_size`` with a final shorter one of ``m * dp_size``. Every
  rank so gets the same number of micro-batches of the same sizes: collectives inside an evaluation
  forward (FSDP all-gathers, tensor-parallel reductions) would hang if one rank ran out first.

``shuffle`` is independent of the style: the order is a permutation of ``range(N)`` when set, else
``range(N)`` itself. The loader's whole position is ``(epoch, position)``, with ``position`` counting
micro-batches of the epoch already handed to the caller, and it is the same on every rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from plait.config import ConfigError

# Set by the loader itself; a user's value would silently break the rank sharding or the resume.
# (batch_size, shuffle and drop_last are DistributedLoader's own parameters, so they never land here.)
_OWNED_KWARGS = ("sampler", "batch_sampler")
# Fields a resume must keep: they define which samples make up each global batch.
_ORDER_FIELDS = ("seed", "num_samples", "global_batch_size", "shuffle", "drop_last")
_LAYOUT_FIELDS = ("batch_size", "dp_size", "accumulation")


def _derive_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts``: stable across processes and Python runs (``hash`` is salted), and
    free of the collisions of arithmetic mixes such as ``seed * K + epoch``."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class DistributedBatchSampler(Sampler[list[int]]):
    """Index batches of one epoch for one data-parallel rank.

    ``batches(epoch)`` is a pure function of the constructor arguments and ``epoch``. Iterating the
    sampler yields ``batches(self.epoch)``; call ``set_epoch`` between epochs, as with torch's
    ``DistributedSampler``, when using it directly as a DataLoader's ``batch_sampler``.
    """

    def __init__(self, num_samples: int, batch_size: int, *, dp_rank: int, dp_size: int, accumulation: int = 1,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = True) -> None:
        super().__init__()
        if batch_size < 1 or accumulation < 1:
            raise ConfigError(f"batch_size ({batch_size}) and accumulation ({accumulation}) must be at least 1; "
                              "check train.micro_batch_size and train.global_batch_size")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not a rank of a data-parallel group of {dp_size}")
        self.num_samples = int(num_samples)
        self.batch_size = int(batch_size)
        self.dp_rank = int(dp_rank)
        self.dp_size = int(dp_size)
        self.drop_last = bool(drop_last)
        self.accumulation = int(accumulation) if self.drop_last else 1  # eval style has no optimizer step
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.global_batch_size = self.batch_size * self.dp_size * self.accumulation
        self.epoch = 0
        self._cache: tuple[int, torch.Tensor, torch.Tensor | None] | None = None
        if self.drop_last and self.num_samples // self.global_batch_size == 0:
            raise ConfigError(
                f"the dataset holds {self.num_samples} samples, fewer than one global batch of "
                f"{self.global_batch_size} (batch_size x dp x accumulation = {self.batch_size} x {self.dp_size} "
                f"x {self.accumulation}); lower train.global_batch_size or train.micro_batch_size, or use more data"
            )
        if not self.drop_last and self.num_samples < self.dp_size:
            raise ConfigError(
                f"the dataset holds {self.num_samples} samples, fewer than the {self.dp_size} data-parallel "
                "ranks, so some rank would get no batch; use more data or fewer data-parallel ranks"
            )

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch that ``iter(self)`` yields."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        """Micro-batches per epoch for this rank (the same on every rank)."""
        if self.drop_last:
            return self.num_samples // self.global_batch_size * self.accumulation
        used = self.num_samples // self.dp_size * self.dp_size
        full, rest = divmod(used, self.batch_size * self.dp_size)
        return full + (rest > 0)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches(self.epoch))

    def batches(self, epoch: int) -> list[list[int]]:
        """This rank's micro-batches (lists of dataset indices) of ``epoch``, in order."""
        full, tail = self.rank_batches(epoch)
        rows = [m.tolist() for m in full] if isinstance(full, list) else full.tolist()
        return rows + ([tail.tolist()] if tail is not None else [])

    def rank_batches(self, epoch: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``batches(epoch)`` as tensors, cheaper for large data: the micro-batches of ``batch_size`` as
        one ``(n, batch_size)`` int64 tensor, and the eval-style final shorter micro-batch (or None)."""
        if self._cache is None or self._cache[0] != epoch:
            self._cache = (epoch, *self._split(self._order(epoch)))
        return self._cache[1], self._cache[2]

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        # Seeded from (seed, epoch) only, never from the layout: that is what makes each global batch's
        # samples independent of dp_size and accumulation.
        generator = torch.Generator().manual_seed(_derive_seed("order", self.seed, epoch))
        return torch.randperm(self.num_samples, generator=generator)

    def set_shares(self, shares: list[int] | None) -> None:
        """Uneven shares of each global batch (train style): rank r takes ``shares[r]`` samples, split into
        ``accumulation`` micro-batches differing by at most one sample; None restores equal shares. Every
        rank must set the same shares (they still partition each global batch, so the samples of a step
        do not change)."""
        if shares is not None:
            if not self.drop_last or len(shares) != self.dp_size or sum(shares) != self.global_batch_size \
                    or min(shares) < self.accumulation:
                raise ValueError(f"shares {shares} must give each of {self.dp_size} ranks at least {self.accumulation} "
                                 f"samples and sum to the global batch {self.global_batch_size}")
            shares = [int(x) for x in shares]
        self.shares = shares
        self._cache = None

    def _split(self, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, dp, r = self.batch_size, self.dp_size, self.dp_rank
        if self.drop_last and getattr(self, "shares", None) is not None:
            num_global = self.num_samples // self.global_batch_size
            start, n = sum(self.shares[:r]), self.shares[r]
            rows = order[: num_global * self.global_batch_size].view(num_global, self.global_batch_size)
            mine = rows[:, start:start + n]  # (num_global, n)
            return [m for row in mine for m in torch.tensor_split(row, self.accumulation)], None
        if self.drop_last:
            num_global = self.num_samples // self.global_batch_size
            shares = order[: num_global * self.global_batch_size].view(num_global, dp, self.accumulation, b)
            return shares[:, r].reshape(num_global * self.accumulation, b), None  # (n, B)
        used = order[: self.num_samples // dp * dp]
        num_full = len(used) // (b * dp)
        full = used[: num_full * b * dp].view(num_full, dp, b)[:, r].contiguous()  # (n, B)
        rest = used[num_full * b * dp:]
        tail = rest.view(dp, len(rest) // dp)[r].contiguous() if len(rest) else None
        return full, tail


class _RemainingBatches(Sampler[list[int]]):
    """One epoch's micro-batches from ``start`` on, turned into index lists lazily (an epoch of a large
    dataset as Python lists would cost far more memory than the index tensor)."""

    def __init__(self, full: torch.Tensor, tail: torch.Tensor | None, start: int) -> None:
        super().__init__()
        self.full, self.tail, self.start = full, tail, start

    def __len__(self) -> int:
        return len(self.full) + (self.tail is not None) - self.start

    def __iter__(self) -> Iterator[list[int]]:
        for i in range(self.start, len(self.full)):
            yield self.full[i].tolist()
        if self.tail is not None and self.start <= len(self.full):
            yield self.tail.tolist()


class DistributedLoader:
    """Iterable over this rank's micro-batches; resumable mid-epoch.

    Each ``iter()`` yields the rest of the current epoch through a fresh torch DataLoader (workers, pin
    memory and other ``dataloader_kwargs`` pass through). Once an epoch is exhausted, the next
    ``iter()`` starts the following one, so both ``for epoch ...: for batch in loader`` and a step loop
    that calls ``iter()`` again on ``StopIteration`` work. ``position`` counts micro-batches yielded to
    the caller, not those prefetched by workers, so ``state_dict()`` is exact with any ``num_workers``.
    Use one iterator at a time: they share the position.
    """

    def __init__(self, dataset: Any, batch_size: int, *, dp_rank: int, dp_size: int, accumulation: int = 1,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = True,
                 collate_fn: Callable[[list[Any]], Any] | None = None, **dataloader_kwargs: Any) -> None:
        owned = sorted(set(dataloader_kwargs) & set(_OWNED_KWARGS))
        if owned:
            raise ConfigError(f"{', '.join(owned)} cannot be passed to plait's data loader: plait sets them from "
                              "train.micro_batch_size and the data-parallel layout; remove them")
        try:
            num_samples = len(dataset)
        except TypeError:
            raise ConfigError(
                f"plait's data loader needs a map-style dataset with __len__ and __getitem__, got "
                f"{type(dataset).__name__}; shard an iterable dataset by rank yourself and pass a DataLoader"
            ) from None
        self.dataset = dataset
        self.sampler = DistributedBatchSampler(num_samples, batch_size, dp_rank=dp_rank, dp_size=dp_size,
                                               accumulation=accumulation, seed=seed, shuffle=shuffle,
                                               drop_last=drop_last)
        self.collate_fn = collate_fn
        self.dataloader_kwargs = dataloader_kwargs
        self.epoch = 0
        self.position = 0
        self.skipped: list[list[int]] = []  # [epoch, first global batch, count] per window skip() left out

    def __len__(self) -> int:
        """Micro-batches per epoch on this rank."""
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        if self.position >= len(self.sampler):
            self.epoch, self.position = self.epoch + 1, 0
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch)
        full, tail = self.sampler.rank_batches(self.epoch)
        kwargs = dict(self.dataloader_kwargs)
        # Worker seeds come from this generator; without one torch draws them from the global RNG,
        # which would make workers' randomness vary between runs and shift the training RNG stream.
        kwargs.setdefault("generator", torch.Generator().manual_seed(_derive_seed("workers", self.sampler.seed,
                                                                                  self.epoch)))
        loader = DataLoader(self.dataset, batch_sampler=_RemainingBatches(full, tail, self.position),
                            collate_fn=self.collate_fn, **kwargs)
        for batch in loader:
            # Counted before the yield: a state_dict taken while the caller holds this batch includes it.
            self.position += 1
            yield batch

    def set_shares(self, shares: list[int] | None) -> None:
        """Uneven shares of each global batch (``DistributedBatchSampler.set_shares``); takes effect at the
        next ``iter()``."""
        self.sampler.set_shares(shares)

    def advance(self, micro_batches: int) -> None:
        """Skip this rank's next ``micro_batches`` without loading them, across epochs: a data window left
        out (the batches before a loss spike). Every rank skips the same number of global batches."""
        while micro_batches > 0:
            if self.position >= len(self.sampler):
                self.epoch, self.position = self.epoch + 1, 0
            step = min(micro_batches, len(self.sampler) - self.position)
            self.position += step
            micro_batches -= step

    def skip(self, global_batches: int) -> list[int]:
        """Leave out the next ``global_batches`` global batches (a loss spike's window) and return the data set
        indices of their samples, every rank's share, in order. Recorded in ``skipped`` (``[epoch, first global
        batch, count]`` per window, in the loader's state and so in checkpoints). Train style only."""
        if not self.sampler.drop_last:
            raise ValueError("skip() leaves out whole global batches; an eval-style loader has none")
        acc, per_epoch = self.sampler.accumulation, len(self.sampler) // self.sampler.accumulation
        g, ids = self.sampler.global_batch_size, []
        while global_batches > 0:
            if self.position >= len(self.sampler):
                self.epoch, self.position = self.epoch + 1, 0
            first = self.position // acc
            count = min(global_batches, per_epoch - first)
            ids += self.sampler._order(self.epoch)[first * g:(first + count) * g].tolist()
            self.skipped.append([self.epoch, first, count])
            self.position += count * acc
            global_batches -= count
        return ids

    def skipped_samples(self) -> list[int]:
        """The data set indices of every sample ``skip`` left out so far (from the recorded windows)."""
        g = self.sampler.global_batch_size
        return [i for epoch, first, count in self.skipped
                for i in self.sampler._order(epoch)[first * g:(first + count) * g].tolist()]

    def state_dict(self) -> dict[str, Any]:
        """The position and the settings that define the data order, as plain ints, and the windows ``skip``
        left out as a list of ints (safe for ``torch.load(weights_only=True)``). Identical on every rank, so
        saving one rank's suffices."""
        s = self.sampler
        return {"epoch": self.epoch, "position": self.position, "seed": s.seed, "num_samples": s.num_samples,
                "global_batch_size": s.global_batch_size, "batch_size": s.batch_size, "dp_size": s.dp_size,
                "accumulation": s.accumulation, "shuffle": int(s.shuffle), "drop_last": int(s.drop_last),
                "skipped": [x for window in self.skipped for x in window]}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue where ``state`` left off: the next micro-batches are those an uninterrupted run would
        have yielded next. The order settings (seed, dataset size, global batch, shuffle, drop_last) must
        match. A different split of the same global batch (another dp_size, batch_size or accumulation:
        an elastic resume) is accepted at an optimizer-step boundary, the position converted."""
        missing = [k for k in ("epoch", "position", *_ORDER_FIELDS, *_LAYOUT_FIELDS) if k not in state]
        if missing:
            raise ConfigError(f"the data loader state lacks {', '.join(missing)}; it was not saved by plait's "
                              "DistributedLoader.state_dict, so load a checkpoint written by plait")
        mine = self.state_dict()
        differ = [k for k in _ORDER_FIELDS if int(state[k]) != mine[k]]
        if differ:
            raise ConfigError(
                f"the checkpoint's data order was made with train.seed={state['seed']} and global batch "
                f"{state['global_batch_size']} over {state['num_samples']} samples (shuffle={bool(state['shuffle'])}, "
                f"drop_last={bool(state['drop_last'])}), but {', '.join(differ)} differ here; resume with those "
                "values and the same dataset, or start a fresh run"
            )
        self.epoch = int(state["epoch"])
        self.position = self._convert_position(state)
        flat = [int(x) for x in state.get("skipped", [])]
        self.skipped = [flat[i:i + 3] for i in range(0, len(flat), 3)]

    def _convert_position(self, state: dict[str, int]) -> int:
        position = int(state["position"])
        if any(int(state[k]) != getattr(self.sampler, k) for k in _LAYOUT_FIELDS):
            position = self._position_at_new_layout(state, position)
        if not 0 <= position <= len(self.sampler):
            raise ConfigError(f"the data loader state's position {state['position']} lies outside an epoch of "
                              f"{len(self.sampler)} micro-batches; the checkpoint is corrupt or from another run")
        return position

    def _position_at_new_layout(self, state: dict[str, int], position: int) -> int:
        if not self.sampler.drop_last:
            # Eval style consumes one global batch (the same samples at any split) per micro-batch; only the
            # tail of at most dp_size - 1 dropped samples depends on dp_size, so an exhausted epoch stays so.
            old = DistributedBatchSampler(self.sampler.num_samples, int(state["batch_size"]), dp_rank=0,
                                          dp_size=int(state["dp_size"]), shuffle=self.sampler.shuffle,
                                          drop_last=False)
            return len(self.sampler) if position == len(old) else position
        old_accumulation = int(state["accumulation"])
        if position % old_accumulation:
            raise ConfigError(
                f"the checkpoint stopped {position % old_accumulation} micro-batches into an optimizer step "
                f"(accumulation {old_accumulation}); a resume at another world size or micro-batch size must "
                "start at an optimizer-step boundary: resume with the checkpoint's layout (data-parallel "
                f"size {state['dp_size']}, micro-batch size {state['batch_size']}) or from a checkpoint saved "
                "after an optimizer step"
            )
        return position // old_accumulation * self.sampler.accumulation


def is_rank_aware(loader: Any) -> bool:
    """True when ``loader`` already shards its data by rank, so plait must not wrap it again: a
    DistributedLoader, or a DataLoader whose sampler (or its batch_sampler, or that batch_sampler's
    inner sampler) has ``num_replicas`` and ``rank`` (torch's DistributedSampler and look-alikes) or is
    a DistributedBatchSampler. Anything else, e.g. a plain shuffling DataLoader, is False."""
    if isinstance(loader, DistributedLoader):
        return True
    batch_sampler = getattr(loader, "batch_sampler", None)
    candidates = (getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None))
    return any(isinstance(s, DistributedBatchSampler) or (hasattr(s, "num_replicas") and hasattr(s, "rank"))
               for s in candidates if s is not None)


class DeviceLoader:
    """A loader whose batches are moved to ``device`` (tensors inside tuples, lists and dicts), with the
    wrapped loader's ``state_dict`` / ``load_state_dict``."""

    def __init__(self, loader: Any, device: torch.device) -> None:
        self.loader, self.device = loader, device

    @property
    def per_rank_state(self) -> bool:
        """Whether the wrapped loader's state differs by rank (``plait.data.resumable.checkpoint_state``)."""
        return bool(getattr(self.loader, "per_rank_state", False))

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield to_device(batch, self.device)

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, int]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.loader.load_state_dict(state)

    def advance(self, micro_batches: int) -> None:
        self.loader.advance(micro_batches)


    def set_shares(self, shares: list[int] | None) -> None:
        self.loader.set_shares(shares)


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor (in tuples, lists, dicts, a transformers BatchEncoding) on ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        moved = [to_device(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    if callable(getattr(batch, "to", None)):
        return batch.to(device)
    return batch
