"""The one composition: any model, any layout, in one order (torchtitan's ``parallelize_*`` is the model).

    topo   = build_topology(cfg, device)                    # degrees + named axes (plait.topology)
    model  = apply_tensor(model, topo, ...)                 # tp / sp      each step: the model in, the model out,
    model  = apply_expert(model, topo, ...)                 # ep           the model unchanged where it does not
    attn   = apply_context(model, topo, ...)                # cp           apply, or a one-line refusal naming the
    model  = apply_checkpointing(model, ...)                # recompute / offload activations                 fix
    model  = apply_compile(model, ...)                      # compile the blocks
    stages = WholeModel(policy.wrap(model)) | PipelineStages(model, ..., policy)   # pp: the split
    policy.attach(stages)                                   # ONE gradient-sync policy: reducer | DDP | ZeRO-1/2 |
                                                            #   FSDP2/HSDP (plait.parallel.grad_sync), experts beside
    layout = Layout(stages, policy, experts, split, drivers)   # drivers wrap the step from outside: DiLoCo, replicas

float8 converts the model's linear layers first (before any layout: FSDP2 gathers the float8 weights, tensor
parallelism shards them with torchao's float8 styles, a pipeline splits them into stages). Under DiLoCo the layout
is composed on the topology inside one replica (``Topology.within`` the ``dp_replicate`` axis: the policy and the
experts' sync average over the replica's ranks only) and its driver on the whole run's, whose ``dp_replicate`` axis
holds the replicas. A parameter server is data parallelism with its own consistency: its own layout
(``plait.ps.layout``), composed with nothing.

Besides ``parallelize``, what the engine asks of a config before any model exists: the degrees (``resolve``), the
topology, whether the model runs whole on each rank, whether setup wants a sample micro-batch, why compile must go
block by block, and every dimension's check (``check_layout``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.comm.collectives import Comm
from plait.config import Config, ConfigError, ParallelConfig
from plait.nn.moe import moe_layers
from plait.observe.log import get_logger
from plait.parallel import float8
from plait.parallel.activation_checkpoint import apply_checkpointing
from plait.parallel.capabilities import Driver
from plait.parallel.compile import apply_compile
from plait.parallel.context.split import ContextSplit, apply_context, check_context, route_stages
from plait.parallel.data import sync as data_sync  # noqa: F401 - the built-in policies register themselves
from plait.parallel.data.diloco import DiLoCo, check_diloco, diloco_replicas, replica_degrees_inside, replica_inside
from plait.parallel.expert.apply import apply_expert, check_expert
from plait.parallel.expert.hf import check_hf_experts, check_pipeline_router_loss
from plait.parallel.expert.sync import ExpertSync
from plait.parallel.fsdp import sync as fsdp_sync  # noqa: F401
from plait.parallel.grad_sync import GradSync, policies
from plait.parallel.layout import Layout
from plait.parallel.meta_init import ModelFacts, materialise
from plait.parallel.model_specs import spec_for
from plait.parallel.pipeline.split import pipeline_adapter, stage_layer_ranges
from plait.parallel.pipeline.stages import PipelineStages, check_pipeline
from plait.parallel.prepare import broadcast_weights, sync_batchnorm
from plait.parallel.replicas.driver import Replicas
from plait.parallel.replicas.topology import check_replicas, group_config, replica_degrees, replica_topology
from plait.parallel.spec import ModelSpec
from plait.parallel.stages import WholeModel
from plait.parallel.tensor.apply import apply_tensor, check_tensor, tp_function
from plait.parallel.tensor.plan import hf_plan, validate_plan
from plait.parallel.units import is_expert
from plait.parallel.zero import sync as zero_sync  # noqa: F401
from plait.plan.schedule import NATURAL_VIRTUAL
from plait.ps.layout import ParameterServer, ps_degrees, ps_layout_topology
from plait.topology import Topology, build_topology, resolve_degrees


def policy_class(cfg: Config | ParallelConfig) -> type[GradSync]:
    """The gradient-sync policy of a config: ``parallel.strategy`` by name, else the one its settings choose."""
    p = cfg.parallel if isinstance(cfg, Config) else cfg
    table = policies()
    if p.strategy != "auto":
        if p.strategy not in table:
            raise ConfigError(f"parallel.strategy={p.strategy!r} is not a registered gradient-sync policy; choose auto "
                              f"or one of {', '.join(sorted(table))}")
        return table[p.strategy]
    for cls in table.values():
        if cls.chosen(p):
            return cls
    raise ConfigError("no gradient-sync policy applies to this [parallel] section; set parallel.strategy")


# -- what a config says before any model exists -----------------------------------------------------
def resolve(cfg: Config, world_size: int) -> dict[str, int]:
    """Mesh degrees for ``world_size`` ranks (a parameter server's workers, or every rank of the replica groups)."""
    if cfg.parallel.mode == "ps":
        return ps_degrees(cfg, world_size)
    if cfg.fault.mode == "replicas":
        return replica_degrees(cfg, world_size)
    return resolve_degrees(cfg, world_size)


def topology(cfg: Config, device: torch.device) -> Topology:
    """This process's topology (its ranks, mesh and groups); collective on every rank."""
    if cfg.parallel.mode == "ps":
        return ps_layout_topology(cfg, device)
    if cfg.fault.mode == "replicas":
        return replica_topology(cfg, device)
    return build_topology(cfg, device)


def model_whole(cfg: Config) -> bool:
    """Whether the user's model runs whole on each rank (not split into pipeline stages)."""
    return cfg.parallel.pp == 1 or cfg.parallel.mode == "ps"


def wants_sample(cfg: Config) -> bool:
    """Whether setup uses a sample micro-batch (a pipeline balancing its stages by measured cost)."""
    return not model_whole(cfg) and cfg.parallel.pp_balance == "cost"


def copies_state_per_rank(cfg: Config) -> bool:
    """Whether every training rank holds its own part of the state a checkpoint saves, so that a copy of it can be
    kept in host memory at each save (``fault.memory_checkpoint``): not under a parameter server, whose servers hold
    the parameters and optimizer states outside the training ranks."""
    return cfg.parallel.mode != "ps"


def compile_blocks_because(cfg: Config) -> str:
    """Why ``train.compile`` compiles this layout's model block by block (empty: the whole model may be one region).
    Context parallelism needs no blocks: dynamo traces its cut and its all-to-all and all-gather attention, and the
    ring attention runs eagerly between the graphs (``plait.parallel.context.split``'s docstring)."""
    p = cfg.parallel
    if cfg.train.activation_checkpointing != "none":
        return "activation checkpointing recomputes each block"
    if cfg.train.activation_offload:
        return "activation offload opens each block's saved-tensor hooks around it"
    if p.mode == "ps":
        return ""
    if p.pp > 1:
        return "the model is split into pipeline stages"
    if p.tp > 1:
        return "tensor parallelism compiles its DTensor blocks one by one"
    return policy_class(cfg).compile_blocks_because


def check_layout(cfg: Config, degrees: dict[str, int]) -> None:
    """Every dimension's, policy's and driver's own checks (each checks the settings it owns), before any process
    starts."""
    for check in (check_replicas, check_diloco):  # the drivers first: they say what a replica can hold
        check(cfg, degrees)
    degrees = replica_degrees_inside(cfg, degrees)  # DiLoCo: each replica's own layout
    for cls in policies().values():
        cls.check(cfg, degrees)
    for check in (check_tensor, check_pipeline, check_expert, check_context):
        check(cfg, degrees)


# -- the composition --------------------------------------------------------------------------------
def check_model(model: nn.Module, topo: Topology, p: ParallelConfig, spec: ModelSpec) -> None:
    """What can be checked about the model against the layout without communicating: a tensor-parallel
    plan (every pattern matches, kinds and widths and heads divide), a pipeline split (an adapter exists,
    the named split points are layers, every stage gets one). Raises a ``ConfigError`` subclass; every rank
    raises the same one, before any collective."""
    tp, pp = topo.degree("tp"), topo.degree("pp")
    if topo.ep > 1 and not moe_layers(model):  # a Hugging Face MoE model: its blocks recognised, or an error
        check_hf_experts(model, topo.ep)
    if tp > 1 and spec.parallelize_fn is None:
        fn = tp_function(model, p, spec)  # raises when no plan applies
        plan = spec.tp_plan if isinstance(spec.tp_plan, dict) else None
        if hasattr(fn, "check"):
            fn.check(model, tp)
        else:
            if plan is None and not _registered(model):
                plan = hf_plan(model)
            if plan:
                validate_plan(model, plan, tp)
    if pp > 1:
        check_pipeline_router_loss(model)
    if pp > 1 and spec.stage_fn is None:
        stages = pp * (p.pp_virtual_stages or NATURAL_VIRTUAL.get(p.pp_schedule, 1))
        stage_layer_ranges(model, pipeline_adapter(model), stages, spec.pp_split, None,
                           embedding_unit=p.pp_split_embedding, head_unit=p.pp_split_head)


def _registered(model: nn.Module) -> bool:
    return getattr(spec_for(model), "parallelize", None) is not None


def _policy(cfg: Config, topo: Topology, comm: Comm) -> GradSync:
    """The policy over the ranks whose gradients are averaged every step: every data-parallel rank (x cp) of
    ``topo`` (under DiLoCo, the topology inside one replica: its outer loop averages the replicas)."""
    return policy_class(cfg)(cfg, topo, comm, topo.group("dp_cp"), topo.degree("dp_cp"),
                             topo.fsdp_mesh if topo.mesh is not None else None)


def _drivers(cfg: Config, topo: Topology, comm: Comm, model: nn.Module) -> list[Driver]:
    """The drivers around the layout; ``topo`` is the whole run's (DiLoCo's replicas are its ``dp_replicate``
    axis; under torchft replica groups, the groups themselves)."""
    drivers: list[Driver] = []
    if cfg.parallel.sync == "diloco":
        group, replicas = diloco_replicas(cfg, topo)
        drivers.append(DiLoCo(cfg, comm, group, replicas))
    if cfg.fault.mode == "replicas":
        drivers.append(Replicas(cfg, topo, model))
    return drivers


def parallelize(model: nn.Module, topo: Topology, cfg: Config, comm: Comm, spec: ModelSpec) -> Layout:
    """The layout around ``model`` (on this rank's device), in the order of the module docstring. The model is
    checked against the layout before any collective; then rank 0's weights are broadcast (a meta model has none:
    each rank fills its part later, ``LayoutState.prepare_weights``)."""
    if cfg.train.precision == "fp8":  # before any layout: tp shards, pp splits, FSDP2 gathers the Float8Linears
        float8.convert(model, topo.device, fsdp=cfg.parallel.zero == 3, logger=get_logger(topo.rank))
    if cfg.parallel.mode == "ps":
        return ParameterServer(model, cfg, topo, comm)
    if cfg.fault.mode == "replicas":  # the layout inside one group: its ranks, its data-parallel degree
        cfg, topo = group_config(cfg), topo.group_topology()
    whole, topo = topo, replica_inside(cfg, topo)  # DiLoCo: the layout inside one replica
    p = cfg.parallel
    check_model(model, topo, p, spec)
    facts = ModelFacts.of(model)
    if not facts.meta:
        broadcast_weights(model, comm, topo.world_size)
    policy = _policy(cfg, topo, comm)
    if p.sync_batchnorm and policy.ranks > 1:
        model = sync_batchnorm(model, policy.group, topo.device)
    model = apply_tensor(model, topo, p, spec)
    model = apply_expert(model, topo, cfg.moe.dispatcher, p.sequence_parallel)
    attention = apply_context(model, topo, cfg, whole=p.pp == 1)
    model = apply_checkpointing(model, cfg.train)
    model = apply_compile(model, cfg.train, spec.compile)
    stages: Any
    if p.pp > 1:
        stages = PipelineStages(model, topo, cfg, spec, policy)
        if attention is not None:
            route_stages(stages.model, attention)
    else:
        if facts.meta and not policy.shards_meta:  # allocated whole; FSDP2 allocates each rank's shards itself
            materialise(model, topo.device)
        stages = WholeModel(policy.wrap(model, None) if policy.wraps_modules else model,
                            cfg.train.compute_precision, topo.device)
    if facts.meta:
        materialise(stages.model, topo.device)
    named = stages.named_parameters()
    policy.attach(stages.holder, [q for _, q in named if q.requires_grad and not is_expert(q)])
    experts = ExpertSync(policy, named, [q for _, q in named if is_expert(q)]) if topo.ep > 1 else None
    if experts is not None and p.pp > 1:  # a schedule step keeps the experts' reduction for finish, as the policy's
        stages.beside.append(experts)
    split = ContextSplit(attention, topo, stages) if attention is not None else None
    return Layout(stages, policy, cfg, topo, comm, facts, experts, split, _drivers(cfg, whole, comm, stages.model))
