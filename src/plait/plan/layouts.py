"""Prices of hybrid sharding, pipelines with ZeRO and context parallelism: pure functions of sizes, degrees and
a profile.

Hybrid sharding (HSDP: FSDP over groups of ``dp_shard`` ranks, replicated across the ``dp / dp_shard``
groups), pipeline stages composed with ZeRO-1/2/3 (``parallel.dp_shard``, ``plait.parallel.pipeline.sharded``) and
context parallelism (``cp``: ring attention, Ulysses all-to-all or all-gather; with pipelines, experts and hybrid
sharding too, ``plait.plan.workload``): the step simulator (``plait.plan.simulate``) prices them with these
functions and the planner enumerates them. Each function states its formula; bytes are per rank, seconds from
``plait.plan.network.collective_time`` (NCCL's model where the profile has it).

* HSDP model states: ``(P + G + K) x psi / dp_shard`` (``16 psi / dp_shard`` for fp32 AdamW); gradients:
  a reduce-scatter inside the shard group, then an all-reduce of the ``1 / dp_shard`` shard across the
  replicas; parameters: an all-gather inside the shard group.
* Pipeline + ZeRO (over the stage's data-parallel group, after the schedule's last backward): ZeRO-1
  all-reduces the stage's gradients and all-gathers the updated parameters after the optimizer; ZeRO-2
  reduce-scatters them instead; ZeRO-3 (FSDP) all-gathers the stage's units before its first action
  (and, with ``reshard_after_forward``, again before every forward and backward of every micro-batch)
  and reduce-scatters the gradients once per schedule step (under HSDP inside the shard group, then an
  all-reduce of the shard across the replicas).
* Context parallelism splits every token-sized activation ``cp`` ways (``saved / cp``). Ring attention
  passes K and V blocks around the ring: per layer forward ``(cp - 1)`` steps of ``2 b (s / cp) kv_dim / tp``
  elements, backward twice that (K, V and their gradients); each step overlaps one block of attention
  compute (``attention / cp``), so a step exposes ``max(0, transfer - block compute)``. Ulysses exchanges
  heads for sequence: per layer forward four all-to-alls over the cp group (q, k, v in, the output back) of
  ``b (s / cp) width / tp`` elements each (``width`` = ``d_model`` for q and the output, ``kv_dim`` for k and
  v), backward four more, in the compute stream.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.plan.hardware import HardwareProfile
from plait.plan.network import Group, collective_time


@dataclass(frozen=True)
class States:
    """Model-state bytes one rank holds."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def sharded_states(numel: float, per_param: tuple[int, int, int], zero: int, shard: int) -> States:
    """Model states of ``numel`` local parameters at ``(P, G, K)`` bytes each under ZeRO stage ``zero`` over
    ``shard`` ranks (ZeRO-1 shards K, -2 also G, -3 also P). Raises ``ValueError`` for another stage."""
    if zero not in (0, 1, 2, 3) or shard < 1:
        raise ValueError(f"ZeRO stage must be 0..3 over at least one rank; got zero={zero}, shard={shard}")
    p, g, k = per_param
    return States(p * numel / (shard if zero == 3 else 1), g * numel / (shard if zero >= 2 else 1),
                  k * numel / (shard if zero >= 1 else 1))


def hsdp_states(numel: float, per_param: tuple[int, int, int], dp_shard: int) -> States:
    """HSDP: everything sharded over the ``dp_shard`` ranks of a shard group (replicas hold the same)."""
    return sharded_states(numel, per_param, 3, dp_shard)


def hsdp_gradient_seconds(profile: HardwareProfile, grad_bytes: float, shard: Group, replicas: Group) -> float:
    """Reduce-scatter ``grad_bytes`` inside the shard group, then all-reduce the shard across the replicas."""
    return (collective_time(profile, "reduce_scatter", grad_bytes, shard)
            + collective_time(profile, "all_reduce", grad_bytes / max(shard.size, 1), replicas))


def hsdp_gather_seconds(profile: HardwareProfile, param_bytes: float, shard: Group) -> float:
    """All-gather ``param_bytes`` (the unit, gathered) inside the shard group; replicas gather in parallel."""
    return collective_time(profile, "all_gather", param_bytes, shard)


@dataclass(frozen=True)
class PipelineZero:
    """Seconds a pipeline stage spends on its data-parallel group under ZeRO: ``before`` its first action,
    ``per_action`` before each forward and backward (ZeRO-3 resharding after forward), ``after`` its last
    backward, and ``after_step`` after the optimizer (ZeRO-1/2's parameter all-gather)."""

    before: float = 0.0
    per_action: float = 0.0
    after: float = 0.0
    after_step: float = 0.0


def pipeline_zero(profile: HardwareProfile, zero: int, stage_numel: float, param_bytes: int, grad_bytes: int,
                  dp: Group, reshard_after_forward: bool = False, replicas: Group | None = None) -> PipelineZero:
    """The data-parallel traffic of one pipeline stage of ``stage_numel`` local parameters under ZeRO ``zero``
    over ``dp`` (module docstring); ``param_bytes`` per gathered element, ``grad_bytes`` per gradient one.
    ZeRO-3 under HSDP: ``dp`` is the shard group and ``replicas`` the groups' replicas."""
    grads, params = stage_numel * grad_bytes, stage_numel * param_bytes
    if zero == 0:
        return PipelineZero(after=collective_time(profile, "all_reduce", grads, dp))
    if zero in (1, 2):
        op = "all_reduce" if zero == 1 else "reduce_scatter"
        return PipelineZero(after=collective_time(profile, op, grads, dp),
                            after_step=collective_time(profile, "all_gather", params, dp))
    if zero == 3:
        gather = collective_time(profile, "all_gather", params, dp)
        after = (hsdp_gradient_seconds(profile, grads, dp, replicas) if replicas is not None and replicas.size > 1
                 else collective_time(profile, "reduce_scatter", grads, dp))
        return PipelineZero(before=gather, per_action=gather if reshard_after_forward else 0.0, after=after)
    raise ValueError(f"ZeRO stage must be 0..3; got {zero}")


def context_parallel_activations(saved_bytes: float, cp: int) -> float:
    """Saved activation bytes of one layer under context parallelism: every token-sized tensor split ``cp`` ways."""
    return saved_bytes / cp


@dataclass(frozen=True)
class ContextComm:
    """Per layer: bytes a rank sends forward and backward, and the seconds they expose."""

    bytes_fwd: float
    bytes_bwd: float
    exposed_fwd: float
    exposed_bwd: float


def ring_attention(profile: HardwareProfile, micro_batch: int, seq: int, kv_dim: int, tp: int, act_bytes: int,
                   cp: Group, attention_fwd_s: float, attention_bwd_s: float) -> ContextComm:
    """Ring attention over ``cp``: K and V blocks pass around the ring, each step hidden behind one block of the
    attention core (``attention_*_s``: the whole core's seconds on this rank at sequence ``seq / cp``)."""
    n = cp.size
    if n <= 1:
        return ContextComm(0.0, 0.0, 0.0, 0.0)
    block = 2 * micro_batch * (seq // n) * (kv_dim // tp) * act_bytes  # K and V of one block
    step = collective_time(profile, "send", block, cp)
    step_bwd = collective_time(profile, "send", 2 * block, cp)  # K, V and, the other way, dK, dV
    exposed_fwd = (n - 1) * max(0.0, step - attention_fwd_s / n)
    exposed_bwd = (n - 1) * max(0.0, step_bwd - attention_bwd_s / n)
    return ContextComm((n - 1) * block, (n - 1) * 2 * block, exposed_fwd, exposed_bwd)


def ulysses(profile: HardwareProfile, micro_batch: int, seq: int, d_model: int, kv_dim: int, tp: int,
            act_bytes: int, cp: Group) -> ContextComm:
    """Ulysses over ``cp``: four all-to-alls forward and four backward per layer, in the compute stream."""
    if cp.size <= 1:
        return ContextComm(0.0, 0.0, 0.0, 0.0)
    tokens = micro_batch * (seq // cp.size)
    sizes = [tokens * w // tp * act_bytes for w in (d_model, kv_dim, kv_dim, d_model)]
    seconds = sum(collective_time(profile, "all_to_all", b, cp) for b in sizes)
    return ContextComm(sum(sizes), sum(sizes), seconds, seconds)


def context_wire_bytes(impl: str, micro_batch: int, seq: int, heads: int, head_dim: int, cp: int, act_bytes: int,
                       layers: int, recomputed: int = 0, nccl: bool = False, kv_heads: int | None = None) -> int:
    """Bytes one rank puts on the wire for context parallelism in one micro-step (forward and backward), by the
    ring model plait's comm accounting counts with (``plait.comm.accounting.wire_bytes``): ``heads`` are the
    attention heads this rank attends with (the query heads over tp), ``kv_heads`` its key-value heads (default
    ``heads``; grouped-query keys and values travel with their own heads under ``ring`` and ``allgather`` and are
    repeated to the query heads under ``alltoall``), ``seq`` the whole sequence, ``layers`` the attention layers,
    ``recomputed`` those whose forward runs again in backward (activation checkpointing). Per layer, with
    ``x = B H (seq / cp) D`` elements and ``kv = B H_kv (seq / cp) D``:

    * ``ring`` (float32 blocks): forward ``cp - 1`` shifts of keys and values (``2 kv``), backward ``cp - 1``
      more and ``cp`` shifts of their gradients: ``(3 cp - 2) 2 kv`` floats;
    * ``alltoall``: forward one all-to-all of q, k, v (``3x``) and one of the output (``x``), backward the same,
      each ``(cp - 1) / cp`` of its input;
    * ``allgather``: forward an all-gather of keys and values (``(cp - 1) 2 kv``; only the rank's own shard is
      kept for backward), backward the same all-gather again and their gradients over the whole sequence
      (``2 cp kv``) all-reduced (gloo: ``2 (cp - 1) / cp`` of it) or, under NCCL, reduce-scattered
      (``(cp - 1) / cp`` of it)."""
    from plait.plan.wire import wire_bytes

    if cp <= 1:
        return 0
    x = micro_batch * heads * (seq // cp) * head_dim
    kv = micro_batch * (heads if kv_heads is None else kv_heads) * (seq // cp) * head_dim
    if impl == "ring":
        fwd, bwd = (cp - 1) * 2 * kv * 4, (2 * cp - 1) * 2 * kv * 4
    elif impl == "alltoall":
        fwd = wire_bytes("alltoall", 3 * x * act_bytes, cp) + wire_bytes("alltoall", x * act_bytes, cp)
        bwd = fwd
    elif impl == "allgather":
        fwd = wire_bytes("allgather", 2 * kv * act_bytes, cp)
        bwd = fwd + wire_bytes("reduce_scatter" if nccl else "allreduce", 2 * cp * kv * act_bytes, cp)
    else:
        raise ValueError(f"cp_impl must be ring, alltoall or allgather; got {impl!r}")
    return layers * (fwd + bwd) + recomputed * fwd
