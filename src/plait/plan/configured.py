"""The simulator and planner on a plait config: the config checked by the trainer's own rules, the model's
shape read from it (or from the model built on the meta device), and the real code's tensor-parallel
collectives and operator counts (``plait.plan.record``), priced by the pure cost model (``plait.plan.simulate``,
``plait.plan.workload``). ``workload_from_config`` resolves what the trainer resolves: dp inferred from the
world, the schedule's natural virtual stages, the accumulation steps."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

from plait.config import Config, ConfigError
from plait.plan.hardware import HardwareProfile
from plait.plan.record import operator_counts, optimizer_traffic, shape_from_config, tp_collectives
from plait.plan.shapes import ModelShape
from plait.plan.simulate import Cluster, Simulation, simulate
from plait.plan.workload import Workload, layout_from_config
from plait.validate import validate


def validated(cfg: Config, world: int, memory_only: bool = False, models: Any = None) -> Config:
    """A copy of ``cfg`` checked for ``world`` ranks by the trainer's own checks, dp resolved: the layout's
    rules (``plait.validate``) and the model's own check of its shape against the degrees
    (``models.check_model``: ``plait.recipes``, where the caller passes it). The
    data set is not needed to simulate and is not checked. Offload is modelled for device memory only
    (``memory_only``: the host-side optimizer step and the copies to and from the host are not timed), so
    a timing of an offloaded layout is refused."""
    cfg = copy.deepcopy(cfg)
    if cfg.parallel.offload != "none" and not memory_only:
        raise ConfigError(f"the simulator does not model parallel.offload={cfg.parallel.offload}; set "
                          "parallel.offload=none (plait plan memory predicts its device memory)")
    return validate(cfg, world, models.check_model if models is not None else None)


def workload_from_config(cfg: Config, world: int, *, shape: ModelShape | None = None, attention: str = "flash",
                         stack: str = "plait", recompute: str | None = None, memory_only: bool = False,
                         models: Any = None) -> Workload:
    """The workload ``plait train`` would run with ``cfg`` on ``world`` ranks. ``recompute`` overrides
    ``train.activation_checkpointing`` (with another ``stack``: that stack's recomputation); ``models``
    (``plait.recipes``) builds and checks a model other than plait's GPT."""
    cfg = validated(cfg, world, memory_only, models)
    shape = shape or shape_from_config(cfg, models)
    layout = layout_from_config(cfg)
    if recompute is not None:
        layout = replace(layout, recompute=recompute)
    if stack == "plait" and (cfg.model.factory or cfg.model.name != "gpt"):  # plait's loss parallelism is its
        layout = replace(layout, loss_parallel=False)  # GPT's; a Hugging Face head gathers the whole vocabulary
    work = Workload(shape=shape, layout=layout, global_batch=cfg.train.global_batch_size,
                    precision=cfg.train.precision, attention=attention, stack=stack,
                    fused_optimizer=cfg.optim.fused is not False, grad_clip=cfg.optim.grad_clip > 0)
    work.check()
    return work


def simulate_config(cfg: Config, profile: HardwareProfile, *, nodes: int = 0, gpus_per_node: int = 0,
                    attention: str = "auto", stack: str = "plait", recompute: str | None = None,
                    derive_tp: bool = True, memory_only: bool = False, models: Any = None) -> Simulation:
    """Predict ``plait train cfg`` on ``nodes x gpus_per_node`` devices (default: ``parallel.nproc``
    ranks); ``models`` (``plait.recipes``) builds and checks a model other than plait's GPT. Raises
    ``ConfigError`` for a layout the trainer would refuse."""
    if nodes > 0:
        gpus_per_node = gpus_per_node or (profile.devices_per_node if profile.kind == "gpu"
                                          else -(-cfg.parallel.nproc // nodes))
        world = nodes * gpus_per_node
    else:
        world = cfg.parallel.nproc
    if attention == "auto":
        attention = "unfused" if stack != "plait" else "flash"
    work = workload_from_config(cfg, world, attention=attention, stack=stack, recompute=recompute,
                                memory_only=memory_only, models=models)
    cluster = Cluster.of(profile, world, nodes, gpus_per_node)
    notes: list[str] = []
    derived = counts = None
    if derive_tp and work.layout.tp > 1:
        try:
            derived = tp_collectives(cfg, work.pipe_micro_batch, models)
            notes.append("tensor-parallel collectives recorded from the real plan on the meta device (fake process "
                         "group)")
        except (RuntimeError, ConfigError) as e:
            notes.append(f"tensor-parallel collectives from the analytic model ({e})")
    if profile.kind == "cpu":
        try:
            counts = operator_counts(cfg, work.pipe_micro_batch, models)
            notes.append("dispatcher operators per block counted on the real model (meta device)")
        except (RuntimeError, ValueError, ConfigError) as e:
            notes.append(f"operator counts unavailable ({e}): per-operator overhead left out")
    return simulate(work, cluster, derived, optimizer_traffic(cfg), notes, counts)
