"""The operators one transformer block, the embedding and the head run, forward and backward.

This is the analytic twin of what plait's GPT (``plait.models.gpt``) and a Llama-style Hugging Face
decoder execute on one rank: every matmul with its ``(m, n, k)``, every memory-bound kernel with the
bytes it reads and writes, the tensor-parallel collectives in the compute stream, and the tensors each
forward operator saves for backward. The cost model (``plait.plan.kernels``) prices each ``Op`` on a
hardware profile; the memory model sums the saved tensors (each distinct tensor once).

Layout effects: tensor parallelism (degree ``t``, Megatron layout) shards heads, the MLP width and the
vocabulary; row-parallel outputs are all-reduced (sequence parallel: reduce-scattered) and the inputs
of column-parallel layers get an all-reduce of their gradient (sequence parallel: an all-gather before
them in forward, a reduce-scatter in backward). With sequence parallelism plait (DTensor) keeps the
all-gathered input of each column-parallel layer for backward; ``stack="megatron"`` models Megatron-LM,
which keeps the shard and gathers again in backward (overlapped, Korthikanti et al. 2022, section 4.2.2),
and also its fused kernels: one QKV projection, bias-dropout-add in one pass.

Mixture of experts (``BlockOps(..., moe=True)``, plait's ``plait.nn.MoE`` under
``plait.parallel.expert``): an fp32 router and its softmax and top-k, the ``A = k M`` assignments
gathered, each rank's ``E / ep`` experts run as one matmul pair per expert on ``A / E`` rows each (a
balanced router), the outputs weighted and summed back; with ``ep > 1`` the dispatcher's all-to-alls in
the compute stream: forward the per-expert counts (``E`` int64), the tokens (``A C`` activations) and
the results (``A C``); backward the two token-sized ones again.

Attention: ``flash`` is scaled_dot_product_attention's fused kernel (saves q, k, v, the output and the
row log-sum-exp; executes half the ``T x T`` square when causal; backward re-forms the probabilities:
2.5x the forward's work); ``unfused`` materialises the ``T x T`` scores, softmax and dropout
(Megatron-LM 2021-22, and SDPA's math backend).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from plait.plan.shapes import ModelShape

MEMORY_KINDS = ("copy", "norm", "norm_bwd", "act", "act_bwd", "softmax", "softmax_bwd", "reduce", "embed_bwd",
                "optimizer")


@dataclass(frozen=True)
class Op:
    """One operator: a matmul (``m, n, k``, ``batch`` for a batched one), an attention kernel, a
    memory-bound kernel (``kind`` in ``MEMORY_KINDS``) or a collective (``kind="comm"``) in the compute
    stream. ``bytes`` is what it reads plus writes (a collective: its buffer); ``saves`` names the tensors
    it keeps for backward with their bytes."""

    name: str
    kind: str
    flops: float = 0.0
    bytes: float = 0.0
    m: int = 0
    n: int = 0
    k: int = 0
    batch: int = 1
    attn: tuple[int, int, int] = (0, 0, 0)  # (batch x heads, sequence, head dim)
    backward: bool = False
    comm: str = ""
    saves: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Setup:
    """How one block runs on one rank: sequences per forward, tensor-parallel degree, sequence
    parallelism, activation bytes (4 fp32, 2 bf16/fp16), attention kernel and software stack."""

    micro_batch: int
    tp: int = 1
    sp: bool = False
    act_bytes: int = 4
    attention: str = "flash"
    stack: str = "plait"
    causal: bool = True
    ep: int = 1


@dataclass
class Pass:
    """A list of operators and the tensors they save (name -> bytes, each distinct tensor once)."""

    ops: list[Op] = field(default_factory=list)

    def saved(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for op in self.ops:
            for name, nbytes in op.saves:
                out.setdefault(name, nbytes)
        return out

    def saved_bytes(self) -> float:
        return sum(self.saved().values())


def matmul(name: str, m: int, n: int, k: int, a: int, saves: tuple = (), batch: int = 1) -> Op:
    """``(m, k) x (k, n)`` (``batch`` times): ``2 m n k`` FLOPs; reads both operands, writes the output."""
    return Op(name, "matmul", flops=2.0 * m * n * k * batch, bytes=float(batch * (m * k + k * n + m * n) * a),
              m=m, n=n, k=k, batch=batch, saves=saves)


def matmul_backward(name: str, m: int, n: int, k: int, a: int, bias: bool, batch: int = 1,
                    input_grad: bool = True) -> list[Op]:
    """Gradient of ``(m, k) x (k, n)``: ``dX = dY W^T`` (m, k, n), ``dW = X^T dY`` (k, n, m), bias: a sum of dY."""
    ops = []
    if input_grad:
        ops.append(Op(f"{name}.dX", "matmul", flops=2.0 * m * n * k * batch,
                      bytes=float(batch * (m * n + n * k + m * k) * a), m=m, n=k, k=n, batch=batch, backward=True))
    ops.append(Op(f"{name}.dW", "matmul", flops=2.0 * m * n * k * batch,
                  bytes=float(batch * (k * m + m * n + k * n) * a), m=k, n=n, k=m, batch=batch, backward=True))
    if bias:
        ops.append(Op(f"{name}.db", "reduce", bytes=float(m * n * a), backward=True))
    return ops


def mem(name: str, kind: str, nbytes: float, saves: tuple = (), backward: bool = False) -> Op:
    return Op(name, kind, bytes=float(nbytes), saves=saves, backward=backward)


def comm(name: str, collective: str, nbytes: float, backward: bool = False) -> Op:
    return Op(name, "comm", bytes=float(nbytes), comm=collective, backward=backward)


class BlockOps:
    """Operators of one transformer block on one rank (see the module docstring)."""

    def __init__(self, shape: ModelShape, setup: Setup, moe: bool = False) -> None:
        self.s, self.u, self.moe = shape, setup, moe
        t = setup.tp
        self.M = setup.micro_batch * shape.seq_len  # tokens through the matmuls
        self.Mn = self.M // t if setup.sp else self.M  # tokens through norms and the residual stream
        self.C, self.a = shape.d_model, setup.act_bytes
        self.Cq, self.Ckv, self.F = shape.d_model // t, shape.kv_dim // t, shape.d_ff // t
        self.H = shape.n_head // t
        self.BH = setup.micro_batch * self.H

    # -- pieces -------------------------------------------------------------------------------------
    def _norm(self, tag: str) -> list[Op]:
        M, C, a = self.Mn, self.C, self.a
        stats = (2 if self.s.norm == "layernorm" else 1) * M * 4
        ops = [mem(f"{tag}", "norm", 2 * M * C * a, saves=((f"{tag}.in", M * C * a), (f"{tag}.stats", stats)))]
        if self.u.sp:
            full = self.M * C * a
            keep = (f"{tag}.out", M * C * a) if self.u.stack == "megatron" else (f"{tag}.gathered", full)
            ops.append(Op(f"{tag}.allgather", "comm", bytes=full, comm="all_gather", saves=(keep,)))
        else:
            ops[0] = replace(ops[0], saves=ops[0].saves + ((f"{tag}.out", M * C * a),))
        return ops

    def _residual(self, tag: str) -> list[Op]:
        M, C, a = self.Mn, self.C, self.a
        if self.u.stack == "megatron":  # fused bias-dropout-add: read the branch and the residual, write once
            mask = M * C if self.s.dropout > 0 else 0
            return [mem(f"{tag}.bias_dropout_add", "copy", 3 * M * C * a + mask,
                        saves=((f"{tag}.mask", mask),) if mask else ())]
        ops = []
        if self.s.dropout > 0:
            ops.append(mem(f"{tag}.dropout", "copy", 2 * M * C * a + M * C, saves=((f"{tag}.mask", M * C),)))
        ops.append(mem(f"{tag}.add", "copy", 3 * M * C * a))
        return ops

    def _row_output(self, tag: str) -> Op:
        return comm(f"{tag}.{'reducescatter' if self.u.sp else 'allreduce'}",
                    "reduce_scatter" if self.u.sp else "all_reduce", self.M * self.C * self.a)

    def attention_core(self) -> list[Op]:
        """``softmax(Q K^T) V`` on this rank's heads: the flash kernel, or the unfused products."""
        s, u, a, BH = self.s, self.u, self.a, self.BH
        T, D = s.seq_len, s.head_dim
        ctx = ("attn.ctx", self.M * self.Cq * a)
        if u.attention == "flash":
            flops = 4.0 * BH * T * T * D * (0.5 if u.causal else 1.0)
            return [Op("attn.sdpa", "attention", flops=flops, attn=(BH, T, D),
                       saves=(ctx, ("attn.lse", BH * T * 4)))]
        sq = BH * T * T
        ops = [matmul("attn.scores", T, T, D, a, batch=BH),
               mem("attn.softmax", "softmax", 2 * sq * a, saves=(("attn.probs", sq * a),))]
        if s.dropout > 0:
            ops.append(mem("attn.dropout", "copy", 2 * sq * a + sq, saves=(("attn.pmask", sq), ("attn.pdrop", sq * a))))
        ops += [matmul("attn.context", T, D, T, a, batch=BH),
                mem("attn.merge_heads", "copy", 2 * self.M * self.Cq * a, saves=(ctx,))]
        return ops

    def attention_core_backward(self) -> list[Op]:
        s, u, a, BH = self.s, self.u, self.a, self.BH
        T, D = s.seq_len, s.head_dim
        if u.attention == "flash":
            flops = 2.5 * 4.0 * BH * T * T * D * (0.5 if u.causal else 1.0)
            return [Op("attn.sdpa.bwd", "attention", flops=flops, attn=(BH, T, D), backward=True)]
        sq = BH * T * T
        ops = [mem("attn.merge_heads.bwd", "copy", 2 * self.M * self.Cq * a, backward=True)]
        ops += matmul_backward("attn.context", T, D, T, a, bias=False, batch=BH)
        if s.dropout > 0:
            ops.append(mem("attn.dropout.bwd", "copy", 2 * sq * a + sq, backward=True))
        ops.append(mem("attn.softmax.bwd", "softmax_bwd", 3 * sq * a, backward=True))
        ops += matmul_backward("attn.scores", T, T, D, a, bias=False, batch=BH)
        return ops

    def _qkv_saves(self) -> tuple:
        a, M = self.a, self.M
        return (("attn.q", M * self.Cq * a), ("attn.k", M * self.Ckv * a), ("attn.v", M * self.Ckv * a))

    # -- the block ----------------------------------------------------------------------------------
    def forward(self) -> Pass:
        s, a, M, C, F = self.s, self.a, self.M, self.C, self.F
        ops = self._norm("ln1")
        if self.u.stack == "megatron":
            ops.append(matmul("attn.qkv", M, self.Cq + 2 * self.Ckv, C, a, saves=self._qkv_saves()))
        else:
            ops += [matmul("attn.q", M, self.Cq, C, a), matmul("attn.k", M, self.Ckv, C, a),
                    matmul("attn.v", M, self.Ckv, C, a, saves=self._qkv_saves())]
        if s.norm == "rmsnorm":  # rotary positions on q and k
            ops.append(mem("attn.rotary", "copy", 2 * M * (self.Cq + self.Ckv) * a))
        ops += self.attention_core()
        ops.append(matmul("attn.proj", M, C, self.Cq, a))
        if self.u.tp > 1:
            ops.append(self._row_output("attn"))
        ops += self._residual("res1") + self._norm("ln2")
        if self.moe:
            return Pass(ops + self.moe_forward() + self._residual("res2"))
        hidden = ("mlp.hidden", M * F * a)
        if s.gated_mlp:
            ops += [matmul("mlp.gate", M, F, C, a, saves=(("mlp.gate", M * F * a),)),
                    matmul("mlp.up", M, F, C, a, saves=(("mlp.up", M * F * a),)),
                    mem("mlp.silu_mul", "act", 4 * M * F * a, saves=(("mlp.silu", M * F * a), hidden))]
        else:
            ops += [matmul("mlp.fc", M, F, C, a, saves=(("mlp.fc", M * F * a),)),
                    mem("mlp.gelu", "act", 2 * M * F * a, saves=(hidden,))]
        ops.append(matmul("mlp.proj", M, C, F, a))
        if self.u.tp > 1:
            ops.append(self._row_output("mlp"))
        ops += self._residual("res2")
        return Pass(ops)

    def _norm_backward(self, tag: str) -> list[Op]:
        M, C, a = self.Mn, self.C, self.a
        ops = []
        if self.u.sp:  # (Megatron's second all-gather of the kept shard overlaps compute: not in this stream)
            ops.append(comm(f"{tag}.reducescatter.bwd", "reduce_scatter", self.M * C * a, backward=True))
        ops.append(mem(f"{tag}.bwd", "norm_bwd", 3 * M * C * a, backward=True))
        ops.append(mem(f"{tag}.residual_grad", "copy", 3 * M * C * a, backward=True))
        return ops

    def backward(self) -> Pass:
        s, a, M, C = self.s, self.a, self.M, self.C
        t = self.u.tp
        ops: list[Op] = []
        if s.dropout > 0:
            ops.append(mem("res2.dropout.bwd", "copy", 2 * self.Mn * C * a + self.Mn * C, backward=True))
        if t > 1 and self.u.sp:
            ops.append(comm("mlp.allgather.bwd", "all_gather", M * C * a, backward=True))
        if self.moe:
            ops += self.moe_backward()
        else:
            ops += self._mlp_backward()
        if t > 1 and not self.u.sp:
            ops.append(comm("mlp.input_grad.allreduce", "all_reduce", M * C * a, backward=True))
        ops += self._norm_backward("ln2")
        if s.dropout > 0:
            ops.append(mem("res1.dropout.bwd", "copy", 2 * self.Mn * C * a + self.Mn * C, backward=True))
        ops += self._attention_backward()
        return Pass(ops)

    def _mlp_backward(self) -> list[Op]:
        s, a, M, C, F, b = self.s, self.a, self.M, self.C, self.F, self.s.bias
        ops = matmul_backward("mlp.proj", M, C, F, a, b)
        if s.gated_mlp:
            ops.append(mem("mlp.silu_mul.bwd", "act_bwd", 5 * M * F * a, backward=True))
            ops += matmul_backward("mlp.gate", M, F, C, a, b) + matmul_backward("mlp.up", M, F, C, a, b)
            ops.append(mem("mlp.input_grad_sum", "copy", 3 * M * C * a, backward=True))
        else:
            ops.append(mem("mlp.gelu.bwd", "act_bwd", 3 * M * F * a, backward=True))
            ops += matmul_backward("mlp.fc", M, F, C, a, b)
        return ops

    def _moe_shape(self) -> tuple[int, int, int, int, int]:
        """(assignments A, local experts, rows per expert, experts' hidden H, ep)."""
        s, ep = self.s, self.u.ep
        A = self.M * s.top_k
        local = s.num_experts // ep
        return A, local, -(-A // s.num_experts), s.expert_hidden, ep

    def moe_forward(self) -> list[Op]:
        """The MoE feed-forward (see the module docstring)."""
        s, a, M, C = self.s, self.a, self.M, self.C
        A, local, rows, H, ep = self._moe_shape()
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

    def moe_backward(self) -> list[Op]:
        s, a, M, C = self.s, self.a, self.M, self.C
        A, local, rows, H, ep = self._moe_shape()
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

    def _attention_backward(self) -> list[Op]:
        s, a, M, C, b = self.s, self.a, self.M, self.C, self.s.bias
        t = self.u.tp
        ops: list[Op] = []
        if t > 1 and self.u.sp:
            ops.append(comm("attn.allgather.bwd", "all_gather", M * C * a, backward=True))
        ops += matmul_backward("attn.proj", M, C, self.Cq, a, b)
        ops += self.attention_core_backward()
        if s.norm == "rmsnorm":
            ops.append(mem("attn.rotary.bwd", "copy", 2 * M * (self.Cq + self.Ckv) * a, backward=True))
        if self.u.stack == "megatron":
            ops += matmul_backward("attn.qkv", M, self.Cq + 2 * self.Ckv, C, a, b)
        else:
            ops += (matmul_backward("attn.v", M, self.Ckv, C, a, b) + matmul_backward("attn.k", M, self.Ckv, C, a, b)
                    + matmul_backward("attn.q", M, self.Cq, C, a, b))
            ops.append(mem("attn.input_grad_sum", "copy", 6 * M * C * a, backward=True))
        if t > 1 and not self.u.sp:
            ops.append(comm("attn.input_grad.allreduce", "all_reduce", M * C * a, backward=True))
        return ops + self._norm_backward("ln1")


def embedding_ops(shape: ModelShape, setup: Setup) -> tuple[Pass, Pass]:
    """Forward and backward of the token (and learned position) embedding on the first stage."""
    M, C, a, t = setup.micro_batch * shape.seq_len, shape.d_model, setup.act_bytes, setup.tp
    Mn = M // t if setup.sp else M
    fwd = [mem("embed.lookup", "copy", 2 * M * C * a, saves=(("embed.ids", M * 8),))]
    if t > 1:
        fwd.append(comm("embed.reduce", "reduce_scatter" if setup.sp else "all_reduce", M * C * a))
    if shape.learned_positions:
        fwd.append(mem("embed.add_positions", "copy", 3 * Mn * C * a))
    bwd = [mem("embed.table_grad", "embed_bwd", shape.vocab_size // t * C * 4 + 2 * M * C * a, backward=True)]
    if shape.learned_positions:
        bwd.append(mem("embed.position_grad", "reduce", Mn * C * a, backward=True))
    return Pass(fwd), Pass(bwd)


def head_ops(shape: ModelShape, setup: Setup, loss_parallel: bool = True) -> tuple[Pass, Pass]:
    """Forward and backward of the final norm, the vocabulary projection and the cross-entropy (fp32
    log-softmax) on the last stage. Under tp the projection is vocabulary-parallel: with
    ``loss_parallel`` (plait's GPT) the loss runs on the shards (three small all-reduces of per-token
    values); without it (a Hugging Face ``colwise_gather_output`` head) the logits are all-gathered."""
    M, C, a, t = setup.micro_batch * shape.seq_len, shape.d_model, setup.act_bytes, setup.tp
    Mn = M // t if setup.sp else M
    V = shape.vocab_size // t
    Vl = V if t == 1 or loss_parallel else shape.vocab_size  # vocabulary the loss sees on this rank
    stats = (2 if shape.norm == "layernorm" else 1) * Mn * 4
    fwd = [mem("head.norm", "norm", 2 * Mn * C * a,
               saves=(("head.norm.in", Mn * C * a), ("head.norm.stats", stats), ("head.norm.out", M * C * a)))]
    if setup.sp:
        fwd.append(comm("head.allgather", "all_gather", M * C * a))
    fwd.append(matmul("head.logits", M, V, C, a))
    if t > 1 and not loss_parallel:
        fwd.append(comm("head.logits.allgather", "all_gather", M * shape.vocab_size * a))
    if a != 4:
        fwd.append(mem("head.logits_float", "copy", M * Vl * (a + 4)))
    fwd.append(mem("head.log_softmax", "softmax", 2 * M * Vl * 4, saves=(("head.logprobs", M * Vl * 4),
                                                                            ("head.targets", M * 8))))
    if t > 1 and loss_parallel:
        fwd += [comm(f"head.loss_parallel.{i}", "all_reduce", M * 4) for i in range(3)]
    bwd = [mem("head.nll.bwd", "copy", M * Vl * 4, backward=True),
           mem("head.log_softmax.bwd", "softmax_bwd", 3 * M * Vl * 4, backward=True)]
    if a != 4:
        bwd.append(mem("head.logits_float.bwd", "copy", M * Vl * (a + 4), backward=True))
    bwd += matmul_backward("head.logits", M, V, C, a, bias=False)
    if setup.sp:
        bwd.append(comm("head.reducescatter.bwd", "reduce_scatter", M * C * a, backward=True))
    elif t > 1:
        bwd.append(comm("head.input_grad.allreduce", "all_reduce", M * C * a, backward=True))
    bwd.append(mem("head.norm.bwd", "norm_bwd", 3 * Mn * C * a, backward=True))
    if shape.tied_embeddings:
        bwd.append(mem("head.tied_grad_accumulate", "copy", 3 * V * C * 4, backward=True))
    return Pass(fwd), Pass(bwd)


def flops_of(ops: list[Op]) -> float:
    """FLOPs executed by ``ops`` (matmuls and attention kernels)."""
    return sum(op.flops for op in ops)
