"""Where ranks sit and what a collective costs between them: an alpha-beta model per topology level.

Placement follows ``plait.topology``: mesh axes ``pp, dp, ep, tp`` with tp innermost, so global rank
``r = ((pp_i * dp + dp_i) * ep + ep_i) * tp + tp_i``, and ranks fill nodes in order
(``node = r // devices_per_node``). ``Placement.dp`` is the mesh's ``dp_replicate``: with expert
parallelism the data-parallel degree is ``dp x ep`` (``plait.topology``). A group is described by its
size, the nodes it spans and its ranks per node.

Cost of a collective over a group of ``n`` ranks on a buffer of ``S`` bytes (``S`` is the reduced
buffer for all-reduce, the gathered output for all-gather, the input for reduce-scatter and
all-to-all), with ``B`` the bus bandwidth (``intra.bandwidth x efficiency`` inside one node; across
nodes ``min(intra, ranks_per_node x inter.bandwidth x efficiency)``, every device driving its own NIC,
as NCCL's rings do) and ``a`` the latency term:

=================  ==================================  ============================================
collective         bandwidth term                      latency term
=================  ==================================  ============================================
all-reduce         ``2 (n-1)/n x S / B``               ``a_intra + 2 log2(nodes) a_inter``
all-gather,        ``(n-1)/n x S / B``                 ``a_intra + log2(nodes) a_inter``
reduce-scatter
all-to-all         ``(n-1)/n x S / B``                 ``a_intra + (nodes - 1) a_inter``
send / recv        ``S / link bandwidth``              one level's ``a``
=================  ==================================  ============================================

``a_intra`` is a small collective's latency inside a node (counted when the group has more than one
rank there), ``a_inter`` the latency added per level of the tree NCCL uses across nodes.

Calibrated (cpu) profiles carry a fitted ``alpha + beta x S`` per collective and world size from
``plait calibrate`` (measured on this machine's backend), used as they are; a world size that was not
measured scales the nearest measured one by the ratio of the bandwidth terms above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plait.plan.hardware import HardwareProfile

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

    def rank(self, pp_i: int, dp_i: int, tp_i: int, ep_i: int = 0) -> int:
        return ((pp_i * self.dp + dp_i) * self.ep + ep_i) * self.tp + tp_i

    def tp_group(self, pp_i: int = 0, dp_i: int = 0) -> list[int]:
        return [self.rank(pp_i, dp_i, t) for t in range(self.tp)]

    def dp_group(self, pp_i: int = 0, tp_i: int = 0) -> list[int]:
        """Every data-parallel rank (expert-parallel ones included: they process their own batches)."""
        return [self.rank(pp_i, d, tp_i, e) for d in range(self.dp) for e in range(self.ep)]

    def ep_group(self, pp_i: int = 0, dp_i: int = 0, tp_i: int = 0) -> list[int]:
        """The ranks that share out one MoE layer's experts."""
        return [self.rank(pp_i, dp_i, tp_i, e) for e in range(self.ep)]

    def expert_dp_group(self, pp_i: int = 0, tp_i: int = 0, ep_i: int = 0) -> list[int]:
        """The ranks holding the same experts (their gradients are summed over it)."""
        return [self.rank(pp_i, d, tp_i, ep_i) for d in range(self.dp)]

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
    bus = _bus_bandwidth(profile, group)
    levels = math.log2(group.nodes) if group.nodes > 1 else 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes / bus + _latency(profile, group, 2 * levels)
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * nbytes / bus + _latency(profile, group, levels)
    if op == "all_to_all":
        return (n - 1) / n * nbytes / bus + _latency(profile, group, group.nodes - 1)
    if op == "broadcast":
        return nbytes / bus + _latency(profile, group, levels)
    raise ValueError(f"unknown collective {op!r}; one of {COLLECTIVES}")


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
    return _analytic(profile, op, nbytes, group)
