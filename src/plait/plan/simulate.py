"""``plait simulate``: predict a training step of a layout on a cluster from FLOPs, bytes and collectives.

``simulate(workload, cluster)`` prices every layer (``plait.plan.stages``), lays one step of every
pipeline rank on simulated time (``plait.plan.timeline``; data-parallel and tensor-parallel replicas of a
pipeline rank are identical, so one of each stands for all), adds the optimizer, and reports the step
time, throughput, MFU and HFU, per-rank peak memory with its breakdown, exposed communication, the
pipeline bubble and the scaling efficiency (the layout's throughput per device over one device's
compute-only throughput on the same micro-batch). ``plait.plan.configured.simulate_config`` does the same
for a plait config, deriving what it can from the code that trains (``plait.plan.record``).

A context-parallel rank is simulated as a data-parallel rank of its shard of the sequence, and a DiLoCo layout as one
replica's layout with the outer synchronisation added (``Workload.replica_view``, ``rank_view``; ``_diloco``): its
step is the mean step, carrying ``1 / H`` of a period's synchronisations. Under fp8 the float8 Linears run at the
profile's fp8 peak (``plait.plan.ops_float8``) and MFU stays against the bf16 peak.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from plait.plan import derive
from plait.plan.flops import hardware_flops, model_flops, utilisation
from plait.plan.layouts import PipelineZero, hsdp_gradient_seconds, pipeline_zero
from plait.plan.network import Group, collective_time, group_span
from plait.plan.ops import Op
from plait.plan.ops_float8 import is_float8_weight
from plait.plan.params import Param, param_list
from plait.plan.rank_memory import RankMemory, gathered_bytes, model_states, outer_numel
from plait.plan.schedule import in_flight, stage_owner, theoretical_bubble
from plait.plan.stages import Cluster, StageModel
from plait.plan.timeline import RankTimeline, Span, flat_step, pipeline_step
from plait.plan.workload import Workload

# DiLoCo's outer step per element (plait.parallel.data.diloco): the pseudo-gradient (read the start weights and the
# weights, write it: 12 bytes), the momentum (read it and the pseudo-gradient, write it: 12), Nesterov's update (12),
# the start weights stepped (12) and copied into the weights (8), float32
OUTER_BYTES_PER_ELEMENT = 56
MFU_FORMULA = "mfu = (6 N_matmul + 12 L d T) x tokens / (step_s x devices x peak)"
HFU_FORMULA = "hfu = (model FLOPs + recomputed forward FLOPs) / (step_s x devices x peak)"


@dataclass
class Simulation:
    """The prediction for one step; ``as_dict`` is what ``plait simulate`` prints."""

    work: Workload
    cluster: Cluster
    step_s: float
    memory: dict[int, RankMemory]
    timelines: dict[int, RankTimeline]
    stages: list[range]
    peak_flops: float
    scaling_efficiency: float
    notes: list[str] = field(default_factory=list)
    context: dict[str, Any] | None = None  # context parallelism's collectives per step (simulate)
    diloco: dict[str, Any] | None = None  # DiLoCo's outer synchronisation (simulate's _diloco)

    @property
    def world(self) -> int:
        return self.work.layout.world

    @property
    def tokens_per_s(self) -> float:
        return self.work.tokens_per_step / self.step_s

    @property
    def mfu(self) -> float:
        return utilisation(model_flops(self.work.shape, self.work.tokens_per_step), self.step_s, self.world,
                           self.peak_flops)

    @property
    def hfu(self) -> float:
        lay = self.work.layout
        # plait's selective checkpointing keeps every matmul's and attention's output: it recomputes no FLOPs
        recompute = "none" if lay.recompute == "selective" and self.work.stack == "plait" else lay.recompute
        flops = hardware_flops(self.work.shape, self.work.tokens_per_step, recompute, lay.every_k)
        return utilisation(flops, self.step_s, self.world, self.peak_flops)

    def peak_memory(self) -> float:
        return max(m.total for m in self.memory.values())

    def fits(self) -> bool:
        return self.peak_memory() <= self.cluster.profile.usable_memory_bytes

    def bubble(self) -> dict[str, Any]:
        lay = self.work.layout
        if lay.pp == 1:
            return {"theory": 0.0, "per_rank": [0.0]}
        per_rank = []
        for _, tl in sorted(self.timelines.items()):
            spans = [s for s in tl.spans if s.lane == "compute"]
            span = max(s.end for s in spans) - min(s.start for s in spans)
            per_rank.append(round(max(0.0, 1.0 - tl.busy / span), 4) if span > 0 else 0.0)
        return {"theory": round(theoretical_bubble(lay.pp, lay.microbatches, lay.virtual), 4), "per_rank": per_rank,
                "formula": "(p-1)/(v*m+p-1)"}

    def exposed(self) -> dict[str, float]:
        slowest = max(self.timelines.values(), key=lambda tl: tl.end)
        out = {k: round(v, 6) for k, v in slowest.exposed.items()}
        out["total"] = round(sum(slowest.exposed.values()), 6)
        return out

    def as_dict(self) -> dict[str, Any]:
        w, lay, s = self.work, self.work.layout, self.work.shape
        mem = {str(r): m.as_dict() for r, m in sorted(self.memory.items())}
        return {
            "model": {"name": s.name, "params": s.param_count(), "n_layer": s.n_layer, "d_model": s.d_model,
                      "n_head": s.n_head, "seq_len": s.seq_len, "vocab_size": s.vocab_size},
            "layout": {**lay.__dict__, "world": lay.world, "accumulation": w.accumulation,
                       "pipe_micro_batch": w.pipe_micro_batch, "stages": [[r.start, r.stop] for r in self.stages]},
            "hardware": {"profile": self.cluster.profile.name, "devices_per_node": self.cluster.devices_per_node,
                         "threads_per_rank": self.cluster.threads if self.cluster.profile.kind == "cpu" else None,
                         "peak_flops_per_device": self.peak_flops},
            "precision": w.precision, "attention": w.attention, "stack": w.stack,
            "step_s": self.step_s, "tokens_per_s": self.tokens_per_s,
            "mfu": round(self.mfu, 4), "mfu_formula": MFU_FORMULA,
            "hfu": round(self.hfu, 4), "hfu_formula": HFU_FORMULA,
            "peak_memory_bytes": int(self.peak_memory()), "fits": self.fits(),
            "usable_memory_bytes": int(self.cluster.profile.usable_memory_bytes),
            "memory_by_pipeline_rank": mem,
            "memory_ranks": "pipeline rank r's entry holds for every global rank with that pipeline coordinate",
            "peak_memory_bytes_per_rank": ([int(self.memory[r // (lay.world // lay.pp)].total)
                                            for r in range(lay.world)] if lay.world <= 64 else None),
            "exposed_comm_s": self.exposed(), "bubble": self.bubble(),
            "scaling_efficiency": round(self.scaling_efficiency, 4), "notes": self.notes,
            **({"context_parallel": self.context} if self.context else {}),
            **({"diloco": self.diloco} if self.diloco else {}),
        }


def _rank_params(work: Workload, stages: list[range], owner: list[int], rank: int) -> list[Param]:
    n = len(stages)
    out: list[Param] = []
    for s in range(n):
        if owner[s] == rank:
            out += param_list(work.shape, stages[s], first=s == 0, last=s == n - 1, ep=work.layout.ep)
    return out


def _shard_groups(model: StageModel, r: int) -> tuple[Group, Group | None]:
    """ZeRO-3's groups for pipeline rank ``r``: the ranks a parameter is sharded over (every data-parallel
    rank, or under HSDP the shard group) and, under HSDP, the replicas of a shard."""
    lay, place, dpn = model.work.layout, model.placement, model.cluster.devices_per_node
    if not lay.hybrid:
        return group_span(place.dp_group(r), dpn), None
    return group_span(place.shard_group(lay.shard, r), dpn), group_span(place.replica_group(lay.shard, r), dpn)


def _comm_plan(model: StageModel, params: list[Param], dp_group: Any, shards: tuple[Group, Group | None]) -> dict:
    work, profile = model.work, model.profile
    lay = work.layout
    cores_free = profile.kind != "cpu" or profile.cores - min(lay.world, model.cluster.devices_per_node) \
        * model.cluster.threads >= 1
    # Megatron-LM (2021, its default local DDP) all-reduces the gradient buffer after the whole backward
    # (``allreduce_gradients`` in ``train_step``), so nothing overlaps there; plait's reducer overlaps, and
    # so does every fully sharded layout (FSDP reduce-scatters each unit as its gradients exist).
    overlap = cores_free and (work.stack != "megatron" or lay.zero == 3)
    plan: dict[str, Any] = {"overlap": overlap, "prefetch": profile.kind != "cpu", "buckets": []}
    grad = model.gradient_bytes
    if lay.ep > 1:  # plait.parallel.expert.dispatch, over the ranks holding the same experts, after backward
        experts = 4 * sum(p.local_numel(lay.tp) for p in params if p.expert)
        group = group_span(model.placement.expert_dp_group(), model.cluster.devices_per_node)
        if lay.zero and lay.dp > lay.ep:  # sharded there: reduce-scatter the gradients, all-gather the weights
            gathers = 2 if lay.zero == 3 else 1  # ZeRO-3 gathers for forward and again for backward
            plan["expert"] = (collective_time(profile, "reduce_scatter", experts, group)
                              + gathers * collective_time(profile, "all_gather", experts, group))
        else:  # whole on each replica: one all-reduce of the flattened gradients
            plan["expert"] = collective_time(profile, "all_reduce", experts, group)
        params = [p for p in params if not p.expert]  # the dense layout reduces the rest
    if lay.zero == 3 and params:
        # FSDP2 gathers in its param_dtype (bf16 under plait's bf16; float8 for fp8's float8 Linears, each weight's
        # scale from an amax all-reduced over the shard group first: torchao's fsdp_pre_all_gather); a
        # half-precision stack holds half params
        units = derive.fsdp_units(params, work.shape.n_layer)
        sizes = [sum(params[i].local_numel(lay.tp) for i in u) for u in units]
        gathered = [gathered_bytes([params[i] for i in u], work) for u in units]
        amaxes = [sum(is_float8_weight(params[i], work.shape.n_layer) for i in u) if work.float8 else 0
                  for u in units]
        keys = list(range(len(units) - 1)) + [-1]
        # one rank (ZeRO-3 with offload=params): no collective; the host copies of offload are not timed.
        # HSDP: gathers inside the shard group; gradients reduce-scattered there, then all-reduced across replicas
        shard, replicas = shards

        def reduce(nbytes: float) -> float:
            if replicas is not None:
                return hsdp_gradient_seconds(profile, nbytes, shard, replicas)
            return collective_time(profile, "reduce_scatter", nbytes, shard)
        plan["unit_ag"] = {k: collective_time(profile, "all_gather", b, shard)
                           + a * collective_time(profile, "all_reduce", 4, shard) if lay.dp > 1
                           else 0.0 for k, b, a in zip(keys, gathered, amaxes, strict=True)}
        plan["unit_rs"] = {k: reduce(n * grad) if lay.dp > 1 else 0.0 for k, n in zip(keys, sizes, strict=True)}
        return plan
    if lay.dp == 1 or not params:
        return plan
    if lay.zero in (1, 2):
        buckets = derive.zero_buckets(params, lay.tp, lay.bucket_mb, lay.dp)
        op = "all_reduce" if lay.zero == 1 else "reduce_scatter"
        plan["buckets"] = [([params[i].layer for i in idx], collective_time(profile, op, grad * numel, dp_group))
                           for idx, numel in buckets]
        plan["gather"] = [collective_time(profile, "all_gather", 4 * numel, dp_group) for _, numel in buckets]
        return plan
    for idx in derive.reducer_buckets(params, lay.tp, lay.bucket_mb):
        numel = sum(params[i].local_numel(lay.tp) for i in idx)
        plan["buckets"].append(([params[i].layer for i in idx], collective_time(profile, "all_reduce",
                                                                                 grad * numel, dp_group)))
    return plan


def _optimizer(model: StageModel, tl: RankTimeline, params: list[Param], plan: dict, traffic: tuple[float, float],
               t: float, groups: dict) -> float:
    """Gradient norm, optimizer step, zero_grad and ZeRO's parameter all-gathers on ``tl`` from ``t``."""
    work, compute, profile = model.work, model.compute, model.profile
    lay = work.layout
    ops_per_tensor, bytes_per_element = traffic
    elements = sum(p.local_numel(lay.tp) for p in params)
    tensors = len(params)
    if lay.zero in (1, 2):
        tensors, elements = len(plan["buckets"]), elements / lay.dp
    elif lay.zero == 3:
        elements = sum(derive.fsdp_shard_numel(p, lay.tp, lay.shard) for p in params)
    over = profile.kernel_overhead_s if profile.calibration is None else \
        profile.calibration.overhead["op"][min(profile.calibration.overhead["op"])] * compute.stretch
    seconds = compute.time(Op("optimizer", "optimizer", bytes=bytes_per_element * elements))
    seconds += ops_per_tensor * tensors * over
    # parameters that are DTensors (FSDP2's shards; tensor-parallel weights) step through DTensor's dispatch
    # (ZeRO-1/2 steps plain tensors, its buckets' chunks, even of tensor-parallel parameters)
    dtensors = tensors if lay.zero == 3 else tensors * (model.op_counts.dtensor_params if model.op_counts
                                                        and lay.tp > 1 and lay.zero == 0 else 0.0)
    seconds += (ops_per_tensor + (3 if work.grad_clip else 0)) * dtensors * compute.overhead("dtensor")
    if work.grad_clip:
        seconds += compute.time(Op("grad_norm", "reduce", bytes=4 * elements)) + 3 * tensors * over
        seconds += compute.time(Op("grad_clip", "copy", bytes=8 * elements))
        for g in groups.values():
            seconds += collective_time(profile, "all_reduce", 8, g)
    if lay.zero == 0:
        seconds += compute.time(Op("zero_grad", "copy", bytes=4 * elements))
    seconds += compute.overhead("step")  # plait's own host work per step (calibrated cpu; 0 on a GPU)
    tl.spans.append(Span("optimizer", "optimizer", t, t + seconds))
    t += seconds
    for i, s in enumerate(plan.get("gather", [])):
        tl.spans.append(Span(f"all-gather bucket {i}", "dp", t, t + s))
        tl.expose("dp", s)
        t += s
    return t


def simulate(work: Workload, cluster: Cluster, derived_tp: Any = None, traffic: tuple[float, float] = (7.5, 80.0),
             notes: list[str] | None = None, op_counts: Any = None) -> Simulation:
    """Predict one step of ``work`` on ``cluster`` (see the module docstring). ``traffic`` is the optimizer's
    (operators per tensor, bytes per element), ``plait.plan.record.optimizer_traffic`` for a config; ``derived_tp`` and
    ``op_counts`` what ``plait.plan.derive`` recorded from the real model (None: the analytic model alone)."""
    work.check()
    # one DiLoCo replica's layout; a context-parallel rank: its shard of the sequence, cp folded into dp
    whole, work = work, work.replica_view().rank_view()
    lay = work.layout
    model = StageModel(work, cluster, derived_tp, op_counts)
    n_stages = lay.pp * lay.virtual
    stages = model.partition(n_stages)
    owner = stage_owner(lay.pp, lay.virtual, lay.schedule)
    place, dpn = model.placement, cluster.devices_per_node
    timelines = {r: RankTimeline(r) for r in range(lay.pp)}
    memory: dict[int, RankMemory] = {}
    plans: dict[int, dict] = {}
    params_of = {r: _rank_params(work, stages, owner, r) for r in range(lay.pp)}
    for r in range(lay.pp):
        plans[r] = _comm_plan(model, params_of[r], group_span(place.dp_group(r), dpn), _shard_groups(model, r))
    if lay.pp == 1:
        ends = {0: flat_step(model, timelines[0], plans[0])}
        if plans[0].get("expert"):
            t, s = ends[0], plans[0]["expert"]
            timelines[0].spans.append(Span("expert gradients and weights over their replicas", "dp", t, t + s))
            timelines[0].expose("dp", s)
            ends[0] = t + s
        act = sum(c.saved for _, c in _all_layers(model))
        timelines[0].activation_peak = act
    else:
        ends = _pipelined(model, timelines, stages, plans, params_of)
    for r in range(lay.pp):
        groups = {"tp": model.tp_group, "pp": group_span(place.pp_group(), dpn)}
        if lay.zero:  # the norm's all-reduce over the ranks a gradient is sharded over
            groups["dp"] = _shard_groups(model, r)[0]
        ends[r] = _optimizer(model, timelines[r], params_of[r], plans[r], traffic, ends[r], groups)
        timelines[r].end = ends[r]
        states, buffers = model_states(params_of[r], work, work.shape.n_layer)
        mine = [s for s in range(n_stages) if owner[s] == r]
        costs = [model.stage(stages[s], s == 0, s == n_stages - 1) for s in mine]
        transient = max(c.transient for c in costs)
        casts = sum(c.weight_casts for c in costs)  # one autocast copy of the rank's weights is alive at a time
        states.activations = timelines[r].activation_peak
        unsharded = _unsharded_gradients(model, params_of[r])
        states.buffers = buffers + transient + casts + _receive_buffers(model, mine, n_stages) + unsharded
        states.detail = {**states.detail, "activation_saved_per_microbatch": int(sum(c.saved for c in costs)),
                         "autocast_weight_copies": int(casts), "stages": mine}
        if unsharded:
            states.detail["unsharded_gradients"] = int(unsharded)
            states.detail["gathered_units"] = int(buffers)  # model_states' buffers at ZeRO-3: the gathered units
        host = sum(c.host for c in costs)
        if host:  # activation offload: the micro-batches in flight wait in host memory
            held = in_flight(lay.schedule, lay.pp, lay.microbatches, lay.virtual) if lay.pp > 1 else 1.0
            states.detail["activation_host_bytes"] = int(host * held)
            states.detail["offload_bytes_per_step"] = int(host * lay.microbatches * work.accumulation)
        memory[r] = states
    outer = _diloco(model, whole, params_of, ends, timelines) if whole.layout.sync == "diloco" else None
    step = max(ends.values())
    for tl in timelines.values():
        tl.expose("tp", sum(float(s.args.get("tp_comm_s", 0.0)) for s in tl.spans if s.lane == "compute"))
        if lay.ep > 1:
            tl.expose("ep", sum(float(s.args.get("ep_comm_s", 0.0)) for s in tl.spans if s.lane == "compute"))
        tl.end = step
    single = _single_device_time(whole, cluster, op_counts)
    notes = list(notes or [])
    if whole.float8:
        notes.append("fp8: the float8 Linears multiply at the profile's fp8 peak; MFU and HFU are against the bf16 "
                     "peak, as for bf16")
    sim = Simulation(whole, cluster, step, memory, timelines, stages, model.compute.peak_flops,
                     single * whole.global_batch / max(whole.layout.world, 1) / step, notes, diloco=outer)
    if whole.layout.cp > 1:  # the cp collectives of one optimizer step on a rank of each pipeline rank's stages
        runs = work.accumulation * (lay.microbatches if lay.pp > 1 else 1)  # block passes per step
        by_rank = []
        for r in range(lay.pp):
            blocks = [model.block(i) for s in range(n_stages) if owner[s] == r for i in stages[s]]
            by_rank.append((int(runs * sum(c.detail["cp_bytes"] for c in blocks)),
                            runs * sum(c.detail["cp_exposed_s"] for c in blocks)))
        sim.context = {"cp": whole.layout.cp, "impl": whole.layout.cp_impl,
                       "comm_bytes_per_step": max(b for b, _ in by_rank),
                       "exposed_s_per_step": max(e for _, e in by_rank),
                       "comm_bytes_per_step_by_pipeline_rank": [b for b, _ in by_rank]}
    return sim


def _diloco(model: StageModel, whole: Workload, params_of: dict[int, list[Param]], ends: dict[int, float],
            timelines: dict[int, RankTimeline]) -> dict[str, Any]:
    """DiLoCo's outer synchronisation (``plait.parallel.data.diloco``) on each pipeline rank's timeline, from its
    end: every ``H`` steps each rank all-reduces the float32 pseudo-gradient of what it holds (``outer_numel``) over
    the ranks holding the same part in the other replicas (in ``F`` fragments of ``1 / F`` each, one every ``H / F``
    steps), and runs the outer Nesterov step on it (``OUTER_BYTES_PER_ELEMENT``). The step carries ``1 / H`` of a
    period's synchronisations: the mean step; the steps that synchronise take the whole of theirs."""
    lay, dpn = whole.layout, model.cluster.devices_per_node
    h, f = lay.diloco_inner_steps, lay.diloco_fragments
    inner = max(ends.values())
    per_rank = []
    for r, tl in timelines.items():
        held = outer_numel(params_of[r], model.work)
        group = group_span(model.placement.diloco_group(r), dpn)
        sync = (collective_time(model.profile, "all_reduce", 4 * held / f, group)
                + model.compute.time(Op("diloco.outer", "optimizer", bytes=OUTER_BYTES_PER_ELEMENT * held / f)))
        mean = f * sync / h
        tl.spans.append(Span(f"DiLoCo outer sync (1/{h} of a period's {f})", "dp", ends[r], ends[r] + mean))
        tl.expose("diloco", mean)
        ends[r] += mean
        per_rank.append((4 * held / f, sync, mean))
    return {"replicas": lay.diloco_replicas, "inner_steps": h, "fragments": f, "ranks_per_replica": lay.world //
            lay.diloco_replicas, "bytes_per_sync": int(max(b for b, _, _ in per_rank)),
            "sync_s": max(s for _, s, _ in per_rank), "syncs_per_period": f,
            "outer_bytes_per_step": int(max(b for b, _, _ in per_rank) * f / h),
            "mean_s_per_step": max(m for _, _, m in per_rank), "inner_step_s": inner}


def _pipelined(model: StageModel, timelines: dict[int, RankTimeline], stages: list[range], plans: dict[int, dict],
               params_of: dict[int, list[Param]]) -> dict[int, float]:
    """The pipelined step on every rank's timeline (ZeRO-3's stage gathers around it), then its gradients."""
    work, cluster = model.work, model.cluster
    lay, place, dpn = work.layout, model.placement, cluster.devices_per_node
    # Megatron-LM and DeepSpeed send each tensor-parallel rank 1/tp of the activation and gather it on the
    # other side (Narayanan et al. 2021, section 4.1); plait sends it whole unless sequence parallel
    split = lay.tp if lay.sp or work.stack != "plait" else 1
    hop = work.pipe_micro_batch * work.shape.seq_len * work.shape.d_model * work.act_bytes // split
    pp_link = group_span(place.pp_group()[:2], dpn)
    if lay.zero == 3 and lay.dp > 1:
        for r in range(lay.pp):
            numel = sum(p.local_numel(lay.tp) for p in params_of[r])
            shard, replicas = _shard_groups(model, r)
            per_element = gathered_bytes(params_of[r], work) / max(numel, 1)  # float8 Linears' weights: 1 byte
            plans[r]["pipeline_zero"] = pipeline_zero(cluster.profile, 3, numel, per_element,
                                                      model.gradient_bytes, shard, lay.reshard_after_forward,
                                                      replicas)
    pz = {r: plans[r].get("pipeline_zero", PipelineZero()) for r in range(lay.pp)}
    for r, z in pz.items():
        if z.before:
            timelines[r].spans.append(Span("all-gather the stage's units", "fsdp", 0.0, z.before))
            timelines[r].expose("fsdp", z.before)
    ends = pipeline_step(model, timelines, stages, collective_time(cluster.profile, "send", hop, pp_link),
                         t0=max(z.before for z in pz.values()), per_action={r: z.per_action for r, z in pz.items()})
    return _pipeline_gradients(model, timelines, ends, plans, place, dpn)


def _receive_buffers(model: StageModel, stages: list[int], n_stages: int) -> float:
    """Bytes torch's pipeline stages allocate to receive into, one buffer per micro-batch, kept across steps
    (``torch.distributed.pipelining.stage``: ``args_recv_info``, ``grad_recv_info``): each stage after the first
    receives its input, each before the last the gradient of its output (the residual stream's shard); under
    ZBV a stage after the first also keeps the gradient of each micro-batch's input until the step ends.
    Measured with the activations (``tests/plan/test_pipeline_memory.py``)."""
    work, lay = model.work, model.work.layout
    if lay.pp == 1 or work.stack != "plait":  # Megatron-LM receives into each micro-batch's own input tensor
        return 0.0
    tokens = work.pipe_micro_batch * work.shape.seq_len // (lay.tp if lay.sp else 1)
    hidden = tokens * work.shape.d_model * model.setup.residual_bytes * lay.microbatches
    per_input = 2 if lay.schedule == "zbv" else 1
    return sum(hidden * (per_input * (s > 0) + (s < n_stages - 1)) for s in stages)


def _unsharded_gradients(model: StageModel, params: list[Param]) -> float:
    """Bytes of the whole (unsharded) gradients a pipeline rank accumulates at ZeRO-3: torch's schedules turn
    FSDP2's gradient sync off for the micro-batches' backwards, so FSDP2 keeps each stage's gradients unsharded,
    in its reduce dtype (fp32), from the stage's first backward until the reduce-scatter after its last, which
    is most of the step (``FSDPParamGroup.post_backward``; measured, ``tests/plan/test_pipeline_memory.py``)."""
    work, lay = model.work, model.work.layout
    if lay.pp == 1 or lay.zero != 3 or lay.dp == 1 or work.stack != "plait":
        return 0.0
    return float(model.gradient_bytes * sum(p.local_numel(lay.tp) for p in params))


def _all_layers(model: StageModel) -> list:
    n = model.work.shape.n_layer
    return [(-1, model.embed())] + [(i, model.block(i)) for i in range(n)] + [(n, model.head())]


def _pipeline_gradients(model: StageModel, timelines: dict[int, RankTimeline], ends: dict[int, float],
                        plans: dict[int, dict], place: Any, dpn: int) -> dict[int, float]:
    """After the schedule: data-parallel reduction of every bucket (exposed) and the tied copies' sum."""
    work = model.work
    step = dict(ends)
    tied = work.shape.tied_embeddings
    for r, tl in timelines.items():
        t = ends[r]
        for i, (_, seconds) in enumerate(plans[r]["buckets"]):
            tl.spans.append(Span(f"gradient bucket {i}", "dp", t, t + seconds))
            tl.expose("dp", seconds)
            t += seconds
        # torch's schedules reduce FSDP2's gradients after every schedule step: once per accumulation micro-step
        after = plans[r].get("pipeline_zero", PipelineZero()).after * work.accumulation
        if after:
            tl.spans.append(Span("reduce-scatter the stage's gradients", "fsdp", t, t + after))
            tl.expose("fsdp", after)
            t += after
        if tied:
            table = work.shape.vocab_size // work.layout.tp * work.shape.d_model * 4
            s = collective_time(model.profile, "all_reduce", table, group_span(place.pp_group(), dpn))
            tl.spans.append(Span("tied embedding all-reduce", "pp", t, t + s))
            tl.expose("tied", s)
            t += s
        step[r] = t
    return step


def _single_device_time(work: Workload, cluster: Cluster, op_counts: Any = None) -> float:
    """Compute-only seconds per sequence on one device with the layout's micro-batch and recompute."""
    lay = replace(work.layout, dp=1, tp=1, pp=1, zero=0, sp=False, virtual=1, microbatches=1,
                  micro_batch_size=work.pipe_micro_batch, cp=1, cp_folded=1)
    single = replace(work, layout=lay, global_batch=work.pipe_micro_batch)
    if op_counts is not None and work.layout.tp > 1:
        op_counts = None  # counted under tensor parallelism: not the single device's
    model = StageModel(single, cluster, None, op_counts)
    return sum(c.total for _, c in _all_layers(model)) / work.pipe_micro_batch
