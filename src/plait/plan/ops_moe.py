"""The mixture-of-experts feed-forward of one block on one rank (``BlockOps(..., moe=True)``).

plait's ``plait.nn.MoE`` under ``plait.parallel.expert.dispatch``: an fp32 router and its softmax and top-k, the
``A = k M`` assignments gathered, each rank's ``E / ep`` experts run as one matmul pair per expert on
``A / E`` rows each (a balanced router), the outputs weighted and summed back; with ``ep > 1`` the
dispatcher's all-to-alls in the compute stream: forward the per-expert counts (``E`` int64), the tokens
(``A C`` activations) and the results (``A C``); backward the two token-sized ones again.
"""

from __future__ import annotations

from typing import Any

from plait.plan.opcore import Op, comm, matmul, matmul_backward, mem

BlockOps = Any  # plait.plan.ops.BlockOps, whose methods these are (it imports this module)


def moe_shape(self: BlockOps) -> tuple[int, int, int, int, int]:
    """(assignments A, local experts, rows per expert, experts' hidden H, ep)."""
    s, ep = self.s, self.u.ep
    A = self.M * s.top_k
    local = s.num_experts // ep
    return A, local, -(-A // s.num_experts), s.expert_hidden, ep

def moe_forward(self: BlockOps) -> list[Op]:
    """The MoE feed-forward (see the module docstring)."""
    s, a, M, C = self.s, self.a, self.M, self.C
    A, local, rows, H, ep = moe_shape(self)
    E = s.num_experts
    ops = [mem("moe.router_in_float", "copy", M * C * (a + 4), saves=(("moe.router_in", M * C * 4),)),
           matmul("moe.router", M, E, C, 4),
           mem("moe.softmax", "softmax", 2 * M * E * 4, saves=(("moe.probs", M * E * 4),)),
           mem("moe.topk", "reduce", M * E * 4 + A * 16, saves=(("moe.routing", A * 16),)),
           mem("moe.gather", "copy", 2 * A * C * a)]
    if ep > 1:
        ops += [comm("moe.counts.alltoall", "all_to_all", E * 8),
                comm("moe.dispatch.alltoall", "all_to_all", A * C * a)]
    ops += [matmul("moe.experts.fc", rows, H, C, a, batch=local, saves=(("moe.x_recv", A * C * a),)),
            mem("moe.experts.gelu", "act", 2 * A * H * a, saves=(("moe.fc", A * H * a), ("moe.hidden", A * H * a))),
            matmul("moe.experts.proj", rows, C, H, a, batch=local),
            mem("moe.experts.scatter", "copy", 3 * A * C * a)]
    if ep > 1:
        ops.append(comm("moe.combine.alltoall", "all_to_all", A * C * a))
    ops.append(mem("moe.combine", "copy", 3 * A * C * a + M * C * a, saves=(("moe.y", A * C * a),)))
    for j in range(s.shared_experts):
        ops += [matmul(f"moe.shared.{j}.fc", M, H, C, a),
                mem(f"moe.shared.{j}.gelu", "act", 2 * M * H * a,
                    saves=((f"moe.shared.{j}.fc", M * H * a), (f"moe.shared.{j}.hidden", M * H * a))),
                matmul(f"moe.shared.{j}.proj", M, C, H, a), mem(f"moe.shared.{j}.add", "copy", 3 * M * C * a)]
    return ops

def moe_backward(self: BlockOps) -> list[Op]:
    s, a, M, C = self.s, self.a, self.M, self.C
    A, local, rows, H, ep = moe_shape(self)
    E = s.num_experts
    ops: list[Op] = []
    for j in reversed(range(s.shared_experts)):
        ops += matmul_backward(f"moe.shared.{j}.proj", M, C, H, a, True)
        ops.append(mem(f"moe.shared.{j}.gelu.bwd", "act_bwd", 3 * M * H * a, backward=True))
        ops += matmul_backward(f"moe.shared.{j}.fc", M, H, C, a, True)
    ops.append(mem("moe.combine.bwd", "copy", 3 * A * C * a + A * 4, backward=True))
    if ep > 1:
        ops.append(comm("moe.combine.alltoall.bwd", "all_to_all", A * C * a, backward=True))
    ops.append(mem("moe.experts.scatter.bwd", "copy", 2 * A * C * a, backward=True))
    ops += matmul_backward("moe.experts.proj", rows, C, H, a, False, batch=local)
    ops.append(mem("moe.experts.gelu.bwd", "act_bwd", 3 * A * H * a, backward=True))
    ops += matmul_backward("moe.experts.fc", rows, H, C, a, False, batch=local)
    if ep > 1:
        ops.append(comm("moe.dispatch.alltoall.bwd", "all_to_all", A * C * a, backward=True))
    ops += [mem("moe.gather.bwd", "copy", 3 * A * C * a, backward=True),
            mem("moe.softmax.bwd", "softmax_bwd", 3 * M * E * 4, backward=True)]
    ops += matmul_backward("moe.router", M, E, C, 4, False)
    ops.append(mem("moe.router_in_float.bwd", "copy", M * C * (a + 4), backward=True))
    return ops
