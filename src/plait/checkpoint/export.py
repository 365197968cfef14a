"""``Plait.export``: one safetensors file gathered to rank 0, or a Hugging Face directory written shard by shard
through the strategy."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from plait.checkpoint.hf import INDEX
from plait.checkpoint.single_file import export_safetensors
from plait.parallel.errors import PlaitError
from plait.parallel.layout import Layout


def export_weights(plait: Any, model: Any, path: Path, max_shard_bytes: int) -> Path:
    """``Plait.export`` of ``plait`` (a ``plait.Plait``): a path ending in ``.safetensors`` is one file gathered to
    rank 0; any other a Hugging Face directory written shard by shard (``export_directory``). Every rank calls it."""
    if path.suffix == ".safetensors":
        return export_file(plait.full_state_dict(model, rank0_only=True), path, plait.is_main, plait.barrier)
    strategy = plait._check_objects(model, None)
    plait.phase("export")
    return export_directory(strategy, path, plait.group, plait.is_main, plait.barrier, max_shard_bytes)


def export_directory(strategy: Layout, path: Path, group: Any, is_main: bool, barrier: Callable[[], None],
                     max_shard_bytes: int) -> Path:
    """Write the model at directory ``path`` (``LayoutState.export_weights``); an earlier export's files there are
    removed first, so the directory holds one checkpoint. Every rank calls it."""
    if path.is_file():  # checked on every rank: the same answer everywhere, no rank left waiting
        raise PlaitError(f"export to {path}: a file is there; give a directory, or a path ending in .safetensors "
                         "for one file")
    if is_main:
        for old in [*path.glob("model*.safetensors"), path / INDEX]:
            old.unlink(missing_ok=True)
    barrier()
    strategy.state.export_weights(path, group, is_main, max_shard_bytes)
    barrier()
    return path


def export_file(full: dict[str, torch.Tensor], path: Path, is_main: bool, barrier: Callable[[], None]) -> Path:
    """Rank 0 writes ``full`` (the gathered weights) as one safetensors file at ``path``."""
    if is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        export_safetensors(full, path)
    barrier()
    return path
