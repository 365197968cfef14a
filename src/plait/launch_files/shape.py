"""What both launch files share: the job's shape (a fixed node count, or an elastic range), the SLURM job's
settings, and the grace between a scheduler's warning and its kill, sized from the run's own timings."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from plait.config import ConfigError

# Seconds of warning when the run has no timings of its own: what the first sbatch scripts gave (TERM@120), enough
# for the save of a model of a few billion parameters on a parallel file system.
DEFAULT_GRACE_S = 120
# Over the slowest step and save: twice their sum (a save of the preemption step runs beside a loaded file system)
# and this many seconds for the processes to end and the scheduler to see it.
GRACE_MARGIN_S = 30
MIN_GRACE_S = 60


@dataclass(frozen=True)
class Cluster:
    """The shape of the job: ``nodes`` x ``procs_per_node`` worker processes, ``gpus_per_node`` GPUs each node
    (one process per GPU; 0 for CPU processes); ``min_nodes`` < ``nodes`` for an elastic range."""

    nodes: int
    gpus_per_node: int
    procs_per_node: int
    min_nodes: int = 0

    def __post_init__(self) -> None:
        if not self.min_nodes:
            object.__setattr__(self, "min_nodes", self.nodes)

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def elastic(self) -> bool:
        return self.min_nodes < self.nodes

    def node_counts(self) -> range:
        return range(self.min_nodes, self.nodes + 1)


def node_range(text: str | int) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` (torchrun's spelling) -> (min, max)."""
    lo, _, hi = str(text).partition(":")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise ConfigError(f"--nodes takes N or MIN:MAX, e.g. 4 or 2:4; got {text!r}") from None
    if low < 1 or high < low:
        raise ConfigError(f"--nodes must be at least 1, with MIN <= MAX; got {text!r}")
    return low, high


def cluster(nodes: int | str, gpus_per_node: int, procs_per_node: int | None) -> Cluster:
    """Check the shape: a process per GPU, or ``procs_per_node`` CPU processes without GPUs."""
    low, high = node_range(nodes)
    if gpus_per_node < 0:
        raise ConfigError(f"--gpus-per-node must be 0 (CPU processes) or more; got {gpus_per_node}")
    if gpus_per_node > 0:
        if procs_per_node not in (None, gpus_per_node):
            raise ConfigError(f"plait runs one process per GPU: --procs-per-node {procs_per_node} does not match "
                              f"--gpus-per-node {gpus_per_node}; leave --procs-per-node out")
        return Cluster(high, gpus_per_node, gpus_per_node, low)
    procs = 1 if procs_per_node is None else procs_per_node
    if procs < 1:
        raise ConfigError(f"--procs-per-node must be at least 1; got {procs}")
    return Cluster(high, 0, procs, low)


@dataclass
class SlurmJob:
    """The settings of one sbatch script besides its shape (``[launch]`` and the command line's flags)."""

    name: str
    max_restarts: int = 0
    grace_s: int = DEFAULT_GRACE_S
    grace_why: str = "default"
    partition: str = ""
    qos: str = ""
    account: str = ""
    time_limit: str = ""
    cpus_per_task: int | None = None
    array: list[list[str]] = field(default_factory=list)  # each task's config changes, as words


def run_timings(run_dir: Path) -> tuple[float, float] | None:
    """(slowest step, slowest save) in seconds from a run directory's goodput ledger, or None without both.
    A save is its blocking time plus, for an asynchronous one, the wait for its completion."""
    from plait.fault.goodput import LEDGER

    path = Path(run_dir) / LEDGER
    if not path.is_file():
        return None
    steps, saves = [], []
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "step":
            steps.append(float(event.get("s", 0.0)))
        elif event.get("event") in ("save", "save_done"):
            saves.append(float(event.get("blocking_s", 0.0)))
    if not steps or not saves:
        return None
    return max(steps), max(saves)


def grace(grace_s: int, timings_from: str | Path | None) -> tuple[int, str]:
    """Seconds between the scheduler's warning and its kill, and how they were chosen: ``launch.grace_s`` when set;
    else 2 x (slowest step + slowest save) + ``GRACE_MARGIN_S`` of the run in ``timings_from`` (at least
    ``MIN_GRACE_S``); else ``DEFAULT_GRACE_S``."""
    if grace_s < 0:
        raise ConfigError(f"launch.grace_s must be 0 (measured) or more seconds; got {grace_s}")
    if grace_s:
        return grace_s, "launch.grace_s"
    timings = run_timings(Path(timings_from)) if timings_from else None
    if timings is None:
        where = f" in {timings_from}" if timings_from else ""
        return DEFAULT_GRACE_S, f"the default: no step and save timings{where}"
    step_s, save_s = timings
    seconds = max(MIN_GRACE_S, math.ceil(2 * (step_s + save_s)) + GRACE_MARGIN_S)
    return seconds, (f"2 x (slowest step {step_s:.2f} s + slowest save {save_s:.2f} s) + {GRACE_MARGIN_S} s, "
                     f"at least {MIN_GRACE_S} s, measured in {timings_from}")
