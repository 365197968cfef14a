"""``plait plan``: enumerate the layouts of a model on N devices, prune, rank by simulated step time.

Enumerated: tensor parallelism ``tp`` (within a node: a divisor of the devices per node), sequence
parallelism with it, pipeline depth ``pp`` and schedule (gpipe, 1f1b, interleaved with 2 or 4 virtual
stages per rank, zbv), ZeRO stage 0-3 (with pipelining too: ZeRO-1/2 or FSDP per stage), at ZeRO-3 the
hybrid-sharding group ``dp_shard`` (every divisor of dp between 1 and dp: HSDP, sharded inside groups of
that many ranks and replicated across them), the micro-batch (per forward without pipelining; per pipeline
micro-batch with it, one schedule step per optimizer step), activation checkpointing (none, selective: the
matmuls' and attention's outputs kept, the rest recomputed; full);
``dp`` is what remains; for a mixture of experts the expert-parallel degree ``ep`` (a divisor of dp and
of the experts).

ZeRO-1/2 compose with tensor parallelism (the optimizer states of each tp shard sharded over its dp group). Context
parallelism (``cp``: the sequence split over cp ranks inside tp, priced as ``Workload.rank_view`` plus its
collectives) is enumerated for sequences of ``LONG_SEQUENCE`` tokens or more at every degree that divides the
devices left by tp and splits the sequence into 2 x cp chunks, with every pipeline depth that divides what is left
(each stage's blocks on a cp shard), with experts (a cp rank's tokens dispatched over ep, ep a divisor of dp) and
with hybrid sharding (shard groups of ``dp_shard x cp`` ranks).

What the planner does not choose, because it changes what is trained: the precision (``base.precision``: under
fp8 every layout is priced with float8 Linears, on a profile with an fp8 peak) and DiLoCo (``base.layout.sync =
"diloco"`` with its H and fragments: the planner then enumerates the data-parallel ranks per replica,
``dp_shard``, at every ZeRO stage, and prices each layout's outer synchronisation).

Pruned, each family with its reason: degrees that do not divide the devices, the heads, the MLP width,
the vocabulary or the sequence; a global batch that does not split over dp; combinations plait refuses
(``plait.parallel.expert.dispatch``: ZeRO-3 with ep whose expert weights do not split evenly over the dp x cp /
ep ranks holding the same experts; the planner also leaves MoE models with tp, pp, hybrid sharding or cp out of its
search, though plait trains them); layouts whose predicted peak memory exceeds the device's usable memory (with the
bytes).

Ranked in two passes: a closed-form screen (``estimate``: the stages' summed costs, the pipeline bubble
``(p-1)/(v m)``, exposed gradient communication, the optimizer), then the full simulation
(``plait.plan.simulate``) of the best screened candidates and of each pipeline depth's best. Layouts whose
simulated step times lie within ``TOLERANCE`` (15%) of the fastest are not told apart: 15% is the accuracy
the simulator is held to on published measurements (Narayanan et al. 2021, Korthikanti et al. 2022; its
largest error there is about 10%), so a smaller predicted difference is not evidence. Among them the
planner prefers the fewest pipeline stages (less activation memory on the first stage, fewer
point-to-point hops, no bubble to lose to a straggler; Narayanan et al.'s rule: tensor parallelism up to
a node, then pipelining), then the fastest; a ZeRO-3 layout in the band that is not itself the fastest
comes after the band's others (``preference``). Within the band fewer cp ranks are preferred after fewer pipeline
stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from plait.config import Config, ConfigError
from plait.plan.hardware import HardwareProfile
from plait.plan.layouts import hsdp_gradient_seconds
from plait.plan.network import collective_time, group_span
from plait.plan.params import param_list
from plait.plan.rank_memory import model_states
from plait.plan.schedule import in_flight as schedule_in_flight
from plait.plan.shapes import ModelShape
from plait.plan.simulate import Simulation, simulate
from plait.plan.stages import Cluster, StageModel
from plait.plan.workload import Layout, Workload

MICRO_BATCHES = (1, 2, 4, 8, 16)
LONG_SEQUENCE = 8192  # context parallelism is enumerated from this sequence length on (module docstring)
TOLERANCE = 0.15  # the simulator's accuracy target on published rows (module docstring)
SCHEDULE_CHOICES = (("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("interleaved", 4), ("zbv", 2))


@dataclass(frozen=True)
class Space:
    """What the planner may choose from (the defaults: everything plait runs)."""

    zeros: tuple[int, ...] = (0, 1, 2, 3)
    recomputes: tuple[str, ...] = ("none", "selective", "full")
    schedules: tuple[str, ...] = ("1f1b", "gpipe", "interleaved", "zbv")
    micro_batches: tuple[int, ...] = MICRO_BATCHES
    sequence_parallel: tuple[bool, ...] = (False, True)
    even_stages: bool = False  # only pipeline depths that split the layers evenly (Megatron-LM's rule)
    hybrid: bool = True  # at ZeRO-3, also the hybrid-sharding groups (dp_shard) between 1 and dp


@dataclass
class Plan:
    """The planner's answer: ranked simulations, what was pruned and why, and how many were screened."""

    ranked: list[Simulation]
    pruned: dict[str, str] = field(default_factory=dict)
    screened: int = 0

    @property
    def best(self) -> Simulation:
        return self.ranked[0]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _experts_shard(shape: ModelShape, zero: int, dp: int, ep: int) -> bool:
    """Whether plait runs expert parallelism ``ep`` under ZeRO stage ``zero`` over ``dp`` ranks (``dp x cp``: the
    ranks gradients are averaged over): always, except ZeRO-3 with experts left to shard (``dp > ep``), whose FSDP2
    units split each expert weight's dim 1 evenly."""
    edp = dp // ep
    return ep == 1 or zero != 3 or edp == 1 or (shape.d_model % edp == 0 and shape.expert_hidden % edp == 0)


def _shape_reason(shape: ModelShape, tp: int) -> str | None:
    for what, value in (("n_head", shape.n_head), ("n_kv_head", shape.n_kv_head), ("MLP width", shape.d_ff),
                        ("vocab_size", shape.vocab_size)):
        if value % tp:
            return f"{what}={value} does not divide by tp={tp}"
    return None


def _layouts(shape: ModelShape, batch: int, gpus: int, per_node: int, pruned: dict[str, str],
             space: Space, diloco: bool = False) -> list[Layout]:
    """Every layout to screen (``diloco``: ``dp_shard`` is the data-parallel ranks of one DiLoCo replica); families
    that cannot run go to ``pruned`` with their reason."""
    out = []
    for tp in _divisors(gpus):
        if tp > per_node or per_node % tp:
            pruned[f"tp={tp}"] = f"tensor parallelism beyond a node of {per_node} devices (every layer's " \
                                 "collectives would cross the network)"
            continue
        if (reason := _shape_reason(shape, tp)) is not None:
            pruned[f"tp={tp}"] = reason
            continue
        for cp, pp in [(c, p) for c in _context_degrees(shape, gpus // tp) for p in _divisors(gpus // (tp * c))]:
            dp = gpus // (tp * pp * cp)
            if shape.num_experts and tp * pp > 1:
                pruned[f"tp={tp} pp={pp}"] = ("the planner does not price MoE layers under tp or pp (plait trains "
                                              "them: MoE blocks whole on every tp rank, each stage's experts over "
                                              "ep); it searches tp=pp=1")
                continue
            if pp > shape.n_layer:
                pruned[f"pp={pp}"] = f"more pipeline stages than the {shape.n_layer} layers"
                continue
            if space.even_stages and shape.n_layer % pp:
                pruned[f"pp={pp}"] = f"does not split the {shape.n_layer} layers evenly"
                continue
            if batch % dp:
                pruned[f"dp={dp} (tp={tp}, pp={pp})"] = f"global batch {batch} does not split over dp={dp}"
                continue
            out += _variants(shape, batch, tp, pp, dp, cp, pruned, space, diloco)
    return out


def _context_degrees(shape: ModelShape, devices: int) -> list[int]:
    """The context-parallel degrees to enumerate on ``devices`` ranks (module docstring): 1, and for a long
    sequence every divisor that splits it into 2 x cp equal chunks."""
    if shape.seq_len < LONG_SEQUENCE:
        return [1]
    return [c for c in _divisors(devices) if shape.seq_len % (2 * c) == 0]


def _sharding(shape: ModelShape, dp: int, cp: int, ep: int, space: Space, diloco: bool) -> list[tuple[int, int]]:
    """(ZeRO stage, ``dp_shard``) pairs: ZeRO-3 over every data-parallel rank (``dp_shard`` 1) or hybrid (shard
    groups of n ranks, dp / n replicas); under DiLoCo, n data-parallel ranks per replica at every stage (ZeRO over
    a replica's ``n x ep x cp`` ranks, so over more than one)."""
    if diloco:
        return [(z, n) for n in _divisors(dp // ep) for z in space.zeros if z == 0 or n * ep * cp > 1]
    zeros = [z for z in space.zeros if z == 0 or dp * cp > 1]
    shards = [1] + ([n for n in _divisors(dp) if 1 < n < dp] if space.hybrid and not shape.num_experts else [])
    return [(z, n) for z in zeros for n in (shards if z == 3 else [1])]


def _variants(shape: ModelShape, batch: int, tp: int, pp: int, dp: int, cp: int, pruned: dict[str, str],
              space: Space, diloco: bool = False) -> list[Layout]:
    per_replica = batch // dp
    sps = [sp for sp in space.sequence_parallel if not sp or (tp > 1 and shape.seq_len % tp == 0)]
    eps = [e for e in _divisors(dp) if shape.num_experts and shape.num_experts % e == 0] or [1]
    out = []
    for sp, ep in [(sp, ep) for sp in sps for ep in eps]:
        for zero, dp_shard in _sharding(shape, dp, cp, ep, space, diloco):
            if not _experts_shard(shape, zero, dp * cp, ep):
                continue
            for recompute in space.recomputes:
                if pp == 1:
                    out += [Layout(dp=dp, tp=tp, pp=1, zero=zero, sp=sp, micro_batch_size=mb, recompute=recompute,
                                   ep=ep, dp_shard=dp_shard, cp=cp)
                            for mb in space.micro_batches if per_replica % mb == 0]
                    continue
                for pm in space.micro_batches[:3]:
                    if per_replica % pm:
                        continue
                    m = per_replica // pm
                    for schedule, v in SCHEDULE_CHOICES:
                        if schedule not in space.schedules or pp * v > shape.n_layer or (v > 1 and m < pp):
                            continue
                        if schedule == "interleaved" and m % max(1, m // pp):
                            continue
                        out.append(Layout(dp=dp, tp=tp, pp=pp, zero=zero, sp=sp, schedule=schedule, virtual=v,
                                          microbatches=m, micro_batch_size=per_replica, recompute=recompute,
                                          dp_shard=dp_shard, cp=cp))
    return out


def _model_state_floor(shape: ModelShape, lay: Layout, work: Workload) -> float:
    """Model-state bytes of the heaviest pipeline stage (an equal-layers split), for the memory screen."""
    per = math.ceil(shape.n_layer / lay.pp)
    heaviest = 0.0
    for first, last in ((True, lay.pp == 1), (False, True)) if lay.pp > 1 else ((True, True),):
        layers = range(0, per) if first else range(shape.n_layer - per, shape.n_layer)
        states, _ = model_states(param_list(shape, layers, first=first, last=last, ep=lay.ep), work, shape.n_layer)
        heaviest = max(heaviest, states.model_states)
    return heaviest


def estimate(work: Workload, cluster: Cluster, model: StageModel) -> float:
    """Closed-form step time for screening (see the module docstring)."""
    lay, s = work.layout, work.shape
    n_stages = lay.pp * lay.virtual
    per = math.ceil(s.n_layer / n_stages)
    blocks = sum(model.block(i).total for i in range(s.n_layer))
    stage = per * blocks / s.n_layer + max(model.embed().total, model.head().total)
    if lay.pp == 1:
        compute = work.accumulation * (blocks + model.embed().total + model.head().total)
    else:
        compute = work.accumulation * (lay.microbatches * lay.virtual + lay.pp - 1) * stage
    params = s.param_count() / (lay.tp * lay.pp)
    place, dpn = model.placement, cluster.devices_per_node
    grad = collective_time(cluster.profile, "all_reduce", 4 * params, group_span(place.dp_group(), dpn))
    if lay.hybrid:  # reduce-scatter inside the shard group, all-reduce of the shard across the replicas
        grad = hsdp_gradient_seconds(cluster.profile, 4 * params, group_span(place.shard_group(lay.shard), dpn),
                                     group_span(place.replica_group(lay.shard), dpn))
    backward = sum(model.block(i).bwd for i in range(s.n_layer))
    exposed = grad if lay.pp > 1 or lay.zero == 1 else max(0.0, grad - backward)
    if lay.replicas_apart > 1:  # DiLoCo: 1 / H of its outer all-reduce of what a rank holds
        held = params / (lay.shard if lay.zero == 3 else 1)
        exposed += collective_time(cluster.profile, "all_reduce", 4 * held, group_span(place.diloco_group(), dpn)) \
            / lay.diloco_inner_steps
    optimizer = 32 * params / (max(lay.shard, 1) if lay.zero else 1) / (cluster.profile.memory_bandwidth
                                                                     * cluster.profile.memory_efficiency)
    return compute + exposed + optimizer


def in_flight(lay: Layout) -> float:
    """Pipeline micro-batches whose activations a stage holds at once, for the memory screen
    (``plait.plan.schedule.in_flight``; the simulation's schedule peak is the final word)."""
    if lay.pp == 1:
        return 1.0
    return schedule_in_flight(lay.schedule, lay.pp, lay.microbatches, lay.virtual)


def plan(shape: ModelShape, profile: HardwareProfile, gpus: int, batch: int, *, base: Workload | None = None,
         top: int = 8, traffic: tuple[float, float] = (7.5, 80.0), space: Space | None = None) -> Plan:
    """Rank the layouts of ``shape`` on ``gpus`` devices for ``batch`` sequences per step (see the module
    docstring). ``base`` carries the precision, attention and stack to keep. Raises ``ConfigError`` naming
    the smallest change that fits when no layout fits."""
    base = base or Workload(shape, Layout(), batch)
    per_node = profile.devices_per_node if profile.kind == "gpu" else gpus
    pruned: dict[str, str] = {}
    cluster = Cluster.of(profile, gpus, devices_per_node=per_node if profile.kind == "gpu" else 0)
    usable = profile.usable_memory_bytes
    screened: list[tuple[float, Workload]] = []
    models: dict[tuple, StageModel] = {}
    floors: dict[tuple, float] = {}
    too_big: dict[str, float] = {}
    b = base.layout
    diloco = b.sync == "diloco"
    for lay in _layouts(shape, batch, gpus, per_node, pruned, space or Space(), diloco):
        lay = replace(lay, sync=b.sync, diloco_inner_steps=b.diloco_inner_steps, diloco_fragments=b.diloco_fragments)
        work = replace(base, shape=shape, layout=lay, global_batch=batch)
        # one DiLoCo replica's layout; a cp rank as a data-parallel rank of its shard of the sequence
        rank = work.replica_view().rank_view()
        fkey = (lay.tp, lay.pp, lay.dp, lay.zero, lay.ep, lay.dp_shard, lay.cp)
        if fkey not in floors:
            floors[fkey] = _model_state_floor(shape, rank.layout, rank)
        key = (lay.tp, lay.sp, work.pipe_micro_batch, lay.recompute, lay.dp, lay.pp, lay.ep, lay.cp, lay.dp_shard)
        if key not in models:
            models[key] = StageModel(rank, cluster)
        block = max((models[key].block(i) for i in range(min(shape.n_layer, shape.moe_every + 1))),
                    key=lambda c: c.saved)
        act = (block.saved * in_flight(lay) + block.weight_casts) * math.ceil(shape.n_layer / lay.pp) + block.transient
        if floors[fkey] + act > usable:
            family = (f"tp={lay.tp} pp={lay.pp} zero={lay.zero}" + (f" dp_shard={lay.dp_shard}" if lay.hybrid
                                                                    or diloco and lay.dp_shard > 1 else "")
                      + (f" cp={lay.cp}" if lay.cp > 1 else "") + (f" ep={lay.ep}" if lay.ep > 1 else ""))
            too_big[family] = min(too_big.get(family, math.inf), floors[fkey] + act)
            continue
        screened.append((estimate(rank, cluster, models[key]), work))
    for family, need in too_big.items():
        pruned[family] = f"needs at least {need / 2**30:.1f} GiB per device, {usable / 2**30:.1f} GiB usable"
    if not screened:
        raise ConfigError(_nothing_fits(shape, profile, gpus, batch, too_big))
    screened.sort(key=lambda x: x[0])
    # The best screened layouts, and each pipeline depth's best: a shallower pipeline within the band below
    # must be simulated to be preferred, however the closed-form screen ordered it.
    pool = [work for _, work in screened[:max(top, 1) * 3]]
    depths = {work.layout.pp for work in pool}
    for _, work in screened:
        if work.layout.pp not in depths:
            depths.add(work.layout.pp)
            pool.append(work)
    ranked = []
    for work in pool:
        if len(ranked) >= max(top, 1) * 2 and work.layout.pp >= min(sim.work.layout.pp for sim in ranked):
            continue
        sim = simulate(work, cluster, traffic=traffic)
        if sim.fits():
            ranked.append(sim)
        else:
            pruned[f"{work.layout.describe()}"] = (f"simulated peak {sim.peak_memory() / 2**30:.1f} GiB exceeds "
                                                   f"{usable / 2**30:.1f} GiB usable")
    if not ranked:
        raise ConfigError(_nothing_fits(shape, profile, gpus, batch, too_big))
    ranked.sort(key=preference(ranked))
    return Plan(ranked=ranked[:top], pruned=pruned, screened=len(screened))


def base_of(cfg: Config, shape: ModelShape) -> Workload:
    """The workload ``plan`` keeps from ``cfg`` (``base``): what the planner does not choose because it changes what
    is trained (the precision, DiLoCo and its settings), the optimizer's kernel and its clipping."""
    p = cfg.parallel
    return Workload(shape, Layout(sync=p.sync, diloco_inner_steps=p.diloco_inner_steps,
                                  diloco_fragments=p.diloco_fragments), cfg.train.global_batch_size,
                    precision=cfg.train.precision, fused_optimizer=cfg.optim.fused is not False,
                    grad_clip=cfg.optim.grad_clip > 0)


def preference(ranked: list[Simulation]) -> Any:
    """The planner's sort key (module docstring): layouts within ``TOLERANCE`` of the fastest first, the fewest
    pipeline stages among them, then the fastest; a fully sharded layout (ZeRO-3) in the band but slower
    than the fastest goes after the band's others. Its step rests on the overlap of every unit's gathers and
    reduce-scatters with one unit's compute, which the published rows exercise least (OPT-175B: predicted
    faster than measured), so the band's benefit of the doubt is not given to it over a faster tp/pp layout."""
    fastest = min(sim.step_s for sim in ranked)

    def key(sim: Simulation) -> tuple:
        lay = sim.work.layout
        in_band = sim.step_s <= fastest * (1 + TOLERANCE)
        doubted = in_band and lay.zero == 3 and lay.dp * lay.cp > 1 and sim.step_s > fastest
        return (not in_band, doubted, lay.pp, lay.cp, sim.step_s)

    return key


def _nothing_fits(shape: ModelShape, profile: HardwareProfile, gpus: int, batch: int, too_big: dict) -> str:
    least = min(too_big.values()) if too_big else math.inf
    usable = profile.usable_memory_bytes
    more = gpus
    while more < 1 << 20:
        more *= 2
        if least * gpus / more < usable * 0.9:
            break
    return (f"no layout of {shape.param_count() / 1e9:.2f}B parameters fits {gpus} x {profile.name}: the smallest "
            f"needs {least / 2**30:.1f} GiB per device and {usable / 2**30:.1f} GiB are usable. Smallest change: "
            f"about {more} devices (--gpus {more}), or a device with more memory")


def write_config(sim: Simulation, base: Config, path: str) -> None:
    """Write ``base`` with the simulated layout's keys set, as a config ``plait train`` runs."""
    import copy
    from pathlib import Path

    from plait.config import to_toml

    cfg = copy.deepcopy(base)
    lay = sim.work.layout
    p, t = cfg.parallel, cfg.train
    p.nproc, p.dp, p.tp, p.pp, p.zero, p.ep = lay.world, lay.dp, lay.tp, lay.pp, lay.zero, lay.ep
    p.cp, p.cp_impl = lay.cp, lay.cp_impl
    p.sequence_parallel = lay.sp
    p.sync, p.diloco_inner_steps, p.diloco_fragments = lay.sync, lay.diloco_inner_steps, lay.diloco_fragments
    # HSDP's shard group, or under DiLoCo the data-parallel ranks of one replica
    p.dp_shard = lay.shard if lay.hybrid else (lay.dp_shard if lay.sync == "diloco" and lay.dp_shard > 1 else 0)
    if lay.pp > 1:
        p.pp_schedule, p.microbatches = lay.schedule, lay.microbatches
        p.pp_virtual_stages = lay.virtual if lay.schedule in ("interleaved", "zbv") else 0
    t.micro_batch_size, t.global_batch_size = lay.micro_batch_size, sim.work.global_batch
    t.activation_checkpointing = lay.recompute if lay.recompute in ("none", "full", "selective") else "none"
    Path(path).write_text(f"# Written by plait plan: {lay.describe()} on {lay.world} x "
                          f"{sim.cluster.profile.name}, predicted step {sim.step_s:.4g} s\n" + to_toml(cfg))


def summary_row(sim: Simulation) -> dict[str, Any]:
    """One ranked layout for printing: its keys, step time, throughput, memory and where time goes."""
    return {"layout": sim.work.layout.describe(), "step_s": round(sim.step_s, 6),
            "tokens_per_s": round(sim.tokens_per_s, 1), "mfu": round(sim.mfu, 4),
            "peak_memory_gib": round(sim.peak_memory() / 2**30, 2), "exposed_comm_s": sim.exposed(),
            "bubble": sim.bubble()["theory"], "scaling_efficiency": round(sim.scaling_efficiency, 4)}
