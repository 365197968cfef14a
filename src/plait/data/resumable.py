"""Loaders for what plait's map-style loader cannot take, and the checkpoint state of per-rank loaders.

``Plait.setup_dataloader`` asks ``loader_for(data, ...)`` first:

* plait's own streamed data set (``plait.data.stream.StreamingDataset``): this rank's ``StreamingLoader``.
* a Hugging Face ``datasets.IterableDataset``: split over the data-parallel ranks with
  ``datasets.distributed.split_dataset_by_node`` (whole shards per rank when their number divides by the
  degree, else every dp-th example), read by torchdata's ``StatefulDataLoader``, whose state (the data
  set's own ``state_dict`` and the workers') goes into plait's checkpoints.
* a torchdata ``StatefulDataLoader`` (or a torch DataLoader) over an iterable data set: used as it is when
  it is a StatefulDataLoader over a Hugging Face data set already split by node, else rebuilt as a
  StatefulDataLoader over the split (or strided) data set with the same batch size, collate function and
  workers. (Over a map-style data set it is a DataLoader like any other: plait's loader takes its data set.)
* a torch ``IterableDataset``: every dp-th sample on each rank, through a ``StatefulDataLoader``: resumed
  by its ``state_dict`` when it has one, else by reading and dropping the samples already used.
* any other iterable (a generator, a list of batches): its items are taken as batches, every dp-th on
  each rank; it cannot be resumed, and one warning says so.

A Hugging Face ``datasets.Dataset`` is map-style: plait's ``DistributedLoader`` takes it (shards by index,
resumes exactly, also at another degree). The per-rank loaders here resume at the layout they were
saved with; another data-parallel degree is refused with a message (their state cannot be re-dealt).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

from plait.data.errors import DataError

_STATEFUL = "plait-stateful"


def checkpoint_state(loader: Any, group: Any = None) -> Any:
    """``loader.state_dict()`` for a checkpoint: for a loader whose state differs by rank
    (``per_rank_state``), every rank's, gathered (collective over ``group``: call it on every rank)."""
    state = loader.state_dict()
    if not getattr(loader, "per_rank_state", False):
        return state
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return {"per_rank": [state]}
    states: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(states, state, group=group)
    return {"per_rank": states}


def _is_hf_iterable(data: Any) -> bool:
    return type(data).__name__ == "IterableDataset" and type(data).__module__.startswith("datasets")


def _stateful_dataloader() -> type:
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        raise DataError("resumable reading of an iterable data set needs torchdata's StatefulDataLoader: "
                        "pip install 'plait[datasets]' (or pip install torchdata)") from None
    return StatefulDataLoader


def _is_stateful_dataloader(data: Any) -> bool:
    return type(data).__name__ == "StatefulDataLoader" and type(data).__module__.startswith("torchdata")


class _Strided:
    """Every ``size``-th item of ``data`` from ``rank``: a torch IterableDataset's share of one rank. Its
    ``state_dict`` is the wrapped data set's, when it has one."""

    def __init__(self, data: Any, rank: int, size: int) -> None:
        self.data, self.rank, self.size = data, rank, size

    def __iter__(self) -> Iterator[Any]:
        for i, item in enumerate(self.data):
            if i % self.size == self.rank:
                yield item


def _shard(data: Any, dp_rank: int, dp_size: int) -> Any:
    import torch.utils.data as tud

    if _is_hf_iterable(data):
        if getattr(getattr(data, "_distributed", None), "world_size", 1) > 1:
            return data  # already split by node
        from datasets.distributed import split_dataset_by_node

        return split_dataset_by_node(data, rank=dp_rank, world_size=dp_size)
    strided = _Strided(data, dp_rank, dp_size)

    class Sharded(tud.IterableDataset):
        def __iter__(self) -> Iterator[Any]:
            return iter(strided)

        if hasattr(data, "state_dict"):
            def state_dict(self) -> dict[str, Any]:
                return data.state_dict()

            def load_state_dict(self, state: dict[str, Any]) -> None:
                data.load_state_dict(state)

    return Sharded()


class PerRankLoader:
    """A ``StatefulDataLoader`` of this rank's share, its state saved per rank in plait's checkpoints."""

    per_rank_state = True

    def __init__(self, loader: Any, dp_rank: int, dp_size: int) -> None:
        self.loader, self.dp_rank, self.dp_size = loader, dp_rank, dp_size

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": _STATEFUL, "dp_rank": self.dp_rank, "dp_size": self.dp_size, "state": self.loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        entries = state.get("per_rank", [state])
        if any(e.get("kind") != _STATEFUL for e in entries):
            raise DataError("the checkpoint's data-loader state is not an iterable data set's; resume with the data "
                            "the run was saved with")
        saved_dp = int(entries[0]["dp_size"])
        if saved_dp != self.dp_size:
            raise DataError(f"the checkpoint read this iterable data set at data-parallel degree {saved_dp}; its "
                            f"reader's state cannot be re-dealt to {self.dp_size} ranks: resume at degree {saved_dp}, "
                            "or use a map-style data set (or plait's data.streaming) to change it")
        mine = next(e for e in entries if int(e["dp_rank"]) == self.dp_rank)
        self.loader.load_state_dict(mine["state"])

    def advance(self, micro_batches: int) -> None:
        it = iter(self.loader)
        for _ in range(micro_batches):
            next(it)

    def set_shares(self, shares: list[int] | None) -> None:
        if shares is not None:
            raise DataError("fault.rebalance needs a map-style data set; set fault.rebalance=false")


class PlainIterableLoader(PerRankLoader):
    """Any other iterable: every dp-th item is this rank's batch; not resumable (warned once)."""

    per_rank_state = False

    def __init__(self, data: Any, dp_rank: int, dp_size: int) -> None:
        super().__init__(_Strided(data, dp_rank, dp_size), dp_rank, dp_size)
        warnings.warn(f"plait cannot resume a {type(data).__name__}: a resumed run reads it again from its start. "
                      "Pass a map-style data set, a datasets.IterableDataset or a StatefulDataLoader to resume "
                      "exactly", stacklevel=3)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "plait-plain"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None  # nothing to restore: the warning at setup said so


def loader_for(data: Any, *, dp_rank: int, dp_size: int, batch_size: int, num_workers: int,
               collate_fn: Callable | None = None, **kwargs: Any) -> Any | None:
    """This rank's loader for ``data`` when it is one of the kinds above; None for map-style data sets and
    DataLoaders over them (plait's ``DistributedLoader`` takes those)."""
    import torch.utils.data as tud

    from plait.data.stream_state import StreamingDataset

    if isinstance(data, StreamingDataset):
        return data.loader(dp_rank=dp_rank, dp_size=dp_size, batch_size=batch_size, num_workers=num_workers,
                           prefetch_factor=kwargs.get("prefetch_factor"), pin_memory=kwargs.get("pin_memory", False))
    if isinstance(data, tud.DataLoader):
        if not isinstance(data.dataset, tud.IterableDataset):
            return None  # a DataLoader over a map-style data set: plait's loader takes its data set
        ds = data.dataset
        if _is_stateful_dataloader(data) and _is_hf_iterable(ds) and \
                getattr(getattr(ds, "_distributed", None), "world_size", 1) == dp_size > 1:
            return PerRankLoader(data, dp_rank, dp_size)
        rebuilt = _stateful_dataloader()(_shard(ds, dp_rank, dp_size), batch_size=data.batch_size,
                                         collate_fn=data.collate_fn, num_workers=data.num_workers,
                                         pin_memory=data.pin_memory)
        return PerRankLoader(rebuilt, dp_rank, dp_size)
    if isinstance(data, tud.IterableDataset) or _is_hf_iterable(data):
        loader = _stateful_dataloader()(_shard(data, dp_rank, dp_size), batch_size=batch_size, collate_fn=collate_fn,
                                        num_workers=num_workers, pin_memory=kwargs.get("pin_memory", False))
        return PerRankLoader(loader, dp_rank, dp_size)
    if hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        return None
    if hasattr(data, "__iter__"):
        return PlainIterableLoader(data, dp_rank, dp_size)
    return None
