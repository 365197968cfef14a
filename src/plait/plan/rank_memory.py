"""Per-rank memory: model states by layout, activations by schedule, buffers.

Model states follow what the stack holds right after backward (``plait.plan.memory``'s table, extended to
tensor and pipeline parallelism), per parameter ``P + G + K`` bytes (``state_bytes``): plait keeps fp32
parameters, gradients and AdamW's two states (its bf16 is autocast, or FSDP2's bf16 compute copies):
``4 + 4 + 8``; a half-precision stack (Megatron-LM, DeepSpeed, metaseq) keeps half parameters and
gradients and an fp32 master copy with the two states: ``2 + 2 + 12`` (the ZeRO paper's ``K = 12``).
Data parallel: all of it per local parameter; ZeRO-1: parameters and gradients in flat buckets padded to a
multiple of dp, states ``K / dp``; ZeRO-2: gradients ``G / dp`` as well; ZeRO-3 (FSDP): every parameter's
dim 0 split in dp padded chunks, all three sharded (under HSDP in ``dp_shard`` chunks: ``16 psi / dp_shard``
for fp32 AdamW). Local parameters are the tensor-parallel shards of the rank's pipeline stages (a tied head
on the last stage has its own copy of the token table). Pipeline stages compose with every ZeRO stage the
same way (over the stage's data-parallel group).

Under fp8 FSDP2 gathers the float8 Linears' weights in float8 (one byte per element: torchao's float8 all-gather,
``gathered_bytes``). Under DiLoCo (a replica view, ``plait.plan.workload.Workload.replica_view``) each rank also keeps
the outer optimizer's float32 start weights and momentum of what it holds (``outer_numel``): ``8`` bytes per element,
counted with the optimizer states; the pseudo-gradient's buffer exists only during the synchronisation after the
optimizer step, when the activations are gone, so it is not on the peak.

Activations: the bytes saved for backward (``plait.plan.ops``) times the micro-batches alive at once:
one accumulation micro-batch without pipelining, the schedule's peak (``plait.plan.schedule``) with it.
Buffers: the largest transient (a checkpointed block's recompute, the logits and their gradient), plus
the layout's communication buffers (ZeRO-2's full buckets in flight; FSDP's unsharded units in the gather
dtype: the root and two blocks around the one computing, or, without ``reshard_after_forward``, every
unit from its forward to its backward; the tensor-parallel reducer's bucket copies of DTensor gradients,
DDP's bucket copies), and autocast's half-precision weight copies (``plait.plan.ops``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.plan.derive import fsdp_shard_numel, fsdp_units, zero_buckets
from plait.plan.ops_float8 import is_float8_weight
from plait.plan.params import Param
from plait.plan.workload import Workload

STATE_BYTES = 8  # AdamW: exp_avg and exp_avg_sq, fp32
OUTER_BYTES = 8  # DiLoCo: the start weights and the outer momentum, fp32 (plait.parallel.data.diloco)


def state_bytes(work: Workload) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes per parameter for the workload's stack (module docstring)."""
    if work.stack == "plait" or work.precision == "fp32":
        return 4, 4, STATE_BYTES
    return work.act_bytes, work.act_bytes, 4 + STATE_BYTES


def gather_bytes(work: Workload) -> int:
    """Bytes per element of an FSDP unit gathered for compute: FSDP2's bf16 ``param_dtype`` under plait's bf16,
    the stack's own half parameters otherwise."""
    if work.stack == "plait":
        return 2 if work.precision in ("bf16", "fp8") else 4
    return work.act_bytes


def gathered_bytes(params: list[Param], work: Workload) -> float:
    """Bytes of ``params`` (this rank's tensor-parallel shards) gathered whole for compute at ZeRO-3: ``gather_bytes``
    per element, one for the float8 Linears' weights under fp8 (module docstring)."""
    tp, n_layer, each = work.layout.tp, work.shape.n_layer, gather_bytes(work)
    return float(sum(p.local_numel(tp) * (1 if work.float8 and is_float8_weight(p, n_layer) else each)
                     for p in params))


def outer_numel(params: list[Param], work: Workload) -> float:
    """Elements of ``params`` a rank runs DiLoCo's outer step on (``plait.parallel.data.diloco``): its tensor-parallel
    shards, at ZeRO-3 its FSDP shard of them (of its experts' over the ranks holding the same experts), at ZeRO-1/2
    whole."""
    lay = work.layout
    if lay.zero != 3:
        return float(sum(p.local_numel(lay.tp) for p in params))
    edp = lay.dp // lay.ep
    return float(sum(p.local_numel(lay.tp) / edp if p.expert and lay.ep > 1 else fsdp_shard_numel(p, lay.tp, lay.shard)
                     for p in params))


@dataclass
class RankMemory:
    """Bytes one rank holds; ``total`` is the predicted peak."""

    params: float
    grads: float
    optimizer: float
    activations: float = 0.0
    buffers: float = 0.0
    detail: dict = field(default_factory=dict)

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.buffers

    def as_dict(self) -> dict:
        return {"params": int(self.params), "grads": int(self.grads), "optimizer": int(self.optimizer),
                "model_states": int(self.model_states), "activations": int(self.activations),
                "buffers": int(self.buffers), "total": int(self.total), **self.detail}


def model_states(params: list[Param], work: Workload, n_layer: int) -> tuple[RankMemory, float]:
    """(model-state bytes of a rank holding ``params``, its communication buffers in bytes).

    With expert parallelism the rank's local experts (``E / ep`` of each MoE layer) are sharded apart from
    the dense parameters, over the ``dp / ep`` ranks holding the same experts (``plait.parallel.expert.dispatch``):
    their own ZeRO-1/2 buckets there, or FSDP2 units splitting each weight's dim 1 at ZeRO-3; whole (with
    a flattened gradient copy for their all-reduce) without ZeRO or when ``dp = ep``."""
    mem, buf = _expert_and_dense(params, work, n_layer)
    if work.layout.replicas_apart:  # DiLoCo's outer start weights and momentum
        outer = OUTER_BYTES * outer_numel(params, work)
        mem.optimizer += outer
        mem.detail = {**mem.detail, "diloco_outer_state": int(outer)}
    return mem, buf


def _expert_and_dense(params: list[Param], work: Workload, n_layer: int) -> tuple[RankMemory, float]:
    lay = work.layout
    experts = [p for p in params if p.expert] if lay.ep > 1 else []
    if not experts:  # sharded over the data-parallel ranks, or over the shard group under HSDP
        return _states(params, work, n_layer, lay.shard)
    dense, dense_buf = _states([p for p in params if not p.expert], work, n_layer, lay.shard)
    edp = lay.dp // lay.ep
    local = sum(p.local_numel(lay.tp) for p in experts)
    if lay.zero == 3 and edp > 1:
        shard = local / edp
        layer = max(sum(p.local_numel(lay.tp) for p in experts if p.layer == i) for i in {p.layer for p in experts})
        mem, buf = RankMemory(4 * shard, 4 * shard, STATE_BYTES * shard), 4 * layer  # one layer's unit gathered
    elif lay.zero in (1, 2) and edp > 1:
        mem, buf = _states(experts, work, n_layer, edp)
    else:
        mem, buf = RankMemory(4 * local, 4 * local, STATE_BYTES * local), 4 * local * (lay.dp > lay.ep)
    total = RankMemory(dense.params + mem.params, dense.grads + mem.grads, dense.optimizer + mem.optimizer)
    return total, dense_buf + buf


def _states(params: list[Param], work: Workload, n_layer: int, dp: int) -> tuple[RankMemory, float]:
    """Model states and buffers of ``params`` sharded by the layout's ZeRO stage over ``dp`` ranks."""
    lay = work.layout
    tp = lay.tp
    p_b, g_b, k_b = state_bytes(work)
    local = sum(p.local_numel(tp) for p in params)
    if lay.zero == 3:
        shard = sum(fsdp_shard_numel(p, tp, dp) for p in params)
        units = fsdp_units(params, n_layer)
        full = [gathered_bytes([params[i] for i in u], work) for u in units]
        if lay.reshard_after_forward and lay.pp == 1:  # the root unit stays gathered; two block units around one
            gathered = full[-1] + 2 * max(full[:-1] or [0])
        else:  # every unit stays gathered from its forward to its backward; in a pipeline, from the stage's first
            gathered = sum(full)  # backward to its reduce-scatter (torch's schedule turns resharding off there)
        if lay.offload == "params":  # FSDP2's CPUOffloadPolicy: the shards and the optimizer live in host memory
            return RankMemory(0.0, 0.0, 0.0, detail={"host_bytes": int((p_b + g_b + k_b) * shard)}), gathered
        return RankMemory(p_b * shard, g_b * shard, k_b * shard), gathered
    if lay.zero in (1, 2):
        buckets = zero_buckets(params, tp, lay.bucket_mb, dp)
        padded = sum(n for _, n in buckets)
        grads = padded if lay.zero == 1 else padded / dp
        buffers = 0.0 if lay.zero == 1 else g_b * 2 * max(n for _, n in buckets)
        if lay.offload == "optimizer":  # the optimizer shard's states live in host memory
            return RankMemory(p_b * padded, g_b * grads, 0.0, detail={"host_bytes": int(k_b * padded / dp)}), buffers
        return RankMemory(p_b * padded, g_b * grads, k_b * padded / dp), buffers
    buffers = g_b * local if dp > 1 and (tp > 1 or lay.impl == "torch") and work.stack == "plait" else 0.0
    return RankMemory(p_b * local, g_b * local, k_b * local), buffers
