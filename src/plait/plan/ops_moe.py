"""The mixture-of-experts feed-forward of one block on one rank (``BlockOps(..., moe=True)``).

plait's ``plait.nn.MoE`` under ``plait.parallel.expert.dispatch``: an fp32 router and its softmax and top-k, the
``A = k M`` assignments gathered, each rank's ``E / ep`` experts run as one grouped matmul pair on the rows they
receive, the outputs weighted and summed back; with ``ep > 1`` the dispatcher's all-to-alls in the compute
stream: forward the per-expert counts (``E`` int64), the tokens and the results; backward the two token-sized
ones again.

Imbalance (``expert_rows``). The rows an ep rank's experts compute are the balanced share ``A`` times the
imbalance ``f`` (``moe.imbalance``: the busiest rank's rows over the balanced share, measured from a run's
logged loads by ``rank_imbalance``), at most what the capacity allows. What its buffers hold depends on the
dispatcher: the static all-to-all (``moe.dispatcher=alltoall``) sizes every buffer at its bound whatever the
routing, ``ep x min(A, E/ep x per-expert limit)`` rows (``min(ep, E/k)`` times ``A`` dropless, about
``capacity_factor`` times it with a capacity), so imbalance never grows its memory; variable splits
(``alltoall_split``, ``allgather``) hold the busiest rank's ``f A`` rows, which is where imbalance runs a rank
out of memory.
"""

from __future__ import annotations

import math
from typing import Any

from plait.plan.opcore import Op, comm, matmul, matmul_backward, mem

BlockOps = Any  # plait.plan.ops.BlockOps, whose methods these are (it imports this module)


def moe_shape(self: BlockOps) -> tuple[int, int, int, int, int]:
    """(assignments A, local experts, rows per expert, experts' hidden H, ep)."""
    s, ep = self.s, self.u.ep
    A = self.M * s.top_k
    local = s.num_experts // ep
    return A, local, -(-A // s.num_experts), s.expert_hidden, ep

def expert_rows(shape: Any, tokens: int, ep: int) -> tuple[int, int]:
    """``(held, computed)``: the rows the busiest ep rank's expert buffers hold and the rows its experts compute,
    for ``tokens`` tokens per rank and micro-batch (see the module docstring)."""
    s = shape
    a = tokens * s.top_k
    per_expert = tokens if not s.capacity_factor else min(tokens, math.ceil(s.capacity_factor * a / s.num_experts))
    bound = ep * min(a, s.num_experts // ep * per_expert)  # the most one rank can receive
    computed = min(bound, math.ceil(s.moe_imbalance * min(a, s.num_experts * per_expert)))
    if ep == 1:
        return a, min(a, s.num_experts * per_expert)
    return (bound if s.moe_dispatch == "alltoall" else computed), computed


def rank_imbalance(tokens_per_expert: list[int], ep: int) -> float:
    """The busiest rank's assignments over the mean rank's, experts ``[i E/ep, (i+1) E/ep)`` on rank ``i``."""
    n = len(tokens_per_expert) // ep
    per_rank = [sum(tokens_per_expert[i * n:(i + 1) * n]) for i in range(ep)]
    mean = sum(per_rank) / ep
    return max(per_rank) / mean if mean else 1.0


def moe_forward(self: BlockOps) -> list[Op]:
    """The MoE feed-forward (see the module docstring)."""
    s, a, M, C = self.s, self.a, self.M, self.C
    A, local, _, H, ep = moe_shape(self)
    R, busy = expert_rows(s, M, ep)  # rows held, rows computed
    rows = -(-busy // local)
    E = s.num_experts
    ops = [mem("moe.router_in_float", "copy", M * C * (a + 4), saves=(("moe.router_in", M * C * 4),)),
           matmul("moe.router", M, E, C, 4),
           mem("moe.softmax", "softmax", 2 * M * E * 4, saves=(("moe.probs", M * E * 4),)),
           mem("moe.topk", "reduce", M * E * 4 + A * 16, saves=(("moe.routing", A * 16),)),
           mem("moe.gather", "copy", 2 * A * C * a)]
    wire = R if s.moe_dispatch == "alltoall" else A  # the static buffer goes whole; variable splits what is routed
    if ep > 1:
        ops += [comm("moe.counts.alltoall", "all_to_all", E * 8),
                comm("moe.dispatch.alltoall", "all_to_all", wire * C * a)]
    ops += [matmul("moe.experts.fc", rows, H, C, a, batch=local, saves=(("moe.x_recv", R * C * a),)),
            mem("moe.experts.gelu", "act", 2 * R * H * a, saves=(("moe.fc", R * H * a), ("moe.hidden", R * H * a))),
            matmul("moe.experts.proj", rows, C, H, a, batch=local),
            mem("moe.experts.scatter", "copy", 3 * R * C * a)]
    if ep > 1:
        ops.append(comm("moe.combine.alltoall", "all_to_all", wire * C * a))
    ops.append(mem("moe.combine", "copy", 3 * A * C * a + M * C * a, saves=(("moe.y", A * C * a),)))
    for j in range(s.shared_experts):
        ops += [matmul(f"moe.shared.{j}.fc", M, H, C, a),
                mem(f"moe.shared.{j}.gelu", "act", 2 * M * H * a,
                    saves=((f"moe.shared.{j}.fc", M * H * a), (f"moe.shared.{j}.hidden", M * H * a))),
                matmul(f"moe.shared.{j}.proj", M, C, H, a), mem(f"moe.shared.{j}.add", "copy", 3 * M * C * a)]
    return ops

def moe_backward(self: BlockOps) -> list[Op]:
    s, a, M, C = self.s, self.a, self.M, self.C
    A, local, _, H, ep = moe_shape(self)
    R, busy = expert_rows(s, M, ep)
    rows = -(-busy // local)
    wire = R if s.moe_dispatch == "alltoall" else A
    E = s.num_experts
    ops: list[Op] = []
    for j in reversed(range(s.shared_experts)):
        ops += matmul_backward(f"moe.shared.{j}.proj", M, C, H, a, True)
        ops.append(mem(f"moe.shared.{j}.gelu.bwd", "act_bwd", 3 * M * H * a, backward=True))
        ops += matmul_backward(f"moe.shared.{j}.fc", M, H, C, a, True)
    ops.append(mem("moe.combine.bwd", "copy", 3 * A * C * a + A * 4, backward=True))
    if ep > 1:
        ops.append(comm("moe.combine.alltoall.bwd", "all_to_all", wire * C * a, backward=True))
    ops.append(mem("moe.experts.scatter.bwd", "copy", 2 * R * C * a, backward=True))
    ops += matmul_backward("moe.experts.proj", rows, C, H, a, False, batch=local)
    ops.append(mem("moe.experts.gelu.bwd", "act_bwd", 3 * R * H * a, backward=True))
    ops += matmul_backward("moe.experts.fc", rows, H, C, a, False, batch=local)
    if ep > 1:
        ops.append(comm("moe.dispatch.alltoall.bwd", "all_to_all", wire * C * a, backward=True))
    ops += [mem("moe.gather.bwd", "copy", 3 * A * C * a, backward=True),
            mem("moe.softmax.bwd", "softmax_bwd", 3 * M * E * 4, backward=True)]
    ops += matmul_backward("moe.router", M, E, C, 4, False)
    ops.append(mem("moe.router_in_float.bwd", "copy", M * C * (a + 4), backward=True))
    return ops
