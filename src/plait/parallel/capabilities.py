"""What a layout may have beyond its contract (``plait.parallel.layout.LayoutContract``): drivers that wrap the step
from outside (``Driver``: DiLoCo's outer loop, torchft replica groups), and optional capabilities, small protocols a
part of a layout implements and the engine finds with ``Layout.capability``: ``Serving`` (ranks that serve instead of
running the loop), ``OwnPace`` (ranks that do not meet at every step), ``CheckpointJoin`` (other ranks join a
checkpoint's collectives). Between drivers: ``ReplicaMean`` (a driver that averages over the replicas it manages:
torchft's live groups, which DiLoCo's outer all-reduce goes through) and ``Healing`` (a driver whose own state a
replica group's heal carries: DiLoCo's outer momentum)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

Layout = Any  # plait.parallel.layout.Layout, which imports this module


# -- optional capabilities -------------------------------------------------------------------------------
@runtime_checkable
class Serving(Protocol):
    """A part some of whose ranks do not run the user's loop (a parameter server's servers)."""

    def start(self, leaving: Callable[[], None]) -> None:
        """After the optimizer is built: a serving rank calls ``leaving()``, serves, and ends by raising
        ``RankDone``; other ranks return at once."""


@runtime_checkable
class OwnPace(Protocol):
    """A part whose ranks do not all meet at every step (an asynchronous parameter server)."""

    def agreement_group(self, default: Any) -> tuple[bool, Any]:
        """Whether the ranks agree on the loss and a stop request at every step boundary, and over which group."""

    def before_collective(self) -> None:
        """Just before a collective among the training ranks that the user's loop calls."""


@runtime_checkable
class CheckpointJoin(Protocol):
    """A part other ranks of which join a checkpoint's collectives (a parameter server's servers)."""

    def checkpoint_group(self, default: Any) -> Any: ...

    def begin_save(self, path: Path) -> None: ...

    def begin_load(self, path: Path, verify: bool) -> None: ...


@runtime_checkable
class ReplicaMean(Protocol):
    """A driver that averages values over the replicas it manages (torchft's live replica groups)."""

    def replica_mean(self, flat: torch.Tensor) -> bool:
        """``flat`` (1-D float32, this rank's part) replaced by its mean over the live replicas (rank k of each
        replica sends the same part), then the ranks of this replica agree whether it arrived everywhere (False:
        discard it). Collective over this replica's ranks and its peers in the others."""


@runtime_checkable
class Healing(Protocol):
    """A driver with state of its own that a replica group's heal carries (DiLoCo's outer momentum)."""

    def heal_state(self) -> dict[str, Any]:
        """This rank's part of a heal: plain local tensors and numbers, no collective."""

    def heal(self, state: dict[str, Any] | None) -> None:
        """After this rank's model entries were written from outside its training: a heal from a live peer
        (``state``: the peer's ``heal_state()``), or the group's agreement on its first weights (None)."""


def agreement(layout: Any, default: Any) -> tuple[bool, Any]:
    """Whether the ranks agree on the loss and a stop request at every step boundary, and over which group
    (``default``: the training ranks'): a part with its own pace (``OwnPace``) says."""
    pace = layout.capability(OwnPace)
    return pace.agreement_group(default) if pace is not None else (True, default)


def checkpoint_group(layout: Any, default: Any) -> Any:
    """The process group a checkpoint's collectives run over (``default``: the engine's)."""
    join = layout.capability(CheckpointJoin)
    return join.checkpoint_group(default) if join is not None else default


class Driver:
    """Wraps the step from outside (DiLoCo's outer loop, torchft replica groups): each hook runs at its point of the
    step, after the layout's own work there; the defaults do nothing."""

    def begin(self, layout: Layout, run: Any) -> None:
        """At the end of setup (``run``: the engine's run state, ``plait.engine.run_access.RunAccess``)."""

    def after_finish(self, layout: Layout) -> None:
        """After the gradients are synchronised inside the layout."""

    def commit(self, layout: Layout) -> bool:
        """Whether the step's update may be applied (False: skipped like a non-finite one)."""
        return True

    def after_step(self, layout: Layout) -> None:
        """After every optimizer step, stepped or skipped."""

    def evaluation(self, layout: Layout) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def state(self, layout: Layout, model_sd: dict, optim_sd: dict) -> tuple[dict, dict]:
        return model_sd, optim_sd

    def load(self, layout: Layout, model_sd: dict, optim_sd: dict) -> tuple[dict, dict]:
        return model_sd, optim_sd

    def after_load(self, layout: Layout) -> None:
        """After a checkpoint's collective."""

    def entries(self, layout: Layout, entries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return entries

    def step_metrics(self) -> dict[str, Any]:
        return {}

    def report(self) -> dict[str, Any]:
        """The driver's blocks of the run summary."""
        return {}

    def describe(self, inner: str) -> str:
        return inner

    def close(self) -> None:
        """At the end of the run."""
