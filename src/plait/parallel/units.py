"""A model's repeated blocks: the units FSDP shards one at a time and activation checkpointing recomputes.

Found without knowing the model: a Hugging Face model names its block classes in
``_no_split_modules`` (``LlamaDecoderLayer``, ``GPT2Block``; any model may set it); otherwise the blocks are the
children of the ``nn.ModuleList``, ``nn.ModuleDict`` or ``nn.Sequential`` holding the most parameters with at least
two children (plait's GPT and CNN ``blocks``, torchtitan's ``layers``, a Sequential model's layers). A model
without either has no blocks (``NO_BLOCKS`` says how to name them).
Batch normalisation: the running statistics of a model's BatchNorm layers, for averaging over ranks.
Tied weights: the modules that share one parameter (``tied_uses``), found by identity, for every layout that
rebuilds or shards the model's modules (tensor plans, pipeline stages, FSDP units) and must keep them one tensor.
Expert-parallel parameters: marked by ``plait.parallel.expert.dispatch.shard_experts``; the data-parallel engines
(reducer, DDP, ZeRO, FSDP) leave them to ``plait.parallel.expert.sync.ExpertSync``.
"""

from __future__ import annotations

import torch
from torch import nn


def _numel(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def tied_uses(model: nn.Module) -> list[list[tuple[str, nn.Module]]]:
    """Every parameter the model uses under more than one name (a tied embedding and head), by identity: one list
    per parameter of ``(qualified name, module holding it)``, in the model's order."""
    uses: dict[int, list[tuple[str, nn.Module]]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False):
            uses.setdefault(id(p), []).append((f"{mname}.{pname}" if mname else pname, module))
    return [u for u in uses.values() if len({name for name, _ in u}) > 1]


NO_BLOCKS = ("no _no_split_modules naming its block class, no ModuleList, ModuleDict or Sequential of layers; "
             "name the class of its repeated blocks in model._no_split_modules = ['Block']")


def describe_blocks(blocks: list[tuple[str, nn.Module]]) -> str:
    """``blocks`` (``find_blocks``) in a few words for a log line: ``layers.0 .. layers.3 (4 Block)``."""
    kinds = sorted({type(getattr(m, "_checkpoint_wrapped_module", m)).__name__ for _, m in blocks})
    span = blocks[0][0] if len(blocks) == 1 else f"{blocks[0][0]} .. {blocks[-1][0]}"
    return f"{span} ({len(blocks)} {'/'.join(kinds)})"


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the model's repeated blocks in order; empty when it has none."""
    classes = set(getattr(model, "_no_split_modules", None) or [])
    if classes:
        found = [(n, m) for n, m in model.named_modules() if type(m).__name__ in classes]
        if found:
            return found
    best: tuple[int, str, nn.Module] | None = None
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList | nn.ModuleDict | nn.Sequential) and len(m) >= 2:
            size = _numel(m)
            if size and (best is None or size > best[0]):
                best = (size, name, m)
    if best is None:
        return []
    _, name, container = best
    prefix = f"{name}." if name else ""
    return [(f"{prefix}{k}", child) for k, child in container.named_children()]


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` where the submodule ``name`` is (works for ModuleList/Sequential children too)."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def batchnorm_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The floating-point running statistics of every BatchNorm layer that tracks them."""
    out = []
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            out += [b for b in (m.running_mean, m.running_var) if b is not None and b.is_floating_point()]
    return out


EXPERT_ATTR = "_plait_expert"


def is_expert(p: torch.Tensor) -> bool:
    """Whether ``p`` is an expert-parallel parameter (this rank's slice of experts sharded over ``ep``)."""
    return bool(getattr(p, EXPERT_ATTR, False))
