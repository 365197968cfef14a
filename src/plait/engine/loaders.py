"""``Plait.setup_dataloader``'s work: a rank's deterministic, resumable share of a data set."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader

from plait.config import Config
from plait.data.loader import DeviceLoader, DistributedLoader, is_rank_aware
from plait.data.resumable import loader_for
from plait.observe.log import get_logger
from plait.parallel.errors import PlaitError
from plait.topology import Topology

LOADER_SETTINGS = ("num_workers", "pin_memory", "timeout", "worker_init_fn", "prefetch_factor", "persistent_workers")


def distributed_loader(data: Any, batch_size: int | None, config: Config, topo: Topology, *,
                       collate_fn: Callable | None, shuffle: bool, drop_last: bool | None, seed: int | None,
                       **kwargs: Any) -> tuple[Any, int, int | None]:
    """(this rank's loader, its batch size, the accumulation that implies; None when it does not set one). See
    ``Plait.setup_dataloader`` for the contract."""
    t = config.train
    special = loader_for(data, dp_rank=topo.dp_rank, dp_size=topo.dp, batch_size=batch_size or t.micro_batch_size,
                         num_workers=kwargs.get("num_workers", config.data.num_workers), collate_fn=collate_fn,
                         pin_memory=topo.device.type == "cuda", prefetch_factor=kwargs.get("prefetch_factor"))
    if special is not None:  # streamed, iterable or Hugging Face data (plait.data.resumable)
        return (special if topo.device.type == "cpu" else DeviceLoader(special, topo.device)), \
            batch_size or t.micro_batch_size, None
    if isinstance(data, DataLoader):
        if is_rank_aware(data):
            get_logger(topo.rank).info("the DataLoader's sampler is already rank-aware: used as it is (not resumable)")
            return data, data.batch_size, _own_accumulation(data.batch_size, config, topo) if shuffle else None
        collate_fn = collate_fn or data.collate_fn
        for key in LOADER_SETTINGS:  # the DataLoader's worker settings, where the caller did not give them
            if key not in kwargs and hasattr(data, key) and not (key == "prefetch_factor" and data.num_workers == 0):
                kwargs[key] = getattr(data, key)
        batch_size = batch_size or data.batch_size
        data = data.dataset
    batch_size = batch_size or t.micro_batch_size
    accumulation = None
    if shuffle:
        per_step = batch_size * topo.dp
        if t.global_batch_size % per_step:
            raise PlaitError(f"batch_size={batch_size} x dp={topo.dp} does not divide train.global_batch_size="
                             f"{t.global_batch_size}; choose a batch size that divides "
                             f"{t.global_batch_size // topo.dp} or change train.global_batch_size")
        accumulation = t.global_batch_size // per_step
    kwargs.setdefault("num_workers", config.data.num_workers)
    if topo.device.type == "cuda":
        kwargs.setdefault("pin_memory", True)
    loader = DistributedLoader(data, batch_size, dp_rank=topo.dp_rank, dp_size=topo.dp, accumulation=accumulation or 1,
                               seed=t.seed if seed is None else seed, shuffle=shuffle,
                               drop_last=shuffle if drop_last is None else drop_last, collate_fn=collate_fn, **kwargs)
    return (loader if topo.device.type == "cpu" else DeviceLoader(loader, topo.device)), batch_size, accumulation


def _own_accumulation(batch_size: int | None, config: Config, topo: Topology) -> int | None:
    """The accumulation a rank-aware loader's own batch size implies (None when it has none or it does not
    divide the global batch: then the config's stays, and the mismatch is named)."""
    t = config.train
    if not batch_size:
        return None
    if t.global_batch_size % (batch_size * topo.dp):
        get_logger(topo.rank).warning(
            "the rank-aware DataLoader's batch_size=%d x dp=%d does not divide train.global_batch_size=%d: each "
            "optimizer step still takes %d micro-steps of it", batch_size, topo.dp, t.global_batch_size,
            config.grad_accum)
        return None
    return t.global_batch_size // (batch_size * topo.dp)
