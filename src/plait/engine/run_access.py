"""What a layout's driver may read and restore of the engine's run (``Layout.begin``): a replica that heals from a live
peer takes the peer's step count, schedule, loss scale and training-loader position with its weights."""

from __future__ import annotations

from typing import Any


class RunAccess:
    """The run state of one ``Plait`` (its stepper's ``run_state``, with the training loader ``setup_dataloader``
    made last), and its restoration; a loader made after a restoration starts at the restored position."""

    def __init__(self, plait: Any) -> None:
        self._plait = plait

    @property
    def steps(self) -> int:
        """The optimizer steps taken (a host counter: nothing is read or gathered)."""
        return self._plait.stepper.steps

    def state(self) -> dict[str, Any]:
        """The step count, schedule, loss scale, hyperparameters and the training loader's position."""
        p = self._plait
        return p.stepper.run_state(None, p.train_loader)

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (``state()`` of a live peer); its loader position goes to the training loader now,
        or to the one ``setup_dataloader`` makes next."""
        p = self._plait
        shared = dict(state)
        loader = p.train_loader
        if loader is None:
            p.pending_loader_state, shared["dataloader"] = shared.get("dataloader"), None
        elif shared.get("dataloader") is None:  # the peer trains from data of its own: nothing to move
            loader = None
        p.stepper.restore(shared, None, loader, "a live replica's state")
