"""Parameter-server checkpoints written and read by the servers themselves, through DCP.

A PS checkpoint is every layout's checkpoint (``plait.checkpoint.dcp``: one DCP directory under the
single-process names, a SHA-256 manifest, written to ``PATH.tmp`` and renamed): workers and servers
take part in one DCP save over a gloo group of every rank, and each server contributes only what it
holds. Its flat shard ``[lo, hi)`` overlaps each parameter in a contiguous range ``[a, b)`` of the
parameter's row-major elements, which ``flat_boxes`` cuts into the rectangular chunks DCP stores (at
most ``2 * ndim - 1``, each itself contiguous in row-major order, so each is a view of the shard: no
copy). They are written under ``model.<name>`` (every name of a tied parameter) and
``optim.state.<name>.<key>`` (each per-element optimizer state, AdamW's ``exp_avg``/``exp_avg_sq``);
a parameter's scalar state (AdamW's ``step``) is written by the server holding its first element,
and the servers add ``ps.versions`` (server ``i`` writes element ``i``) and ``ps.clocks`` (server 0).
Worker 0 writes what is not a trained parameter (buffers, e.g. BatchNorm statistics). DCP's metadata
records which rank's file holds each chunk.

A load is the same collective: DCP reads, for each box a server holds, its overlap with the saved
chunks, so servers load their own pieces from a checkpoint of any number of servers or of any other
layout (one chunk per tensor from data parallelism, ``dp_shard`` chunks from ZeRO-3); workers load
the buffers. A checkpoint without ``ps.versions`` (another layout's) starts every version and clock at
the saved step count; with another number of servers or workers, every version (clock) is the largest
saved one (in sync and ssp they are all equal at a save).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import (
    Metadata,
    TensorStorageMetadata,
)

from plait.checkpoint.pieces import Pieces, PiecesLoadPlanner, PiecesSavePlanner
from plait.components.optim import single_names
from plait.ps.shard import FlatLayout
from plait.ps.state import ShardState

Box = tuple[tuple[int, ...], tuple[int, ...], int]  # (offsets, sizes, first element relative to a)


def flat_boxes(shape: tuple[int, ...], a: int, b: int) -> list[Box]:
    """The elements ``[a, b)`` (row-major order) of a tensor of ``shape`` as rectangular boxes, each
    contiguous in row-major order: ``(offsets, sizes, start)`` with ``start`` the box's first element
    counted from ``a``. A partial first row, whole rows, a partial last row, recursively per dim."""
    if a >= b:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    r0, r1 = a // inner, b // inner
    if r0 == r1 or (r1 == r0 + 1 and b % inner == 0 and a % inner):  # within one row
        return [((r0, *o), (1, *s), st) for o, s, st in flat_boxes(shape[1:], a - r0 * inner, b - r0 * inner)]
    out: list[Box] = []
    if a % inner:  # the partial first row
        out += [((r0, *o), (1, *s), st) for o, s, st in flat_boxes(shape[1:], a % inner, inner)]
        r0 += 1
    if r1 > r0:  # whole rows
        out.append(((r0, *[0] * (len(shape) - 1)), (r1 - r0, *shape[1:]), r0 * inner - a))
    if b % inner:  # the partial last row
        out += [((r1, *o), (1, *s), r1 * inner - a + st) for o, s, st in flat_boxes(shape[1:], 0, b % inner)]
    return out


def param_names(model: nn.Module, flat: FlatLayout) -> list[tuple[list[str], str]]:
    """For each parameter of ``flat`` (in its order): its names in ``model.state_dict()`` (several when
    tied) and its name in an optimizer state dict (``get_state_dict``'s: the first of ``named_parameters``)."""
    index = {id(p): i for i, p in enumerate(flat.params)}
    keys: list[list[str]] = [[] for _ in flat.params]
    for k, v in model.state_dict(keep_vars=True).items():
        if id(v) in index:
            keys[index[id(v)]].append(k)
    fqns: list[str | None] = [None] * len(flat.params)
    for n, p in single_names(model):
        if id(p) in index and fqns[index[id(p)]] is None:
            fqns[index[id(p)]] = n
    return [(k, f or k[0]) for k, f in zip(keys, fqns, strict=True)]


def untrained_state(model: nn.Module, flat: FlatLayout) -> dict[str, torch.Tensor]:
    """The model's state-dict entries that are not parameters the servers hold (buffers, frozen ones)."""
    ids = {id(p) for p in flat.params}
    return {k: v.detach() for k, v in model.state_dict(keep_vars=True).items() if id(v) not in ids}


def _pieces(shape: torch.Size, boxes: list[Box], base: torch.Tensor, start: int) -> Pieces:
    """``Pieces`` of a tensor of ``shape`` whose elements from the boxes' ``a`` on are ``base[start:]``."""
    return Pieces(shape, [(torch.Size(o), base[start + st:start + st + math.prod(sz)].view(sz))
                          for o, sz, st in boxes])


class ServerCheckpoint:
    """A server's side of ``save_state`` / ``load_state`` (it quacks like a layout there): its pieces of
    the single-process state dicts, the planners, and (after a load) the versions and clocks.

    ``loading``: a load template (every parameter's scalar states the shard's segments need are read)
    rather than what this server writes (scalars only of the parameters whose first element it holds)."""

    def __init__(self, state: ShardState, flat: FlatLayout, names: list[tuple[list[str], str]], index: int,
                 num_workers: int, loading: bool = False) -> None:
        self.state, self.flat, self.names, self.index = state, flat, names, index
        self.num_workers, self.loading = num_workers, loading
        self.scalars: list[tuple[int, dict[str, Any]]] = []  # loading: (segment, {key: loaded value})
        self.ps: dict[str, torch.Tensor] = {}

    def state_dicts(self) -> tuple[dict, dict]:
        s, (lo, hi) = self.state, self.flat.shard_range(self.index)
        vec, sca = s.optimizer_keys()  # creates the shard optimizer's state first
        model: dict[str, Any] = {}
        optim: dict[str, dict[str, Any]] = {}
        seen_segments: set[int] = set()
        offset = 0
        for p, (keys, fqn) in zip(self.flat.params, self.names, strict=True):
            pa, pb = offset, offset + p.numel()
            offset = pb
            a, b = max(pa, lo), min(pb, hi)
            if a >= b:
                continue
            j = next(j for j, g in enumerate(s.segments) if g.start <= a - lo < g.end)
            seg = s.segments[j]
            boxes = flat_boxes(tuple(p.shape), a - pa, b - pa)
            for k in keys:
                model[k] = _pieces(p.shape, boxes, s.w, a - lo)
            st = s.optimizer.state[s.views[j]]
            entry = optim.setdefault(fqn, {})
            for k in vec:
                entry[k] = _pieces(p.shape, boxes, st[k], a - lo - seg.start)
            if self.loading and j not in seen_segments:
                seen_segments.add(j)
                loaded = {k: st[k].clone() if torch.is_tensor(st[k]) else st[k] for k in sca}
                entry.update(loaded)
                self.scalars.append((j, loaded))
            elif not self.loading and a == pa:
                entry.update({k: st[k] for k in sca})
        return model, {"state": optim}

    def save_planner(self) -> PiecesSavePlanner:
        s, n = self.state, len(self.flat.bounds) - 1
        ps: dict[str, Any] = {"versions": Pieces(torch.Size([n]), [(torch.Size([self.index]),
                                                                     torch.tensor([s.version]))])}
        if self.index == 0:
            ps["clocks"] = torch.tensor(s.clocks, dtype=torch.int64)
        return PiecesSavePlanner({"ps": ps})

    def load_planner(self) -> PiecesLoadPlanner:
        def extra(metadata: Metadata) -> dict[str, Any]:
            self.ps = {k: torch.zeros(md.size, dtype=torch.int64) for k in ("versions", "clocks")
                       if isinstance(md := metadata.state_dict_metadata.get(f"ps.{k}"), TensorStorageMetadata)}
            return {"ps": self.ps} if self.ps else {}

        return PiecesLoadPlanner(extra)

    def load_state_dicts(self, model_sd: dict, optim_sd: dict) -> None:
        """Parameters and per-element states were read in place; set each segment's scalar states."""
        s = self.state
        for j, loaded in self.scalars:
            st = s.optimizer.state[s.views[j]]
            for k, v in loaded.items():
                if torch.is_tensor(st[k]):
                    st[k].copy_(v)
                else:
                    st[k] = v

    def versions_and_clocks(self, steps: int) -> tuple[int, list[int]]:
        """This server's version and the workers' clocks after a load (see the module docstring)."""
        n = len(self.flat.bounds) - 1
        versions = self.ps.get("versions")
        if versions is None:
            version = steps
        else:
            version = int(versions[self.index]) if versions.numel() == n else int(versions.max())
        clocks = self.ps.get("clocks")
        if clocks is None:
            return version, [steps] * self.num_workers
        if clocks.numel() == self.num_workers:
            return version, [int(c) for c in clocks]
        return version, [int(clocks.max())] * self.num_workers
