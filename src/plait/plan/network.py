"""Where ranks sit and what a collective costs between them: an alpha-beta model per topology level.

Placement follows ``plait.topology``: mesh axes ``pp, replicas, dp, ep, cp, tp`` with tp innermost, so global
rank ``r = ((((pp_i * replicas + r_i) * dp + dp_i) * ep + ep_i) * cp + cp_i) * tp + tp_i``, and ranks fill nodes in
order (``node = r // devices_per_node``). ``Placement.dp`` is the mesh's ``dp_replicate x dp_shard``: with expert
parallelism the data-parallel degree is ``dp x ep`` (``plait.topology``); the context-parallel ranks of a sequence
sit between ep and tp (``plait.topology``'s order) and average their gradients with the data-parallel ones
(``dp_cp``); ``replicas`` are DiLoCo's replicas (the mesh's ``dp_replicate`` under ``parallel.sync = "diloco"``),
which train apart and meet every H steps (``plait.plan.workload.Workload.replica_view``). A group is described by
its size, the nodes it spans and its ranks per node.

Cost of a collective over a group of ``n`` ranks on ``N`` nodes, ``k`` of them per node, on a buffer of
``S`` bytes (``S`` is the reduced buffer for all-reduce, the gathered output for all-gather, the input
for reduce-scatter and all-to-all). The group's bus bandwidth ``B`` is ``intra.bandwidth x efficiency``
inside one node; across nodes ``min(intra, k x inter.bandwidth x inter.efficiency)``: every GPU of a node
communicates at once in a symmetric layout, so each has its share of the node's NICs (its rail; DGX:
one NIC per GPU), and a ring that enters and leaves each node ``k`` times, once per channel, uses ``k``
of them.

A profile with a ``[network.nccl]`` table prices all-reduce, all-gather, reduce-scatter and broadcast
with NCCL's own model (``plait.plan.nccl``): the algorithm (ring, or tree for all-reduce) and protocol
NCCL picks at that size, each hop's latency (NVLink inside a node, the network across), and the
bus-bandwidth factors nccl-tests reports (``2(n-1)/n`` all-reduce, ``(n-1)/n`` all-gather and
reduce-scatter, 1 broadcast). A ring of ``n`` ranks pays ``n - 1`` hops per gather (``2(n-1)`` per
all-reduce): at thousands of ranks that latency is milliseconds per collective.

Without it (the alpha-beta model), with ``a`` the latency terms:

=================  ==================================  ============================================
collective         bandwidth term                      latency term
=================  ==================================  ============================================
all-reduce         ``2 (n-1)/n x S / B``               ``a_intra + 2 log2(N) a_inter``
all-gather,        ``(n-1)/n x S / B``                 ``a_intra + log2(N) a_inter``
reduce-scatter
broadcast          ``S / B``                           ``a_intra + log2(N) a_inter``
=================  ==================================  ============================================

All-to-all (NCCL runs it as point-to-point sends to every peer): each rank sends ``S / n`` to each
peer, ``(n - k) / n x S`` of it off the node through its own NIC share and ``(k - 1) / n x S`` over
NVLink, both at once; plus one message latency per level it crosses. Send / recv: ``S / link bandwidth``
plus the link's latency.

Calibrated (cpu) profiles carry a fitted ``alpha + beta x S`` per collective and world size from
``plait calibrate`` (measured on this machine's backend), used as they are; a world size that was not
measured scales the nearest measured one by the ratio of the bandwidth terms above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plait.plan.hardware import HardwareProfile
from plait.plan.nccl import NCCL_OPS, Choice, choose

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send")


@dataclass(frozen=True)
class Group:
    """A process group's span: ``size`` ranks over ``nodes`` nodes, ``per_node`` of them on each."""

    size: int
    nodes: int = 1
    per_node: int = 0

    @property
    def ranks_per_node(self) -> int:
        return self.per_node or self.size


def group_span(ranks: list[int], devices_per_node: int) -> Group:
    """The span of the group of global ``ranks`` when nodes hold ``devices_per_node`` ranks each."""
    nodes: dict[int, int] = {}
    for r in ranks:
        nodes[r // devices_per_node] = nodes.get(r // devices_per_node, 0) + 1
    return Group(size=len(ranks), nodes=len(nodes), per_node=max(nodes.values()))


@dataclass(frozen=True)
class Placement:
    """Mesh degrees and the rank of each coordinate (see the module docstring)."""

    pp: int
    dp: int
    tp: int
    ep: int = 1
    cp: int = 1
    replicas: int = 1

    def rank(self, pp_i: int, dp_i: int, tp_i: int, ep_i: int = 0, cp_i: int = 0, replica: int = 0) -> int:
        outer = (pp_i * self.replicas + replica) * self.dp + dp_i
        return ((outer * self.ep + ep_i) * self.cp + cp_i) * self.tp + tp_i

    def _flat(self, f: int, pp_i: int, tp_i: int) -> int:
        """Rank of the ``f``-th data-parallel rank of a replica (``dp_cp``'s order: dp, then ep, then cp)."""
        return self.rank(pp_i, f // (self.ep * self.cp), tp_i, f // self.cp % self.ep, f % self.cp)

    def tp_group(self, pp_i: int = 0, dp_i: int = 0) -> list[int]:
        return [self.rank(pp_i, dp_i, t) for t in range(self.tp)]

    def dp_group(self, pp_i: int = 0, tp_i: int = 0) -> list[int]:
        """Every rank gradients are averaged over (``dp_cp``: expert-parallel and context-parallel ones included)."""
        return [self._flat(f, pp_i, tp_i) for f in range(self.dp * self.ep * self.cp)]

    def ep_group(self, pp_i: int = 0, dp_i: int = 0, tp_i: int = 0) -> list[int]:
        """The ranks that share out one MoE layer's experts."""
        return [self.rank(pp_i, dp_i, tp_i, e) for e in range(self.ep)]

    def cp_group(self, pp_i: int = 0, dp_i: int = 0, tp_i: int = 0) -> list[int]:
        """The ranks that split one sequence."""
        return [self.rank(pp_i, dp_i, tp_i, 0, c) for c in range(self.cp)]

    def expert_dp_group(self, pp_i: int = 0, tp_i: int = 0, ep_i: int = 0) -> list[int]:
        """The ranks holding the same experts (their gradients are summed over it: ``dp x cp / ep`` of them)."""
        return [self.rank(pp_i, d, tp_i, ep_i, c) for d in range(self.dp) for c in range(self.cp)]

    def shard_group(self, shard: int, pp_i: int = 0, tp_i: int = 0) -> list[int]:
        """Hybrid sharding: the ``shard`` consecutive data-parallel ranks of one shard group (the mesh's
        ``dp_shard_cp``: ``dp_shard`` inside ``dp_replicate``, with the cp ranks inside it)."""
        return [self._flat(f, pp_i, tp_i) for f in range(shard)]

    def replica_group(self, shard: int, pp_i: int = 0, tp_i: int = 0) -> list[int]:
        """Hybrid sharding: the ranks holding the same shard, one per shard group."""
        return [self._flat(f, pp_i, tp_i) for f in range(0, self.dp * self.ep * self.cp, shard)]

    def diloco_group(self, pp_i: int = 0, tp_i: int = 0) -> list[int]:
        """DiLoCo: the ranks holding the same part of the model, one per replica (the outer all-reduce's group)."""
        return [self.rank(pp_i, 0, tp_i, replica=r) for r in range(self.replicas)]

    def pp_group(self, dp_i: int = 0, tp_i: int = 0) -> list[int]:
        return [self.rank(p, dp_i, tp_i) for p in range(self.pp)]


def _bus_bandwidth(profile: HardwareProfile, group: Group) -> float:
    intra = profile.intra.bandwidth * profile.intra.efficiency
    if group.nodes <= 1:
        return intra
    return min(intra, group.ranks_per_node * profile.inter.bandwidth * profile.inter.efficiency)


def _latency(profile: HardwareProfile, group: Group, inter_levels: float) -> float:
    intra = profile.intra.latency_s if group.ranks_per_node > 1 else 0.0
    return intra + (inter_levels * profile.inter.latency_s if group.nodes > 1 else 0.0)


def _analytic(profile: HardwareProfile, op: str, nbytes: float, group: Group) -> float:
    n = group.size
    if op == "send":
        link = profile.intra if group.nodes <= 1 else profile.inter
        return nbytes / (link.bandwidth * link.efficiency) + link.latency_s
    if op == "all_to_all":
        return _all_to_all(profile, nbytes, group)
    bus = _bus_bandwidth(profile, group)
    levels = math.log2(group.nodes) if group.nodes > 1 else 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes / bus + _latency(profile, group, 2 * levels)
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * nbytes / bus + _latency(profile, group, levels)
    if op == "broadcast":
        return nbytes / bus + _latency(profile, group, levels)
    raise ValueError(f"unknown collective {op!r}; one of {COLLECTIVES}")


def _all_to_all(profile: HardwareProfile, nbytes: float, group: Group) -> float:
    """Point-to-point exchange: the NVLink part and the NIC part run at once (module docstring)."""
    n, k = group.size, min(group.ranks_per_node, group.size)
    intra = (k - 1) / n * nbytes / (profile.intra.bandwidth * profile.intra.efficiency)
    if group.nodes <= 1:
        return intra + profile.intra.latency_s
    inter = (n - k) / n * nbytes / (profile.inter.bandwidth * profile.inter.efficiency)
    return max(intra, inter) + profile.inter.latency_s + (profile.intra.latency_s if k > 1 else 0.0)


def nccl_choice(profile: HardwareProfile, op: str, nbytes: float, group: Group) -> Choice | None:
    """NCCL's pick (``plait.plan.nccl.Choice``: seconds, algorithm, protocol) for ``op`` over ``group``;
    None when the profile has no ``[network.nccl]`` table or NCCL's model does not cover ``op``."""
    if profile.nccl is None or op not in NCCL_OPS or group.size <= 1:
        return None
    return choose(profile.nccl, op, nbytes, group.size, group.nodes, _bus_bandwidth(profile, group))


def _ring_factor(op: str, n: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n, "send": 1.0, "broadcast": 1.0}.get(op, (n - 1) / n)


def _measured(profile: HardwareProfile, op: str, nbytes: float, group: Group) -> float:
    table = profile.calibration.collectives
    worlds = sorted(w for (o, w) in table if o == op)
    if not worlds:
        fallback = "all_reduce" if op != "send" else None
        if fallback is None or not any(o == fallback for o, _ in table):
            return _analytic(profile, op, nbytes, group)
        row = table[(fallback, min(w for o, w in table if o == fallback))]
        scale = 0.5  # a gather or scatter moves half an all-reduce's bytes
    else:
        w = min(worlds, key=lambda x: abs(x - group.size))
        row = table[(op, w)]
        scale = _ring_factor(op, group.size) / _ring_factor(op, w)
    return float(row["alpha_s"]) + scale * float(row["beta_s_per_byte"]) * nbytes


def collective_time(profile: HardwareProfile, op: str, nbytes: float, group: Group) -> float:
    """Seconds for one collective ``op`` on ``nbytes`` over ``group`` (0 for a group of one rank)."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    if profile.calibration is not None:
        return _measured(profile, op, nbytes, group)
    choice = nccl_choice(profile, op, nbytes, group)
    if choice is not None:
        return choice.seconds
    return _analytic(profile, op, nbytes, group)
