"""A layout's state for checkpoints and weight I/O: what ``Layout.state`` answers (``LayoutState``), kept out of the
layout's contract with the engine, which only trains.

One format for every layout: ``state_dicts`` gives the model's entries and the optimizer states keyed by the
single-process model's parameter names (the ``plait.checkpoint.dcp.StatefulLayout`` that DCP writes from and reads
into, resharding between layouts and world sizes); ``finish_load`` completes a load; ``model_entries`` are this
rank's state-dict entries, which ``prepare_weights`` fills (a Hugging Face checkpoint, or the initialisation of a
model built on the meta device) and ``export_weights`` writes shard by shard; ``full_model_state`` gathers the whole
model; ``retie`` makes a pipeline's tied copies equal again after a replica's heal. Each method asks the layout's
parts (its stages, gradient-sync policy, experts' sync and drivers) in the layout's order. ``StateContract`` is the
protocol: a parameter server's worker has its own (``plait.ps.layout_state.PsState``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from plait.checkpoint.pieces import PiecesLoadPlanner, PiecesSavePlanner
from plait.checkpoint.weights import export_weights, load_renamed, load_weights
from plait.parallel.errors import PlaitError
from plait.parallel.meta_init import InitFn, initialise, refuse_uninitialised
from plait.parallel.tensor.plan import local_value
from plait.parallel.tensor.strided import is_strided, strided_entries
from plait.topology import Topology

Layout = Any  # plait.parallel.layout.Layout, which imports this module


@runtime_checkable
class StateContract(Protocol):
    """What checkpoints, weight loading and export, and a replica group's heal call on a layout's state."""

    def state_dicts(self) -> tuple[dict, dict]: ...

    def load_state_dicts(self, model_sd: dict, optim_sd: dict) -> None: ...

    def save_planner(self) -> Any: ...

    def load_planner(self) -> Any: ...

    def finish_load(self) -> None: ...

    def model_entries(self) -> dict[str, torch.Tensor]: ...

    def retie(self) -> None: ...

    def prepare_weights(self, weights: str | Path | None, init_fn: InitFn | None, seed: int, group: Any) -> None: ...

    def export_weights(self, out: Path, group: Any, coordinator: bool, max_shard_bytes: int) -> Path: ...

    def full_model_state(self, rank0_only: bool = False) -> dict[str, torch.Tensor]: ...


class LayoutState:
    """The state of a layout composed by ``plait.parallel.compose.parallelize`` (see the module docstring)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout

    def state_dicts(self) -> tuple[dict, dict]:
        """(model, {"state": optimizer states}) keyed by the single-process model's names: the one checkpoint
        format of every layout. The optimizer state is created first if no step ran, so the result can serve as
        a load template."""
        lay = self.layout
        model_sd = lay.stages.model_state()
        state = lay.policy.optimizer_state(lay.named_parameters())
        if lay.experts is not None:
            model_sd, state = lay.experts.state(model_sd, state)
        model_sd = strided_entries(model_sd)  # packed expert weights split over tp go to DCP as boxes
        optim_sd: dict[str, Any] = {"state": {k: strided_entries(st) for k, st in state.items()}}
        for d in lay.drivers:
            model_sd, optim_sd = d.state(lay, model_sd, optim_sd)
        return model_sd, optim_sd

    def load_state_dicts(self, model_sd: dict, optim_sd: dict) -> None:
        """Load a checkpoint's states (read by DCP into the tensors ``state_dicts`` handed out); hyperparameters stay
        this run's (an LR scheduler restores its own)."""
        lay = self.layout
        for d in reversed(lay.drivers):
            model_sd, optim_sd = d.load(lay, model_sd, optim_sd)
        state = optim_sd["state"]
        if lay.experts is not None:
            model_sd, state = lay.experts.load(model_sd, state)
        if not self._strided():
            lay.stages.load_model_state(model_sd)
        lay.policy.load_optimizer_state(lay.named_parameters(), state)

    def _strided(self) -> bool:
        return any(is_strided(p) for _, p in self.layout.named_parameters())

    def save_planner(self) -> Any:
        """DCP's save planner for this layout's entries (None: DCP's default)."""
        return PiecesSavePlanner(lowest_rank=False) if self._strided() else None

    def load_planner(self) -> Any:
        return PiecesLoadPlanner() if self._strided() else None

    def finish_load(self) -> None:
        """After a load's collective (a replica group meets the others)."""
        for d in self.layout.drivers:
            d.after_load(self.layout)

    def retie(self) -> None:
        """After this rank's weights were written from outside the layout, each rank on its own (a replica group's
        heal): the copies of a parameter the layout keeps on several ranks equal again (a pipeline's tied
        embedding and head)."""
        self.layout.stages.retie()

    def model_entries(self) -> dict[str, torch.Tensor]:
        """This rank's state-dict entries under the single-process model's names: DTensors where sharded; the
        model's own tensors, so writing into them writes the model (a state-dict hook's entries are its copies), and
        its tensors the state dict names otherwise or not at all (``plait.parallel.stages.own_entries``)."""
        lay = self.layout
        entries = lay.stages.entries()
        if lay.experts is not None:
            entries = lay.experts.entries(entries)
        for d in lay.drivers:
            entries = d.entries(lay, entries)
        return entries

    def prepare_weights(self, weights: str | Path | None, init_fn: InitFn | None, seed: int, group: Any) -> None:
        """Fill this rank's part of the model before the optimizer is built: from the checkpoint at ``weights``
        (each rank reads its own slices; ``group`` is the training ranks'), else, for a model built on the meta
        device, by ``plait.parallel.meta_init.initialise`` (``init_fn(module)`` or the modules' own init, seeded
        by ``seed`` and module name). A model built normally keeps its weights. A state-dict hook's entries load
        through ``load_state_dict`` (``load_renamed``); a tensor left unwritten is refused on every rank."""
        facts = self.layout.facts
        missing: list[str] = []
        if weights is not None:
            entries = self.model_entries()
            missing = load_weights(facts, entries, weights, group, facts.kind)
            load_renamed(self.layout.model, entries)
        elif facts.meta:
            missing = initialise(facts, self.model_entries(), seed, init_fn)
        if facts.meta:  # nothing left as empty memory: refused on every rank before the first step
            refuse_uninitialised(missing, group, self.layout.topo.device)
        elif init_fn is not None:
            raise PlaitError("init_fn initialises a model built on the meta device (under torch.device('meta')); "
                             "this model has its weights already: drop init_fn, or build it on the meta device")

    def export_weights(self, out: Path, group: Any, coordinator: bool, max_shard_bytes: int) -> Path:
        """Write the model as a Hugging Face directory, as ``save_pretrained`` names it: every rank writes its own
        shards; collective over ``group``. The weights are those every replica agrees on (``Layout.evaluation``)."""
        with self.layout.evaluation():
            return export_weights(self.layout.facts, self.model_entries(), out, group, coordinator, max_shard_bytes)

    def full_model_state(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights under the single-process names; every rank calls it. With ``rank0_only`` other
        ranks may get an empty dict (layouts that gather save the memory). The weights are those every replica
        agrees on: gathered inside ``Layout.evaluation`` (DiLoCo's start weights in the model while they are),
        copied where a driver may put other weights back after it."""
        if not self.layout.drivers:
            return self._full_model_state(rank0_only)
        with self.layout.evaluation():
            return {k: v.clone() for k, v in self._full_model_state(rank0_only).items()}

    def _full_model_state(self, rank0_only: bool) -> dict[str, torch.Tensor]:
        lay = self.layout
        full = None
        if lay.experts is None and not lay.stages.is_pipeline:
            full = lay.policy.full_state(lay.stages.holder, rank0_only)
        if lay.experts is not None and lay.stages.is_pipeline:  # this stage's experts whole, then over pp
            mine = {k: local_value(v) for k, v in lay.stages.model_state().items()}
            full = _gather_over_pp(lay.topo, {**mine, **lay.experts.full()})
        elif lay.experts is not None:
            full = {**lay.stages.full_state(), **lay.experts.full()}
        elif full is None:
            full = lay.stages.full_state()
        return full


def _gather_over_pp(topo: Topology, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    parts: list = [None] * topo.degree("pp")
    torch.distributed.all_gather_object(parts, {k: v.detach().cpu() for k, v in mine.items()},
                                        group=topo.group("pp"))
    return {k: v for part in parts for k, v in part.items()}
