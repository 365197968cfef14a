"""Checkpoints whose names and layout are not the model's, read as ``from_pretrained`` reads them: through the
model's own conversion mapping in transformers (``transformers.conversion_mapping.get_model_conversion_mapping``,
transformers 5).

transformers 5 holds some tensors fused where checkpoints keep them apart, and ``save_pretrained`` writes them
apart again: a Mixtral's experts are the model's ``mlp.experts.gate_up_proj (E, 2I, C)`` and ``down_proj (E, C,
I)``, the checkpoint's ``block_sparse_moe.experts.{e}.w1/w3/w2.weight``, one per expert. ``from_pretrained``
renames each checkpoint key (``WeightRenaming``: ``.block_sparse_moe.`` -> ``.mlp.``) and merges the tensors a
``WeightConverter`` collects under one target (``MergeModulelist``: stack the experts, in natural key order;
``Concatenate``: the stacked ``w1`` then ``w3`` along dim 1).

plait applies the same mapping to the checkpoint's *headers* (``converted``): a renamed key is the same tensor
under the model's name, and a merged one becomes a ``TensorInfo`` with ``blocks``, where each checkpoint tensor
sits in the fused tensor. A rank then reads, from each block, only the overlap with its own slice
(``plait.checkpoint.hf.load_into``): an expert-parallel rank reads its experts' files and no other,
and no rank ever holds a fused tensor whole. Renaming and matching are transformers' own
(``core_model_loading.rename_source_key``); the merge operations are interpreted on the blocks' positions here,
because transformers' run on tensors. Operations that are not a stack or a concatenation (a transpose, a
permutation for rotary embeddings, quantised formats) are refused in one ``WeightsError`` naming the tensor.

Exports keep the model's names (``from_pretrained`` reads those as they are: a name already the model's matches
no converter).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from plait.checkpoint.hf import Block, Checkpoint, TensorInfo, WeightsError


def model_conversions(model: Any) -> list[Any]:
    """The conversion mapping ``from_pretrained`` would apply to ``model`` (empty for a model that is not a
    transformers ``PreTrainedModel``, or under a transformers without one)."""
    if "transformers" not in sys.modules:  # a model of transformers has imported it
        return []
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return []
    if not isinstance(model, PreTrainedModel):
        return []
    return list(get_model_conversion_mapping(model))


@dataclass
class _Fused:
    """A tensor being assembled from blocks: its shape and where each checkpoint tensor sits in it."""

    shape: tuple[int, ...]
    blocks: list[Block]


def _stack(parts: list[_Fused], dim: int) -> _Fused:
    shape = parts[0].shape
    if any(p.shape != shape for p in parts):
        raise ValueError(f"stacks tensors of different shapes {sorted({p.shape for p in parts})}")
    dim %= len(shape) + 1
    blocks = [Block(b.key, b.info, b.offset[:dim] + (i,) + b.offset[dim:], b.shape[:dim] + (1,) + b.shape[dim:])
              for i, p in enumerate(parts) for b in p.blocks]
    return _Fused(shape[:dim] + (len(parts),) + shape[dim:], blocks)


def _cat(parts: list[_Fused], dim: int) -> _Fused:
    dim %= len(parts[0].shape)
    rest = {p.shape[:dim] + p.shape[dim + 1:] for p in parts}
    if len(rest) != 1:
        raise ValueError(f"concatenates tensors of shapes {[p.shape for p in parts]} along dim {dim}")
    blocks, at = [], 0
    for p in parts:
        blocks += [Block(b.key, b.info, b.offset[:dim] + (b.offset[dim] + at,) + b.offset[dim + 1:], b.shape)
                   for b in p.blocks]
        at += p.shape[dim]
    shape = parts[0].shape
    return _Fused(shape[:dim] + (at,) + shape[dim + 1:], blocks)


def _merge(converter: Any, collected: dict[str, list[_Fused]]) -> _Fused:
    """What ``converter``'s operations make of the collected blocks (by source pattern), as transformers'
    ``MergeModulelist`` and ``Concatenate`` would make it of the tensors."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    state: dict[str, Any] = dict(collected)
    targets = converter.target_patterns
    for op in converter.operations:
        if isinstance(op, MergeModulelist) and (len(state) > 1 or len(targets) == 1):
            state = {(targets[0] if len(state) == 1 else k): v if isinstance(v, _Fused) else _stack(v, op.dim)
                     for k, v in state.items()}
        elif isinstance(op, Concatenate) and len(targets) == 1:
            parts = [x for k in converter.source_patterns if k in state
                     for x in (state[k] if isinstance(state[k], list) else [state[k]])]
            state = {targets[0]: _cat(parts, op.dim)}
        else:
            raise ValueError(f"converts them with {type(op).__name__}")
    out = list(state.values())
    if len(out) != 1 or not isinstance(out[0], _Fused):
        raise ValueError("makes several tensors of them")
    return out[0]


def converted(ckpt: Checkpoint, conversions: list[Any], known: Callable[[str], bool]) -> Checkpoint:
    """``ckpt`` under the model's names (see the module docstring): each key renamed and merged by
    ``conversions`` (``model_conversions``) where ``from_pretrained`` would, ``known(name)`` telling a model
    name (a key whose renamed form the model lacks but whose own name it has keeps its name, as in
    ``from_pretrained``). Keys the model has no name for keep theirs (the unexpected ones of the checks).
    Reads headers only; raises ``WeightsError`` for a merge plait cannot read in blocks."""
    if not conversions:
        return ckpt
    from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key

    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    renamings = [c for c in conversions if not isinstance(c, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    tensors: dict[str, TensorInfo] = {}
    merges: dict[str, tuple[Any, dict[str, list[_Fused]]]] = {}
    for key in sorted(ckpt.tensors, key=dot_natural_key):
        info = ckpt.tensors[key]
        new, pattern = rename_source_key(key, renamings, converters)
        if not known(new):
            new, pattern = key, None
        if pattern is None:
            tensors[new] = info
            continue
        converter, collected = merges.setdefault(new, (by_pattern[pattern], {}))
        collected.setdefault(pattern, []).append(_Fused(info.shape, [Block(key, info, (0,) * len(info.shape),
                                                                             info.shape)]))
    for name, (converter, collected) in merges.items():
        keys = [b.key for parts in collected.values() for p in parts for b in p.blocks]
        try:
            fused = _merge(converter, collected)
        except ValueError as e:
            raise WeightsError(f"weights {ckpt.path}: the model's {name} is stored as {len(keys)} tensors "
                               f"({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}) and transformers {e}, "
                               "which plait cannot read shard by shard; load the model with from_pretrained and "
                               "pass it to setup without weights=") from None
        dtypes = {b.info.dtype for b in fused.blocks}
        if len(dtypes) != 1:
            raise WeightsError(f"weights {ckpt.path}: the tensors of the model's {name} ({', '.join(keys[:3])}, "
                               f"...) have different dtypes {sorted(str(d) for d in dtypes)}; save the checkpoint "
                               "again in one dtype")
        first = fused.blocks[0].info
        tensors[name] = replace(first, shape=fused.shape, dtype=dtypes.pop(), blocks=tuple(fused.blocks))
    return Checkpoint(ckpt.path, ckpt.files, tensors)
