"""The small collectives of ``Plait`` (a mixin: ``reduce``, ``gather``, ``barrier``) over the training ranks, each
preceded by the layout's ``before_collective`` where a part has its own pace (a parameter server's worker parks a backup
version), and ``explain``, which turns a collective's timeout or lost peer into the error naming the ranks that did not
arrive."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from plait.comm.guard import CollectiveTimeout
from plait.parallel.capabilities import OwnPace
from plait.parallel.errors import PlaitError
from plait.runtime.dist import write_error


def explained(method: Any) -> Any:
    """A collective API method whose backend timeout or lost peer becomes the watchdog's error naming the
    phase and the ranks that did not arrive (raised in the user's loop, where no trainer catches it)."""
    import functools

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as e:
            named = self.explain(e)
            if named is e:
                raise
            raise named from e
    return wrapper


class SmallCollectives:
    """``reduce``, ``gather`` and ``barrier`` for ``Plait`` (which provides the attributes used here)."""

    strategy: Any
    comm: Any
    topology: Any
    group: Any
    device: torch.device
    world_size: int

    watchdog: Any
    stepper: Any
    metrics: Any
    rank: int
    files: Any

    def _meet(self) -> None:
        pace = self.strategy.capability(OwnPace) if self.strategy is not None else None
        if pace is not None:
            pace.before_collective()

    @explained
    def reduce(self, value: float | torch.Tensor, op: str = "mean", over: str = "dp") -> Any:
        """``value`` summed or averaged over the data-parallel ranks (``over="dp"``) or all ranks
        (``"world"``); a float for a float. Every rank of the group must call it. Under ``fault.mode=replicas``
        each replica group is a world of its own: both reduce over this group's ranks."""
        if op not in ("mean", "sum") or over not in ("dp", "world"):
            raise PlaitError("reduce(op='mean'|'sum', over='dp'|'world')")
        t = torch.as_tensor(value, dtype=torch.float64).clone().reshape(-1)
        size = self.topology.dp_reachable if over == "dp" else self.world_size
        if size > 1:
            self._meet()
            self.comm.all_reduce_sum(t, self.topology.dp_group if over == "dp" else self.group,
                                     name=f"reduce over {over}")
        if op == "mean":
            t /= size
        if isinstance(value, torch.Tensor):
            return t.reshape(value.shape)
        return float(t[0])

    @explained
    def gather(self, values: list[float]) -> list[list[float]]:
        """Every rank's ``values`` as a list indexed by global rank; every rank must call it with the same
        number of values. Collective over the world: one all-gather of ``len(values)`` float64 per rank."""
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        if self.world_size == 1:
            return [t.tolist()]
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self._meet()
        dist.all_gather(out, t, group=self.group)
        return [o.tolist() for o in out]

    @explained
    def barrier(self) -> None:
        if self.world_size > 1:
            self._meet()
            dist.barrier(group=self.group)

    def explain(self, exc: BaseException) -> BaseException:
        """A backend timeout or lost peer as the error naming the ranks that did not arrive; the ranks it
        names that run on this host and are stuck (stopped, hung) are ended, so the attempt ends within
        seconds and the restart policy applies (``StepWatchdog.end_stuck_peers``)."""
        with contextlib.suppress(Exception):  # the launcher's restart decision reads the exact step count
            self.stepper.write_progress()
        with contextlib.suppress(Exception):  # what the trackers buffer between flushes
            self.metrics.flush()
        named = self.watchdog.explain(exc)
        if isinstance(named, CollectiveTimeout) and named.ranks:
            # This rank's report first: the peers ended next fail at once, and the launcher names the
            # earliest report as the cause.
            write_error(named, self.rank, self.files.error_dir)
            self.watchdog.end_stuck_peers(named.ranks)
        return named
