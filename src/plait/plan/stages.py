"""Per-layer costs of a workload on a cluster, and the pipeline stages they are split into.

A layer (the embedding, each block, the head with the loss) costs, per pipeline micro-batch on one
rank: its forward, the input-gradient and weight-gradient parts of its backward (recomputation, when
the block is checkpointed, runs again before its backward and counts in the input part), the
tensor-parallel collectives in the compute stream (they block it: nothing overlaps them in plait's
DTensor layout), and the activation bytes it keeps for backward. On a calibrated CPU every operator the
dispatcher runs beyond the priced ones (views, copies, autograd's bookkeeping; counted on the real model
by ``plait.plan.record.operator_counts``) costs the measured per-operator overhead, each DTensor
operator what DTensor adds, and each tensor-parallel collective the host work measured around one
(``plait.plan.calibrate_paths``). Activation checkpointing keeps only a
checkpointed block's input and adds one block's activations while it is recomputed; plait's recomputation
stops after the last operator whose input the block saves (torch's early stop). ``selective`` is
what each stack runs: plait's (``plait.parallel.activation_checkpoint``, torch's selective checkpointing with the
default policy) keeps the block's input and the outputs of its matmuls and attention kernel (``Op.out``) and
recomputes every other forward operator up to the last one that saves a tensor (norms, activations, rotary,
autocast's casts, the tensor-parallel all-gathers and reduce-scatters: their collectives run again in
backward); Megatron-LM's and metaseq's (Korthikanti et al. 2022) drop the attention core's ``T x T`` tensors
and recompute the core. A mixture-of-experts block's all-to-alls run over the
expert-parallel group (``ep_fwd``/``ep_bwd``: in the compute stream, like the tensor-parallel ones).
Activation offload (``Layout.act_offload``) moves what an un-checkpointed block saves to host memory
(``LayerCost.host``) and prices the copies against the block's compute (``StageModel._offload``).

Stages are split by ``plait.parallel.pipeline.runner.partition_layers`` (the trainer's own split) on these
predicted costs, as the trainer splits on measured ones (``pp_balance="cost"``), or by layer count.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from functools import lru_cache

from plait.config import ConfigError
from plait.plan.derive import Collective, OperatorCounts
from plait.plan.hardware import HardwareProfile
from plait.plan.kernels import ComputeModel
from plait.plan.network import Group, Placement, collective_time, group_span
from plait.plan.ops import BlockOps, Op, Pass, Setup, embedding_ops, head_ops
from plait.plan.schedule import ZBV_KEPT_LAST, zbv_kept
from plait.plan.workload import Workload

DROPPED_BY_SELECTIVE = ("attn.probs", "attn.pmask", "attn.pdrop")
WEIGHT_CASTS = "w."  # saved-tensor names of autocast's weight copies (``plait.plan.ops``)


@dataclass(frozen=True)
class Cluster:
    """Where a workload runs: the profile, devices per node, and for cpu profiles the threads per rank."""

    profile: HardwareProfile
    devices_per_node: int
    threads: int = 1

    @classmethod
    def of(cls, profile: HardwareProfile, world: int, nodes: int = 0, devices_per_node: int = 0) -> Cluster:
        """The cluster for ``world`` ranks: ``devices_per_node`` (default the profile's; a cpu profile puts
        every rank on one machine unless ``nodes`` says otherwise) and, on cpu, ``OMP_NUM_THREADS`` or the
        launcher's ``cores // ranks per node`` threads per rank."""
        if devices_per_node <= 0:
            if profile.kind == "cpu":
                devices_per_node = -(-world // nodes) if nodes > 0 else max(world, 1)
            else:
                devices_per_node = profile.devices_per_node
        threads = 1
        if profile.kind == "cpu":
            env = os.environ.get("OMP_NUM_THREADS")
            threads = int(env) if env else max(1, profile.cores // max(1, min(world, devices_per_node)))
        return cls(profile, devices_per_node, threads)

    def oversubscription(self, world: int) -> float:
        """Compute threads per core on a node (cpu; 1 for GPUs)."""
        if self.profile.kind != "cpu":
            return 1.0
        return max(1.0, min(world, self.devices_per_node) * self.threads / max(self.profile.cores, 1))


@dataclass
class LayerCost:
    """One layer's cost per pipeline micro-batch on one rank (see the module docstring)."""

    fwd: float = 0.0
    bwd_in: float = 0.0
    bwd_w: float = 0.0
    tp_fwd: float = 0.0
    tp_bwd: float = 0.0
    saved: float = 0.0
    transient: float = 0.0
    flops: float = 0.0
    recomputed: bool = False
    detail: dict = field(default_factory=dict)
    ep_fwd: float = 0.0  # expert all-to-alls in the compute stream (in fwd / bwd_in too)
    ep_bwd: float = 0.0
    zbv_kept: float = 0.0  # of ``saved``, what ZBV's weight-gradient pass leaves alive (plait.plan.schedule)
    weight_casts: float = 0.0  # autocast's half-precision weight copies kept for backward (once per rank)
    host: float = 0.0  # activation offload: bytes moved to host memory and back (each way) per micro-batch

    @property
    def bwd(self) -> float:
        return self.bwd_in + self.bwd_w

    @property
    def total(self) -> float:
        return self.fwd + self.bwd

    @property
    def tp_comm(self) -> float:
        return self.tp_fwd + self.tp_bwd

    def __add__(self, other: LayerCost) -> LayerCost:
        return LayerCost(self.fwd + other.fwd, self.bwd_in + other.bwd_in, self.bwd_w + other.bwd_w,
                         self.tp_fwd + other.tp_fwd, self.tp_bwd + other.tp_bwd, self.saved + other.saved,
                         max(self.transient, other.transient), self.flops + other.flops,
                         ep_fwd=self.ep_fwd + other.ep_fwd, ep_bwd=self.ep_bwd + other.ep_bwd,
                         zbv_kept=self.zbv_kept + other.zbv_kept, weight_casts=self.weight_casts + other.weight_casts,
                         host=self.host + other.host)


def _is_weight_grad(op: Op) -> bool:
    return op.name.endswith((".dW", ".db"))


class StageModel:
    """Prices layers of ``work`` on ``cluster``; ``derived_tp`` (per-block, rest) collectives recorded from
    the real tensor-parallel plan replace the analytic ones when given (``plait.plan.derive``)."""

    def __init__(self, work: Workload, cluster: Cluster,
                 derived_tp: tuple[list[Collective], list[Collective]] | None = None,
                 op_counts: OperatorCounts | None = None) -> None:
        lay = work.layout
        self.work, self.cluster, self.profile = work, cluster, cluster.profile
        if work.float8 and "fp8" not in cluster.profile.peak_flops:
            raise ConfigError(f"precision fp8 multiplies in float8 tensor cores (compute capability 8.9+: H100, H200); "
                              f"hardware profile {cluster.profile.name!r} gives no [device.peak_flops] fp8 (an A100 "
                              "has none; a CPU computes float8 without a speed-up, unmeasured): simulate it with "
                              "train.precision=bf16, or on a profile with an fp8 peak (h100-sxm, h200-sxm)")
        dtype = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp8": "bf16"}[work.precision]
        self.compute = ComputeModel(cluster.profile, dtype, cluster.threads, cluster.oversubscription(lay.world))
        self.placement = Placement(pp=lay.pp, dp=lay.dp // (lay.ep * lay.cp_folded), tp=lay.tp, ep=lay.ep,
                                   cp=lay.cp_folded, replicas=max(1, lay.replicas_apart))
        self.tp_group: Group = group_span(self.placement.tp_group(), cluster.devices_per_node)
        self.ep_group: Group = group_span(self.placement.ep_group(), cluster.devices_per_node)
        self.setup = Setup(micro_batch=work.pipe_micro_batch, tp=lay.tp, sp=lay.sp, act_bytes=work.act_bytes,
                           attention=work.attention, stack=work.stack, ep=lay.ep, autocast=work.autocast,
                           cp=lay.cp_folded, cp_impl=lay.cp_impl, float8=work.float8,
                           float8_gathered=work.float8 and lay.zero == 3)
        self.derived_tp = derived_tp
        self.op_counts = op_counts
        self.blocks = BlockOps(work.shape, self.setup)
        self._fwd, self._bwd = self.blocks.forward(), self.blocks.backward()
        # a checkpointed block under sequence parallelism keeps its Linears' gathered input (plait.plan.ops)
        redo = BlockOps(work.shape, self.setup, recomputed=True)
        self._fwd_r, self._bwd_r = redo.forward(), redo.backward()
        if work.shape.num_experts:
            moe = BlockOps(work.shape, self.setup, moe=True)
            self._moe_fwd, self._moe_bwd = moe.forward(), moe.backward()
            moe = BlockOps(work.shape, self.setup, moe=True, recomputed=True)
            self._moe_fwd_r, self._moe_bwd_r = moe.forward(), moe.backward()
        self._cache: dict[tuple, LayerCost] = {}

    # -- pricing ------------------------------------------------------------------------------------
    def comm_time(self, op: str, nbytes: float) -> float:
        return collective_time(self.profile, op, nbytes, self.tp_group)

    def _price(self, ops: list[Op], extra_comm: list[Collective] = ()) -> tuple[float, float, float, float]:
        """(compute seconds, tp collective seconds, weight-gradient seconds, expert all-to-all seconds) of
        ``ops`` in order. The all-to-alls run over the expert-parallel group, the rest over tp's."""
        compute = weight = comm = ep_comm = 0.0
        scale = self.work.act_bytes / 4  # derived collectives were recorded on fp32 meta tensors
        for op in ops:
            if op.kind == "comm" and op.comm == "all_to_all":
                ep_comm += collective_time(self.profile, "all_to_all", op.bytes, self.ep_group)
                continue
            if op.kind == "comm":
                if self.derived_tp is None:
                    comm += self.comm_time(op.comm, op.bytes) + (self.compute.overhead("tp_collective")
                                                                 if self.tp_group.size > 1 else 0.0)
                continue
            t = self.compute.time(op)
            compute += t
            if _is_weight_grad(op):
                weight += t
        per_collective = self.compute.overhead("tp_collective") if self.tp_group.size > 1 else 0.0
        for c in extra_comm:
            if c.op != "all_to_all":
                comm += self.comm_time(c.op, c.nbytes * scale) + per_collective
        return compute, comm, weight, ep_comm

    def _derived(self, backward: bool, which: str | None) -> list[Collective]:
        """Recorded collectives of a block, or of the rest of the model (charged to the head), in one pass."""
        if self.derived_tp is None or which is None:
            return []
        return [c for c in self.derived_tp[0 if which == "block" else 1] if c.backward == backward]

    def _dispatch(self, kind: str, priced: tuple[int, int]) -> tuple[float, float]:
        """(forward, backward) seconds of the operators counted on the real model beyond the ``priced`` ones."""
        c = self.op_counts
        if c is None or self.compute.cal is None:
            return 0.0, 0.0
        ops = {"block": c.block, "block_recomputed": c.block_recomputed, "rest": c.rest}[kind]
        dt = c.dtensor_rest if kind == "rest" else c.dtensor_block
        op_s, dt_s = self.compute.overhead("op"), self.compute.overhead("dtensor")
        return (max(0, ops[0] - priced[0]) * op_s + dt[0] * dt_s,
                max(0, ops[1] - priced[1]) * op_s + dt[1] * dt_s * (2 if kind == "block_recomputed" else 1))

    def _layer(self, fwd: Pass, bwd: Pass, recompute: str, dispatch: str | None,
               also_priced: tuple[int, int] = (0, 0)) -> LayerCost:
        """Cost of one layer; ``dispatch`` names its operator count (block, rest, or None: counted elsewhere),
        ``also_priced`` the operators of other layers that count charges here and that are priced there."""
        f_comp, f_comm, _, f_ep = self._price(fwd.ops, self._derived(False, dispatch))
        derived_bwd = self._derived(True, dispatch)
        if recompute != "none" and dispatch == "block":
            moe = getattr(self, "_moe_bwd_r", None) is bwd
            derived_bwd = self._without_regathers(derived_bwd, self._moe_bwd if moe else self._bwd)
        b_comp, b_comm, b_w, b_ep = self._price(bwd.ops, derived_bwd)
        f_comm, b_comm = f_comm + f_ep, b_comm + b_ep
        plait_selective = recompute == "selective" and self.work.stack == "plait"
        if dispatch is not None:
            n_f = sum(o.kind != "comm" for o in fwd.ops) + also_priced[0]
            n_b = sum(o.kind != "comm" for o in bwd.ops) + also_priced[1]
            if recompute in ("full", "block") or plait_selective:  # a selective recomputation dispatches every
                dispatch, n_b = "block_recomputed", n_b + n_f  # operator again (kept ones return their output)
            f_over, b_over = self._dispatch(dispatch, (n_f, n_b))
            f_comp, b_comp = f_comp + f_over, b_comp + b_over
        saved = fwd.saved()
        kept = zbv_kept(self.work.shape.norm)
        casts = sum(v for k, v in saved.items() if k.startswith(WEIGHT_CASTS))
        cost = LayerCost(fwd=f_comp + f_comm, bwd_in=b_comp - b_w + b_comm, bwd_w=b_w, tp_fwd=f_comm - f_ep,
                         tp_bwd=b_comm - b_ep, saved=sum(saved.values()) - casts,
                         flops=sum(o.flops for o in fwd.ops + bwd.ops), ep_fwd=f_ep, ep_bwd=b_ep,
                         zbv_kept=sum(v for k, v in saved.items() if k in kept), weight_casts=casts)
        if recompute in ("full", "block"):
            s_comp, s_comm, s_ep, s_flops = self._not_recomputed(fwd)
            cost.bwd_in += f_comp + f_comm - s_comp - s_comm - s_ep
            cost.tp_bwd += f_comm - f_ep - s_comm
            cost.ep_bwd += f_ep - s_ep
            cost.flops += sum(o.flops for o in fwd.ops) - s_flops
            cost.transient = cost.saved + cost.weight_casts  # rebuilt inside the block's backward
            cost.weight_casts = 0.0
            cost.saved = self.blocks.Mn * self.blocks.C * self.setup.residual_bytes
            if self.work.stack == "metaseq" and self.tp_group.size > 1:  # distributed checkpoints (plait.plan.ops)
                cost.saved /= self.tp_group.size
                gather = self.comm_time("all_gather", cost.saved * self.tp_group.size)
                cost.bwd_in += gather
                cost.tp_bwd += gather
            cost.zbv_kept = 0.0  # the recomputed graph is built and consumed inside the backward
            cost.recomputed = True
        elif plait_selective:
            self._keep_outputs(cost, fwd)
        elif recompute == "selective":
            core = self.blocks.attention_core()
            c_comp = self._price(core)[0]
            cost.bwd_in += c_comp
            cost.flops += sum(o.flops for o in core)
            dropped = sum(v for k, v in saved.items() if k in DROPPED_BY_SELECTIVE)
            cost.saved -= dropped
            cost.zbv_kept -= sum(v for k, v in saved.items() if k in DROPPED_BY_SELECTIVE and k in kept)
            cost.transient = dropped
        return cost

    def _without_regathers(self, recorded: list[Collective], plain: Pass) -> list[Collective]:
        """A checkpointed block's backward collectives from those recorded on a block that is not: without the
        all-gathers of the Linears' kept input shards, since a checkpointed block keeps the gathered input
        (``plait.parallel.tensor.regather.keep_gathered``; ``*.regather.bwd`` of the block's op list ``plain``)."""
        scale = self.work.act_bytes / 4  # recorded on fp32 meta tensors
        out = list(recorded)
        for op in plain.ops:
            if op.name.endswith(".regather.bwd"):
                match = next((c for c in out if c.op == op.comm and abs(c.nbytes * scale - op.bytes) <= 1), None)
                if match is not None:
                    out.remove(match)
        return out

    def _not_recomputed(self, fwd: Pass) -> tuple[float, float, float, float]:
        """(compute, tp collective, expert all-to-all seconds, FLOPs) of the forward operators a fully checkpointed
        block does not run again: torch's non-reentrant checkpoint (plait's) stops its recomputation once the last
        tensor the block saves is rebuilt (``torch.utils.checkpoint``'s early stop, on by default), before the
        operator that saves it runs: a Llama block's ``down_proj``, its reduce-scatter and the residual add (counted
        in ``tests/plan/test_recompute.py``). Megatron-LM's and metaseq's reentrant checkpoints rerun the whole
        forward."""
        if self.work.stack != "plait":
            return 0.0, 0.0, 0.0, 0.0
        last = max((i for i, op in enumerate(fwd.ops) if op.saves), default=-1)
        skipped = fwd.ops[last + 1:]
        comp, _, _, ep = self._price(skipped)
        per = self.compute.overhead("tp_collective") if self.tp_group.size > 1 else 0.0
        comm = sum(self.comm_time(op.comm, op.bytes) + per for op in skipped
                   if op.kind == "comm" and op.comm != "all_to_all")
        return comp, comm, ep, sum(o.flops for o in skipped)

    def _keep_outputs(self, cost: LayerCost, fwd: Pass) -> None:
        """plait's selective checkpointing of a block (module docstring): ``cost`` keeps the block's input and
        its matmuls' and attention kernel's outputs; the other forward operators up to the last that saves a
        tensor run again before the block's backward, which rebuilds the block's saved tensors meanwhile."""
        last = max((i for i, op in enumerate(fwd.ops) if op.saves), default=-1)
        redo = [op for op in fwd.ops[:last + 1] if op.kind not in ("matmul", "attention")]
        r_comp, _, _, r_ep = self._price(redo)
        # the recomputed collectives, priced from the op list even where the forward's are the recorded ones
        per = self.compute.overhead("tp_collective") if self.tp_group.size > 1 else 0.0
        r_comm = sum(self.comm_time(op.comm, op.bytes) + per for op in redo
                     if op.kind == "comm" and op.comm != "all_to_all")
        cost.bwd_in += r_comp + r_comm + r_ep
        cost.tp_bwd += r_comm
        cost.ep_bwd += r_ep
        cost.transient = cost.saved + cost.weight_casts
        cost.saved = self.blocks.Mn * self.blocks.C * self.setup.residual_bytes + sum(op.out for op in fwd.ops)
        cost.weight_casts = 0.0
        cost.zbv_kept = 0.0  # as for full recomputation: the rebuilt graph is consumed inside the backward
        cost.recomputed = True

    def block_recompute(self, index: int) -> str:
        lay = self.work.layout
        if lay.recompute == "full" or (lay.recompute == "every_k" and index % max(lay.every_k, 1) == 0):
            return "block"
        return "selective" if lay.recompute == "selective" else "none"

    def block(self, index: int) -> LayerCost:
        """Cost of block ``index`` (checkpointed or not by the layout's recompute mode)."""
        mode, moe = self.block_recompute(index), self.work.shape.is_moe(index)
        if ("block", mode, moe) not in self._cache:
            if mode == "none":
                fwd, bwd = (self._moe_fwd, self._moe_bwd) if moe else (self._fwd, self._bwd)
            else:
                fwd, bwd = (self._moe_fwd_r, self._moe_bwd_r) if moe else (self._fwd_r, self._bwd_r)
            cost = self._layer(fwd, bwd, mode, "block")
            if self.work.layout.cp_folded > 1:
                cost = self._context(cost, fwd, bwd, mode != "none")
            if self.work.layout.act_offload and mode == "none":
                cost = self._offload(cost)
            self._cache[("block", mode, moe)] = cost
        return self._cache[("block", mode, moe)]

    def _context(self, cost: LayerCost, fwd: Pass, bwd: Pass, recomputed: bool) -> LayerCost:
        """A block of a context-parallel rank (``Workload.rank_view``) with its cp collectives: the ring's
        key/value shifts overlapped with the attention core's blocks (``plait.plan.layouts.ring_attention``: what a
        shift takes beyond its block's compute is exposed), all-to-all's and all-gather's in the compute stream; a
        recomputed block runs its forward's again in backward. ``detail["cp_bytes"]``: the bytes a rank sends
        (``plait.plan.layouts.context_wire_bytes``)."""
        from plait.plan.layouts import context_wire_bytes, ring_attention, ulysses

        lay, s, u = self.work.layout, self.work.shape, self.setup
        cp, impl = lay.cp_folded, lay.cp_impl
        group = group_span(self.placement.cp_group(), self.cluster.devices_per_node)
        seq, a = s.seq_len * cp, u.act_bytes
        heads, kv_heads = s.n_head // lay.tp, max(1, s.n_kv_head // lay.tp)
        if impl == "ring":
            attn_f = sum(self.compute.time(op) for op in fwd.ops if op.kind == "attention")
            attn_b = sum(self.compute.time(op) for op in bwd.ops if op.kind == "attention")
            priced = ring_attention(self.profile, u.micro_batch, seq, kv_heads * s.head_dim, 1, 4, group, attn_f,
                                    attn_b)
            f_s, b_s = priced.exposed_fwd, priced.exposed_bwd
        elif impl == "alltoall":
            priced = ulysses(self.profile, u.micro_batch, seq, heads * s.head_dim, heads * s.head_dim, 1, a, group)
            f_s, b_s = priced.exposed_fwd, priced.exposed_bwd
        else:  # the keys and values gathered in forward, gathered again in backward, their gradients reduced
            kv = u.micro_batch * kv_heads * s.seq_len * s.head_dim
            f_s = collective_time(self.profile, "all_gather", 2 * kv * a * cp, group)
            b_s = f_s + collective_time(self.profile, "all_reduce", 2 * kv * a * cp, group)
        sent = context_wire_bytes(impl, u.micro_batch, seq, heads, s.head_dim, cp, a, 1, int(recomputed),
                                  kv_heads=kv_heads)
        detail = {**cost.detail, "cp_bytes": sent, "cp_exposed_s": f_s + b_s + (f_s if recomputed else 0.0)}
        return replace(cost, fwd=cost.fwd + f_s, bwd_in=cost.bwd_in + b_s + (f_s if recomputed else 0.0),
                       detail=detail)

    def _offload(self, cost: LayerCost) -> LayerCost:
        """A block under activation offload (``plait.parallel.offload``): everything it saves (its activations and
        autocast's weight copies) moves to host memory after its forward and back before its backward. On a GPU the
        copies run on a side stream over the host link, behind the next block's forward and the previous one's
        backward: only what outlasts the block's own compute is exposed. On a CPU the copy runs on the rank's
        thread (the host is its own memory, so backward reads it where it is). The device keeps the block being
        copied and the one brought back ahead of its backward (``transient``)."""
        # rotary's cos and sin, which every block saves, move with each block (they stay on the device too)
        rotary = embedding_ops(self.work.shape, self.setup)[0].saved().get("embed.rotary", 0.0)
        moved = cost.saved + cost.weight_casts + rotary
        out = replace(cost, saved=0.0, weight_casts=0.0, zbv_kept=0.0, host=moved,
                      transient=max(cost.transient, 2 * moved))
        if self.profile.kind == "cpu":
            out.fwd += self.compute.time(Op("offload.copy", "copy", bytes=2 * moved))
            return out
        if self.profile.host_bandwidth <= 0:
            raise ConfigError(f"hardware profile {self.profile.name!r} gives no [device] host_bandwidth, which "
                              "prices train.activation_offload's copies; add it (bytes/s per direction to pinned "
                              "host memory) or set train.activation_offload=false")
        seconds = moved / self.profile.host_bandwidth
        out.fwd += max(0.0, seconds - cost.fwd)
        out.bwd_in += max(0.0, seconds - cost.bwd)
        return out

    def embed(self) -> LayerCost:
        if ("embed",) not in self._cache:
            f, b = embedding_ops(self.work.shape, self.setup)
            # its operators are counted with the head's. Rotary's cos and sin stay alive under checkpointing too:
            # every checkpointed block holds them as inputs of its recomputation.
            self._cache[("embed",)] = self._layer(f, b, "none", None)
        return self._cache[("embed",)]

    def head(self) -> LayerCost:
        if ("head",) not in self._cache:
            f, b = head_ops(self.work.shape, self.setup, loss_parallel=self.work.layout.loss_parallel)
            ef, eb = embedding_ops(self.work.shape, self.setup)
            embed_ops = (sum(o.kind != "comm" for o in ef.ops), sum(o.kind != "comm" for o in eb.ops))
            cost = self._layer(f, b, "none", "rest", embed_ops)
            # the logits and their gradient exist between the head's forward and backward
            m, v = self.setup.micro_batch * self.work.shape.seq_len, self.work.shape.vocab_size // self.setup.tp
            cost.transient = max(cost.transient, 2 * m * v * 4)
            self._cache[("head",)] = cost
        return self._cache[("head",)]

    # -- stages -------------------------------------------------------------------------------------
    def partition(self, num_stages: int) -> list[range]:
        """Blocks of each stage, split by the trainer's ``partition_units`` (the first / last stage may hold the
        embedding / the head alone under ``Layout.split_embedding`` / ``split_head``)."""
        lay, n = self.work.layout, self.work.shape.n_layer
        if num_stages == 1:
            return [range(n)]
        units = (lay.split_embedding, lay.split_head)
        if lay.pp_balance == "count":  # the embedding and the head count as one layer each where they are units
            return _partition((1.0,) * n, num_stages, float(units[0]), float(units[1]), units)
        costs = tuple(self.block(i).total for i in range(n))
        return _partition(costs, num_stages, self.embed().total, self.head().total, units)

    @property
    def gradient_bytes(self) -> int:
        """Bytes per gradient element the data-parallel reduction sends: plait's reducer, ZeRO and FSDP2 reduce
        fp32 gradients (plait's mixed precision is autocast over fp32 parameters, FSDP2's reduce dtype fp32);
        the half-precision stacks reduce their half gradient buffers (Megatron-LM's default without
        --accumulate-allreduce-grads-in-fp32; metaseq's memory-efficient fp16)."""
        return self.work.act_bytes if self.work.stack != "plait" else 4

    def stage(self, layers: range, first: bool, last: bool) -> LayerCost:
        """Summed cost of a stage: its blocks, plus the embedding if ``first`` and the head if ``last``; in a
        pipeline also what the stage itself holds per micro-batch (``stage_held``)."""
        total = LayerCost()
        for i in layers:
            total = total + self.block(i)
        rotary = self._rotary() if len(layers) else 0.0  # cos and sin: computed where there are layers to use them
        if first:
            total = total + self.embed()
            total.saved -= self._rotary() - rotary  # an embedding alone computes none
        if last:
            total = total + self.head()
        if self.work.layout.pp > 1 and self.work.stack == "plait":  # torch's pipelining (Megatron-LM frees these)
            total.saved += self.stage_held(first, last, len(layers))
            if first:  # ZBV: the first stage has no input gradient; its weight pass is its whole backward
                total.zbv_kept = 0.0
            elif "embed.rotary" in zbv_kept(self.work.shape.norm):  # this stage's own cos and sin
                total.zbv_kept += rotary
            if last and not first:  # measured, see plait.plan.schedule
                saved = self._fwd.saved()
                total.zbv_kept += len(layers) * sum(saved.get(k, 0.0) for k in ZBV_KEPT_LAST)
        return total

    def _rotary(self) -> float:
        """Bytes of rotary's cos and sin for one micro-batch (0 for a model without rotary positions)."""
        return embedding_ops(self.work.shape, self.setup)[0].saved().get("embed.rotary", 0.0)

    def stage_held(self, first: bool, last: bool, layers: int = 1) -> float:
        """Bytes a pipeline stage holds per micro-batch in flight beyond its layers' saved tensors (measured on
        plait's runs, ``tests/plan/test_pipeline_memory.py``): rotary's cos and sin, which every stage with
        ``layers`` computes for them (the embedding's term covers the first stage's), and the stage's output,
        which torch's schedule keeps until the micro-batch's backward: the residual stream's shard, or on the last
        stage the logits (whole vocabulary unless the loss runs on vocabulary shards)."""
        s, u = self.work.shape, self.setup
        rotary = 0.0 if first or not layers else self._rotary()
        M = u.micro_batch * s.seq_len
        if last:
            vocab = s.vocab_size // u.tp if self.work.layout.loss_parallel else s.vocab_size
            return rotary + M * vocab * u.act_bytes
        return rotary + self.hop_bytes

    @property
    def hop_bytes(self) -> float:
        """Bytes of what a pipeline stage sends on per micro-batch, and of the gradient that comes back: the
        residual stream, this rank's shard of it under sequence parallelism."""
        s, u = self.work.shape, self.setup
        M = u.micro_batch * s.seq_len
        return float((M // u.tp if u.sp else M) * s.d_model * u.residual_bytes)


@lru_cache(maxsize=256)
def _partition(costs: tuple[float, ...], num_stages: int, first: float, last: float,
               units: tuple[bool, bool] = (False, False)) -> list[range]:
    """``partition_units`` memoised: the planner prices many layouts with the same per-layer costs."""
    from plait.plan.schedule import partition_units

    return partition_units(list(costs), num_stages, first_cost=first, last_cost=last, embedding_unit=units[0],
                           head_unit=units[1])
