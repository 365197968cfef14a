"""The smallest change that makes a layout fit, for the error ``plait simulate`` raises when it does not.

Tried in order of how little they change the run: activation checkpointing (selective, then full), a smaller
micro-batch (same
global batch, more accumulation), a higher ZeRO stage, more tensor parallelism (within a node), deeper
pipelining, twice the devices. Each candidate goes through the trainer's checks and a fresh
simulation; the first that fits is named with its predicted peak.
"""

from __future__ import annotations

import copy
from typing import Any

from plait.config import Config, ConfigError
from plait.plan.configured import simulate_config


def _candidates(cfg: Config, profile: Any, world: int, micro: int) -> list[tuple[str, Config, int]]:
    """The changes to try, in order; ``micro``: the simulated layout's micro-batch (``train.micro_batch_size``
    resolved)."""
    out = []
    p, t = cfg.parallel, cfg.train

    def variant(text: str, world_: int = world, **changes: Any) -> None:
        c = copy.deepcopy(cfg)
        for dotted, value in changes.items():
            section, key = dotted.split("__")
            setattr(getattr(c, section), key, value)
        out.append((text, c, world_))

    if t.activation_checkpointing in ("none", "every_k"):  # recompute the cheap operators before whole blocks
        variant("--train.activation_checkpointing=selective", train__activation_checkpointing="selective")
    if t.activation_checkpointing != "full":
        variant("--train.activation_checkpointing=full", train__activation_checkpointing="full")
    if micro > 1 and micro % 2 == 0:
        variant(f"--train.micro_batch_size={micro // 2}", train__micro_batch_size=micro // 2)
    for zero in range(p.zero + 1, 4):
        variant(f"--parallel.zero={zero}", parallel__zero=zero)
    per_node = profile.devices_per_node if profile.kind == "gpu" else world
    if p.tp * 2 <= per_node:
        variant(f"--parallel.tp={p.tp * 2}", parallel__tp=p.tp * 2, parallel__dp=0)
    variant(f"--parallel.pp={p.pp * 2}", parallel__pp=p.pp * 2, parallel__dp=0)
    variant(f"twice the devices ({2 * world})", 2 * world, parallel__dp=0, parallel__nproc=2 * world)
    return out


def smallest_fix(sim: Any, cfg: Config, profile: Any, models: Any = None) -> str:
    """One message: what the layout needs, what the device offers, and the smallest change that fits
    (``models``: ``plait.recipes``, for a model other than plait's GPT)."""
    lay = sim.work.layout
    worst = max(sim.memory.values(), key=lambda m: m.total)
    head = (f"layout {lay.describe()} needs {worst.total / 2**30:.2f} GiB on its fullest rank (model states "
            f"{worst.model_states / 2**30:.2f}, activations {worst.activations / 2**30:.2f}, buffers "
            f"{worst.buffers / 2**30:.2f}) but {profile.name} has {profile.usable_memory_bytes / 2**30:.2f} GiB usable")
    for text, candidate, world in _candidates(cfg, profile, lay.world, lay.micro_batch_size):
        try:
            nodes = 0
            if world != lay.world and profile.kind == "gpu":
                nodes = max(1, world // sim.cluster.devices_per_node)
            candidate.parallel.nproc = world
            trial = simulate_config(candidate, profile, nodes=nodes, gpus_per_node=sim.cluster.devices_per_node
                                    if nodes else 0, attention=sim.work.attention, stack=sim.work.stack,
                                    derive_tp=False, models=models)
        except ConfigError:
            continue
        if trial.fits():
            return f"{head}; smallest change that fits: {text} (peak {trial.peak_memory() / 2**30:.2f} GiB)"
    return f"{head}; no single change fits: use plait plan --gpus N to search layouts and device counts"
