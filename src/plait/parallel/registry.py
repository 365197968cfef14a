"""The registry of strategies with plait's built-ins in it, and the two things the engine asks of it:
which strategy trains a config (``select``), and the strategy built around a model (``build``).

Built-in strategies register themselves where they are defined (``@register_strategy``); importing this
module imports them all, so ``registered()`` always holds them. A package or a test adds its own with the
same decorator (``plait.parallel.strategy.register_strategy``), with no change here.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from plait.comm.collectives import Comm
from plait.config import Config, ConfigError, ParallelConfig
from plait.parallel.apply import ModelSpec
from plait.parallel.context import strategy as context_strategy  # noqa: F401
from plait.parallel.data import diloco  # noqa: F401 - the strategies register themselves
from plait.parallel.data import strategy as data_strategy  # noqa: F401
from plait.parallel.expert import strategy as expert_strategy  # noqa: F401
from plait.parallel.fsdp import strategy as fsdp_strategy  # noqa: F401
from plait.parallel.pipeline import sharded as pipeline_sharded  # noqa: F401
from plait.parallel.pipeline import strategy as pipeline_strategy  # noqa: F401
from plait.parallel.replicas import strategy as replicas_strategy  # noqa: F401
from plait.parallel.strategy import Strategy, strategy_table
from plait.parallel.tensor import strategy as tensor_strategy  # noqa: F401
from plait.parallel.wrapper import Wrapper
from plait.parallel.zero import strategy as zero_strategy  # noqa: F401
from plait.ps import strategy as ps_strategy  # noqa: F401 - registers the parameter server
from plait.topology import Topology


def registered() -> list[type[Strategy]]:
    """Every registered strategy (highest priority first), then every wrapper."""
    strategies, wrappers = strategy_table()
    return sorted(strategies.values(), key=lambda c: -c.priority) + list(wrappers.values())


def select(cfg: Config | ParallelConfig) -> type[Strategy]:
    """The strategy class for ``cfg``: ``parallel.strategy`` by name, or the highest-priority one that applies
    (``Strategy.chosen_for``: given the whole config, a strategy may be chosen by a setting outside [parallel])."""
    p = cfg.parallel if isinstance(cfg, Config) else cfg
    strategies, _ = strategy_table()
    if p.strategy != "auto":
        if p.strategy not in strategies:
            raise ConfigError(f"parallel.strategy={p.strategy!r} is not a registered strategy; choose auto or one of "
                              f"{', '.join(sorted(strategies))}")
        return strategies[p.strategy]
    for cls in sorted(strategies.values(), key=lambda c: -c.priority):
        if cls.chosen_for(cfg):
            return cls
    raise ConfigError("no registered strategy applies to this [parallel] section; set parallel.strategy")


def wrappers_for(p: ParallelConfig) -> list[type[Wrapper]]:
    """The wrapper classes composed around the chosen strategy for ``p``, innermost first."""
    _, wrappers = strategy_table()
    return [c for c in wrappers.values() if c.wraps(p)]


def check_all(cfg: Config, degrees: dict[str, int]) -> None:
    """Every registered strategy's and wrapper's own checks (each checks the settings it owns)."""
    for cls in registered():
        cls.check(cfg, degrees)


def build(cls: type[Strategy], model: nn.Module, topo: Topology, cfg: Config, comm: Comm, spec: ModelSpec) -> Any:
    """``cls`` applied to ``model`` (``Strategy.apply``) over the strategies' view of the topology
    (``Topology.strategy_view``), then the wrappers the config asks for around it."""
    strategy = cls.apply(model, topo.strategy_view(), cfg, comm, spec)
    for wrapper in wrappers_for(cfg.parallel):
        strategy = wrapper(strategy)
    return strategy
