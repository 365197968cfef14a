"""Float8 Linears in the operator lists (``train.precision = "fp8"``): torchao's ``Float8Linear`` as plait converts
the model (``plait.parallel.float8``), priced on a profile's fp8 peak (``[device.peak_flops] fp8``).

fp8 is bf16 mixed precision in which some Linears multiply in float8. Which: a block's projections (q, k, v, the
attention output, the MLP's, a MoE block's shared experts) whose two dimensions divide by 16 (``float8_linears``,
``is_float8_weight``); never the head, the embedding, the router (its logits are computed from its weight in
float32) or a MoE block's routed experts (batched weights, not Linears): those stay as bf16 prices them.

Per float8 Linear ``(M, K) x (K, N)`` under torchao's default recipe (dynamic tensorwise scales, eager kernels: an
amax reduction and a cast per operand, each reading it; under ``torch.compile`` they fuse with their neighbours and
cost less, which is not modelled, so small matmuls can come out slower in fp8 than in bf16):

* forward: the bf16 input's amax and cast (reads ``2 MK`` bytes twice, writes ``MK``: ``5 MK``); the fp32 weight's
  (``9 NK``), unless FSDP2 gathered it in float8 already (ZeRO-3: torchao's float8 all-gather casts the shard before
  the gather, one byte per element on the wire: ``plait.plan.rank_memory.gathered_bytes``); the matmul at the fp8
  peak, reading one-byte operands and writing bf16 (``MK + KN + 2 MN`` bytes).
* backward: the output gradient cast twice, once for each gradient matmul (``2 x 5 MN``), the weight again for the
  input gradient (``9 NK``, not under ZeRO-3), the saved input again for the weight gradient (``5 MK``); both gradient
  matmuls in float8.
* saved for backward: the bf16 input (the copy autocast keeps for a bf16 Linear) and the weight as the parameter
  itself, so autocast's half-precision weight copy (``w.*``) of these Linears is not kept.

The matmuls run at ``peak(fp8) x matmul_efficiency``: the profile's one efficiency for its tensor cores (no public
sustained-float8 figure is used in its place). Tensor-parallel collectives keep their bf16 bytes (plait's float8
conversion runs before tensor parallelism and casts inside each Linear).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from plait.plan.opcore import Op, mem

FLOAT8_ALIGN = 16  # torch._scaled_mm needs both dimensions of a float8 operand divisible by 16


def _eligible(n_in: int, n_out: int) -> bool:
    return n_in % FLOAT8_ALIGN == 0 and n_out % FLOAT8_ALIGN == 0


def float8_linears(block: Any) -> dict[str, float]:
    """The float8 Linears of ``block`` (a ``plait.plan.ops.BlockOps``) by their op names, with the weight elements
    each holds on this rank (module docstring)."""
    s, C = block.s, block.C
    dims = {"attn.q": (C, s.d_model, C * block.Cq), "attn.k": (C, s.kv_dim, C * block.Ckv),
            "attn.v": (C, s.kv_dim, C * block.Ckv), "attn.proj": (s.d_model, C, block.Cq * C)}
    if block.moe:
        h = s.expert_hidden
        for j in range(s.shared_experts):
            dims[f"moe.shared.{j}.fc"] = (C, h, C * h)
            dims[f"moe.shared.{j}.proj"] = (h, C, h * C)
    else:
        for name in ("mlp.gate", "mlp.up") if s.gated_mlp else ("mlp.fc",):
            dims[name] = (C, s.d_ff, C * block.F)
        dims["mlp.proj"] = (s.d_ff, C, block.F * C)
    return {name: float(local) for name, (n_in, n_out, local) in dims.items() if _eligible(n_in, n_out)}


def is_float8_weight(param: Any, n_layer: int) -> bool:
    """Whether ``param`` (a ``plait.plan.params.Param``) is the weight of a float8 Linear (module docstring)."""
    return (0 <= param.layer < n_layer and len(param.shape) == 2 and not param.expert
            and "router" not in param.name and _eligible(param.shape[1], param.shape[0]))


def to_float8(ops: list[Op], linears: dict[str, float], weight_cast: bool) -> list[Op]:
    """``ops`` with the matmuls of the float8 ``linears`` run in float8 and their casts before them (module
    docstring); ``weight_cast``: the weights are cast here (False: FSDP2 gathered them in float8)."""
    out = []
    for op in ops:
        base = op.name.rsplit(".", 1)[0] if op.name.endswith((".dX", ".dW")) else op.name
        if op.kind != "matmul" or base not in linears:
            out.append(op)
            continue
        m, n, k, b = op.m, op.n, op.k, op.batch
        if not op.backward:  # (M, K) x (K, N): the input and the weight
            cast = 5 * m * k + (9 * n * k if weight_cast else 0)
        elif op.name.endswith(".dX"):  # (M, N) x (N, K): the output gradient and the weight
            cast = 5 * m * k + (9 * k * n if weight_cast else 0)
        else:  # (K, M) x (M, N): the saved input and the output gradient
            cast = 5 * k * m + 5 * k * n
        out.append(mem(f"{op.name}.float8_cast", "copy", b * cast, backward=op.backward))
        out.append(replace(op, dtype="fp8", bytes=float(b * (m * k + k * n + 2 * m * n))))
    return out
