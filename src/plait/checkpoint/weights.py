"""A rank's part of the model filled from a checkpoint, by initialisation, and written out shard by shard: the
default behind a layout state's ``prepare_weights`` and ``export_weights`` (``plait.checkpoint.layout_state``).

Every layout's state gives ``model_entries()``: this rank's state-dict entries under the single-process model's
names (DTensors where sharded), the tensors the model trains. Loading maps each tied group of names to the
one checkpoint name it is read from (checked against the whole model's ``ModelFacts`` first, identically on
every rank, so a bad checkpoint raises on all of them), then reads each rank's slices through
``plait.checkpoint.hf``. Exporting writes every entry under every name
(a tied tensor under each of its names, as ``state_dict()`` has them, so ``from_pretrained`` finds no key
missing or unexpected) through DCP's Hugging Face writer, files cut at ``max_shard_bytes`` in model order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.checkpoint.hf import (
    DEFAULT_SHARD_BYTES,
    Checkpoint,
    candidates,
    file_indices,
    load_into,
    local_boxes,
    match_names,
    open_checkpoint,
)
from plait.checkpoint.hf import save_from as _save_from
from plait.checkpoint.hf_convert import converted
from plait.config import ConfigError
from plait.parallel.meta_init import ModelFacts, initialise, storage_key


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _open(facts: ModelFacts, path: str | Path) -> Checkpoint:
    """The checkpoint's headers under the model's names: renamed and merged as ``from_pretrained`` would
    (``plait.checkpoint.hf_convert``)."""
    names = {c for n in facts.shapes for c in candidates(n, facts.base_prefix)}
    return converted(open_checkpoint(path), facts.conversions, names.__contains__)


def check_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Raise the ``WeightsError`` loading ``path`` into ``model`` would raise (headers only, no collective)."""
    facts = ModelFacts.of(model)
    match_names(facts.groups(), facts.shapes, facts.dtypes, _open(facts, path), prefix=facts.base_prefix,
                ignore=facts.ignore_unexpected, what=facts.kind)


def load_weights(facts: ModelFacts, entries: dict[str, torch.Tensor], path: str | Path, group: Any,
                 what: str) -> list[str]:
    """Fill ``entries`` (this rank's) from the checkpoint at ``path``; no collective (``group`` is the one an
    override may use). A meta-built model's non-persistent buffers (rotary ``inv_freq``) are then computed as
    construction would: returns those nothing computed (``plait.parallel.meta_init.initialise``). Entries a
    state-dict hook made are filled, not yet the model: ``load_renamed`` loads them."""
    ckpt = _open(facts, path)
    chosen = match_names(facts.groups(), facts.shapes, facts.dtypes, ckpt, prefix=facts.base_prefix,
                         ignore=facts.ignore_unexpected, what=what)
    state: dict[str, torch.Tensor] = {}
    copies: list[tuple[torch.Tensor, str]] = []  # a second tensor of the same name on this rank (a tied copy)
    seen: set[tuple] = set()
    for name, t in entries.items():
        canon = facts.canonical.get(name)
        if canon is None or storage_key(t) in seen:
            continue
        seen.add(storage_key(t))
        key = chosen[canon]
        if key in state:
            copies.append((t, key))
        else:
            state[key] = t
    load_into(state, ckpt)
    with torch.no_grad():
        for t, key in copies:
            _local(t).copy_(_local(state[key]))
    return initialise(facts, entries, seed=0, buffers_only=True)


def load_renamed(model: nn.Module, loaded: dict[str, torch.Tensor]) -> None:
    """Load into ``model`` the entries of ``loaded`` (its state dict's names, filled by DCP or from a checkpoint)
    that its state-dict hooks made rather than handed out (torchtitan's ``wq``/``wk``/``wv``, split from its fused
    ``wqkv``): through ``model.load_state_dict``, whose load hooks merge them back. Every other entry is the
    model's own storage, filled in place already. Collective where the hooks are (a DTensor gathered)."""
    own = {storage_key(t) for t in [*model.parameters(), *model.buffers()]}
    made = {k: loaded[k] for k, v in model.state_dict(keep_vars=True).items()
            if k in loaded and isinstance(v, torch.Tensor) and storage_key(v) not in own}
    if not made:
        return
    result = model.load_state_dict(made, strict=False)
    if result.unexpected_keys:
        raise ConfigError(f"{type(model).__name__}'s state dict names {', '.join(result.unexpected_keys[:3])}, which "
                          "its load_state_dict does not take back (its load hooks leave them unused): give the "
                          "module a load_state_dict pre-hook that merges what its state_dict hook splits")


def export_weights(facts: ModelFacts, entries: dict[str, torch.Tensor], out: Path, group: Any, coordinator: bool,
                   max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write the model as a Hugging Face directory at ``out`` (see the module docstring); collective over
    ``group``. No rank holds more than its own shards (a tied tensor's twice) plus, on the coordinating rank, one
    full tensor."""
    sizes = {n: int(torch.Size(facts.shapes[n]).numel()) * facts.dtypes[n].itemsize for n in facts.shapes}
    indices = file_indices(sizes, max_shard_bytes)
    boxed = [n for n, t in entries.items() if n in indices and len(local_boxes(t)) > 1]
    if boxed:  # the same on every rank: none is left in the writer's collective
        raise ConfigError(f"exporting to a directory writes one slice of each tensor per rank, and this layout holds "
                          f"{boxed[0]} as {len(local_boxes(entries[boxed[0]]))} separate slices (tensor parallelism's "
                          "packed expert weights); export to a path ending in .safetensors (one file, gathered on "
                          "rank 0)")
    state: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    for n, t in entries.items():
        if n not in indices:
            continue
        # safetensors refuses two names on one storage: a tied tensor's other names get a copy of this rank's part
        state[n] = t.detach().clone() if storage_key(t) in seen else t
        seen.add(storage_key(t))
    _save_from(state, out, indices, group, coordinator)
    save_config = getattr(facts.config, "save_pretrained", None)
    if coordinator and callable(save_config):
        save_config(str(out))
    return out
