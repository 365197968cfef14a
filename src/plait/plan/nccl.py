"""NCCL's own cost model: which algorithm and protocol NCCL runs for a collective of a size, and its time.

A re-statement of NCCL's tuning model (NVIDIA/nccl ``src/graph/tuning.cc``, ``ncclTopoTuneModel`` and
``ncclTopoGetAlgoTime``, release 2.8: the library of the 2021-22 A100 runs the simulator is held to).
NCCL predicts, for each algorithm (ring; tree for all-reduce) and protocol (LL, LL128, Simple),
``time = latency + bytes / algorithm bandwidth`` and runs the fastest; the simulator does the same.
Every constant is a profile's (``[network.nccl]``, each named there and sourced to that file); this
module holds only the arithmetic. For ``n`` ranks over ``N`` nodes and a group bus bandwidth ``B``
(``plait.plan.network``: NVLink inside a node; across nodes each GPU's share of the node's NICs times
its ranks per node):

* ring: ``nsteps`` = ``2(n-1)`` (all-reduce), ``n-1`` (all-gather, reduce-scatter), ``n`` (broadcast),
  of which ``2(N-1)``, ``N-1``, ``N`` cross nodes; latency ``base + (nsteps - inter) x hop_intra +
  inter x hop_net`` (x ``ring_plateau`` for a large multi-node Simple all-reduce); bandwidth ``B x
  protocol factor x n / nsteps``: the bus-bandwidth factors nccl-tests reports (``2(n-1)/n`` for
  all-reduce, ``(n-1)/n`` for all-gather and reduce-scatter, 1 for broadcast);
* tree (all-reduce only; a chain inside the node, a double binary tree across nodes): latency ``base +
  2 ((n/N - 1) hop_intra + log2(N) hop_net)``; bus bandwidth ``min(tree_factor x B, cap)`` times the
  protocol's factor, moving every byte up and down (``0.5 x`` bus bandwidth), times NCCL's correction
  for medium sizes.

Left out: the per-channel ceilings (``ll128MaxBwPerCh x nChannels``), which need NCCL's channel count;
they bind only LL128 below a few channels' worth of bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

PROTOCOLS = ("LL", "LL128", "Simple")
NCCL_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


@dataclass(frozen=True)
class NcclTuning:
    """The constants of NCCL's tuning model (see the module docstring); triples are per protocol
    (LL, LL128, Simple), latencies in microseconds, bandwidths in bytes/s."""

    version: str
    intra_hardware: str  # nvlink or pci: which row of hop latencies a hop inside a node takes
    base_latency_us: dict[str, tuple[float, float, float]]  # ring, tree
    hop_latency_us: dict[str, tuple[float, float, float]]  # <hardware>_<algorithm>: nvlink_ring, net_tree...
    ring_bandwidth_factor: tuple[float, float, float]
    ring_ll_single_node_factor: float  # the ring's LL inside one node for gathers and scatters
    ring_ll128_one_rank_per_node_factor: float  # LL128 when a node holds one rank (NIC to the same GPU)
    tree_bandwidth_factor: float
    tree_protocol_factor: tuple[float, float, float]  # multi-node
    tree_ll128_single_node_factor: float
    tree_max_bus_bandwidth: tuple[float, float, float]  # more than two nodes
    tree_max_bus_bandwidth_two_nodes: tuple[float, float, float]
    ll_intra_multi_node_factor: float
    ring_plateau: float  # latency factor of a large multi-node Simple ring all-reduce
    ring_plateau_bytes_per_rank: float  # "large": at least n x this many bytes
    tree_correction: tuple[tuple[float, ...], ...]  # per protocol, by log2(bytes / 64), 22 sizes


@dataclass(frozen=True)
class Choice:
    """What NCCL's model picks: ``seconds``, ``algorithm`` (ring, tree) and ``protocol``."""

    seconds: float
    algorithm: str
    protocol: str


def _triple(value: Any, where: str) -> tuple[float, float, float]:
    if not isinstance(value, list) or len(value) != 3:
        raise ValueError(f"{where} must list three numbers (LL, LL128, Simple)")
    return tuple(float(v) for v in value)  # type: ignore[return-value]


def parse_tuning(table: dict[str, Any]) -> NcclTuning:
    """``NcclTuning`` from a profile's ``[network.nccl]`` table; raises ``KeyError`` / ``ValueError``
    naming the key (``plait.plan.hardware`` turns them into a ``ConfigError`` naming the file)."""
    hops = {k: _triple(v, f"hop_latency_us.{k}") for k, v in table["hop_latency_us"].items()}
    intra = str(table["intra_hardware"])
    for need in (f"{intra}_ring", f"{intra}_tree", "net_ring", "net_tree"):
        if need not in hops:
            raise KeyError(f"hop_latency_us.{need}")
    correction = tuple(tuple(float(x) for x in row) for row in table["tree_correction"])
    if len(correction) != 3 or any(len(row) != 22 for row in correction):
        raise ValueError("tree_correction must hold three rows (LL, LL128, Simple) of 22 factors")
    return NcclTuning(
        version=str(table["version"]), intra_hardware=intra,
        base_latency_us={k: _triple(v, f"base_latency_us.{k}") for k, v in table["base_latency_us"].items()},
        hop_latency_us=hops, ring_bandwidth_factor=_triple(table["ring_bandwidth_factor"], "ring_bandwidth_factor"),
        ring_ll_single_node_factor=float(table["ring_ll_single_node_factor"]),
        ring_ll128_one_rank_per_node_factor=float(table["ring_ll128_one_rank_per_node_factor"]),
        tree_bandwidth_factor=float(table["tree_bandwidth_factor"]),
        tree_protocol_factor=_triple(table["tree_protocol_factor"], "tree_protocol_factor"),
        tree_ll128_single_node_factor=float(table["tree_ll128_single_node_factor"]),
        tree_max_bus_bandwidth=_triple(table["tree_max_bus_bandwidth"], "tree_max_bus_bandwidth"),
        tree_max_bus_bandwidth_two_nodes=_triple(table["tree_max_bus_bandwidth_two_nodes"],
                                                 "tree_max_bus_bandwidth_two_nodes"),
        ll_intra_multi_node_factor=float(table["ll_intra_multi_node_factor"]),
        ring_plateau=float(table["ring_plateau"]),
        ring_plateau_bytes_per_rank=float(table["ring_plateau_bytes_per_rank"]), tree_correction=correction)


def _steps(op: str, n: int, nodes: int) -> tuple[int, int]:
    """(steps, steps that cross nodes) of the ring for ``op``."""
    if op == "all_reduce":
        return 2 * (n - 1), 2 * (nodes - 1)
    if op in ("all_gather", "reduce_scatter"):
        return n - 1, nodes - 1
    return n, nodes


def _bandwidth(t: NcclTuning, algo: str, p: int, op: str, n: int, nodes: int, bus: float) -> float:
    """Algorithm bandwidth (bytes/s) of ``algo`` with protocol ``p`` on a group of bus bandwidth ``bus``."""
    if algo == "ring":
        if p == 0:
            bus *= t.ring_bandwidth_factor[0] if nodes > 1 or op == "all_reduce" else t.ring_ll_single_node_factor
        elif p == 1:
            bus *= t.ring_bandwidth_factor[1] if n / nodes >= 2 else t.ring_ll128_one_rank_per_node_factor
        else:
            bus *= t.ring_bandwidth_factor[2]
        return bus * n / _steps(op, n, nodes)[0]
    cap = (t.tree_max_bus_bandwidth if nodes > 2 else t.tree_max_bus_bandwidth_two_nodes)[p]
    bus = min(bus * t.tree_bandwidth_factor, cap)
    bus *= t.tree_ll128_single_node_factor if p == 1 and nodes == 1 else t.tree_protocol_factor[p]
    return 0.5 * bus  # every byte goes up the tree and down again


def _latency_us(t: NcclTuning, algo: str, p: int, op: str, n: int, nodes: int) -> float:
    intra = t.hop_latency_us[f"{t.intra_hardware}_{algo}"][p]
    inter = t.hop_latency_us[f"net_{algo}"][p]
    if nodes > 1 and p == 0:
        intra *= t.ll_intra_multi_node_factor
    lat = t.base_latency_us[algo][p]
    if algo == "tree":
        return lat + 2 * ((n // nodes - 1) * intra + int(math.log2(nodes)) * inter)
    steps, cross = _steps(op, n, nodes)
    if op == "broadcast":  # a pipelined chain: NCCL charges each of its steps one hop of the outer level
        hop = t.hop_latency_us[f"{'net' if nodes > 1 else t.intra_hardware}_{'tree' if p == 2 else 'ring'}"][p]
        return lat + steps * hop
    return lat + (steps - cross) * intra + cross * inter


def predict(t: NcclTuning, algo: str, protocol: str, op: str, nbytes: float, n: int, nodes: int, bus: float) -> float:
    """Seconds NCCL's model predicts for ``op`` on ``nbytes`` with ``algo`` (ring, tree) and ``protocol``."""
    p = PROTOCOLS.index(protocol)
    bw = _bandwidth(t, algo, p, op, n, nodes, bus)
    log_size = int(math.log2(max(nbytes, 64.0) / 64))
    if algo == "tree" and log_size < 22:
        bw *= t.tree_correction[p][log_size]
    lat = _latency_us(t, algo, p, op, n, nodes)
    if algo == "ring" and p == 2 and nodes > 1 and op == "all_reduce" and nbytes >= n * t.ring_plateau_bytes_per_rank:
        lat *= t.ring_plateau
    return lat * 1e-6 + nbytes / bw


def choose(t: NcclTuning, op: str, nbytes: float, n: int, nodes: int, bus: float) -> Choice:
    """The algorithm and protocol NCCL's model picks for ``op`` on ``nbytes`` over ``n`` ranks on ``nodes``
    nodes of bus bandwidth ``bus`` (bytes/s): the fastest ``predict``. Raises ``ValueError`` for an operation
    NCCL's model does not cover (``NCCL_OPS``)."""
    if op not in NCCL_OPS:
        raise ValueError(f"NCCL's tuning model covers {NCCL_OPS}; not {op!r}")
    best = Choice(math.inf, "", "")
    for algo in ("ring", "tree") if op == "all_reduce" else ("ring",):
        for proto in PROTOCOLS:
            seconds = predict(t, algo, proto, op, nbytes, n, nodes, bus)
            if seconds < best.seconds:
                best = Choice(seconds, algo, proto)
    return best
