"""The operators one transformer block, the embedding and the head run, forward and backward.

This is the analytic twin of what plait's GPT (``plait.models.gpt``) and a Llama-style Hugging Face
decoder execute on one rank: every matmul with its ``(m, n, k)``, every memory-bound kernel with the
bytes it reads and writes, the tensor-parallel collectives in the compute stream, and the tensors each
forward operator saves for backward. The cost model (``plait.plan.kernels``) prices each ``Op`` on a
hardware profile; the memory model sums the saved tensors (each distinct tensor once).

Layout effects: tensor parallelism (degree ``t``, Megatron layout) shards heads, the MLP width and the
vocabulary; row-parallel outputs are all-reduced (sequence parallel: reduce-scattered) and the inputs
of column-parallel layers get an all-reduce of their gradient (sequence parallel: an all-gather before
them in forward, a reduce-scatter in backward). With sequence parallelism plait's column-parallel layers of a
block keep the shard of their shared input and gather it again in backward, in the compute stream
(``plait.parallel.tensor.regather``; the head and an MoE feed-forward keep the gathered input, once);
``stack="megatron"`` models Megatron-LM, which keeps the shard too and overlaps its second gather with the
weight-gradient matmul (Korthikanti et al. 2022, section 4.2.2), and also its fused kernels: one QKV
projection, bias-dropout-add in one pass.
``stack="metaseq"`` models metaseq (OPT-175B: Megatron's tensor-parallel layers and fused softmax under
fairscale's FSDP; its ``ModelParallelMultiheadAttention``): one QKV projection split into contiguous chunks (a
copy), q and k pre-scaled, unfused dropout and residual adds, the scores passed through ``nan_to_num`` (which
keeps them for backward), and checkpointed activations distributed over the tensor-parallel ranks
(``--distribute-checkpointed-activations``: a block keeps ``1/t`` of its input and all-gathers it before
recomputing). Both hold half-precision parameters (no autocast).

Mixture of experts (``BlockOps(..., moe=True)``): ``plait.plan.ops_moe``. Float8 Linears (``train.precision = "fp8"``,
``Setup.float8``): ``plait.plan.ops_float8``, applied to a block's forward and backward lists.

Saved tensors, as the code that runs them keeps them (each term checked against
``torch.autograd.graph.saved_tensors_hooks`` counts on plait's GPT and a Hugging Face Llama in
``tests/plan/test_activations.py``). Three precision regimes: float32; half-precision parameters
(Megatron-LM, FSDP2's bf16 policy: everything in bf16 but the norms' statistics, the attention's
log-sum-exp and the loss's log-probabilities); and autocast over float32 parameters (plait's bf16 and
fp16 elsewhere), where the residual stream and the norms stay float32, each Linear fed a float32 tensor
keeps its own half-precision copy of it (q, k and v three copies of the norm's output; gate and up two;
under sequence parallelism plait gathers the shard in half precision and the Linears share it) and every
Linear keeps a half-precision copy of its weight for backward (``w.*``: once per rank, not per
micro-batch, since a copy lives until its backward and autocast re-casts per forward). A fused norm
keeps its input and float32 statistics; Hugging Face's Python RMSNorm also a float32 copy of its input
and the normalized tensor. Rotary's cos and sin are kept once for all blocks (on the embedding). Grouped
query attention keeps K and V at ``n_kv_head`` heads; a SwiGLU MLP keeps its gate, up, SiLU and product
(four ``M x F``), a GELU MLP its pre- and post-activation; a model with no dropout keeps no mask.

Attention: ``flash`` is scaled_dot_product_attention's fused kernel (saves q, k, v, the output and the
row log-sum-exp; executes half the ``T x T`` square when causal; backward re-forms the probabilities:
2.5x the forward's work); ``unfused`` materialises the ``T x T`` scores, softmax and dropout
(Megatron-LM 2021-22, and SDPA's math backend).
"""

from __future__ import annotations

from dataclasses import replace

from plait.plan.opcore import MEMORY_KINDS, Op, Pass, Setup, comm, flops_of, matmul, matmul_backward, mem  # noqa: F401
from plait.plan.ops_float8 import float8_linears, to_float8
from plait.plan.ops_moe import moe_backward, moe_forward, moe_shape
from plait.plan.shapes import ModelShape


class BlockOps:
    """Operators of one transformer block on one rank (see the module docstring)."""

    def __init__(self, shape: ModelShape, setup: Setup, moe: bool = False, recomputed: bool = False) -> None:
        self.s, self.u, self.moe, self.recomputed = shape, setup, moe, recomputed
        t = setup.tp
        self.M = setup.micro_batch * shape.seq_len  # tokens through the matmuls
        self.Mn = self.M // t if setup.sp else self.M  # tokens through norms and the residual stream
        self.C, self.a, self.r = shape.d_model, setup.act_bytes, setup.residual_bytes
        self.Cq, self.Ckv, self.F = shape.d_model // t, shape.kv_dim // t, shape.d_ff // t
        self.H = shape.n_head // t
        self.BH = setup.micro_batch * self.H

    # -- pieces -------------------------------------------------------------------------------------
    def _norm(self, tag: str, consumers: int = 1) -> list[Op]:
        """A norm and what is kept of its output for the ``consumers`` Linears that read it."""
        ops = norm_forward(self.s, self.u, tag, self.Mn)
        ops += consumed(self.u, tag, self.M, self.Mn, self.C, consumers, ops, self._regathers(tag))
        return ops

    def _regathers(self, tag: str) -> bool:
        """Whether plait's Linears reading the norm ``tag``'s output keep its sequence shard and gather it again in
        backward (``plait.parallel.tensor.regather``): under sequence parallelism, for attention and a dense MLP
        (an MoE feed-forward keeps the gathered input whole), unless the block is ``recomputed`` (checkpointed: its
        recomputation gathers the input again, and it is kept whole until the block's backward)."""
        return (self.u.sp and self.u.tp > 1 and self.u.stack == "plait" and not self.recomputed
                and not (self.moe and tag == "ln2"))

    def _regather_backward(self, tag: str) -> list[Op]:
        """The kept shard all-gathered again for the Linears' weight gradients (plait's, in the compute stream)."""
        if not self._regathers(tag):
            return []
        return [comm(f"{tag}.regather.bwd", "all_gather", self.M * self.C * self.a, backward=True)]

    def weight_bytes(self) -> float:
        """Matmul weights of this block on this rank (tensor-parallel shards; a MoE block: its router, local
        experts and shared experts)."""
        C, F = self.C, self.F
        attn = C * (self.Cq + 2 * self.Ckv) + self.Cq * C
        if self.moe:
            _, local, _, H, _ = moe_shape(self)
            return attn + local * 2 * C * H + self.s.shared_experts * 2 * C * H
        return attn + (3 if self.s.gated_mlp else 2) * C * F

    def _weight_casts(self) -> list[Op]:
        """Under autocast each Linear casts its float32 weight to half precision once per forward and keeps
        the copy for backward (the router stays float32)."""
        if not self.u.casts:
            return []
        n = self.weight_bytes() - (self.C * self.s.num_experts if self.moe else 0)
        if self.u.float8:  # a float8 Linear casts its own weight (plait.plan.ops_float8), keeping no copy
            n -= sum(float8_linears(self).values())
        return [mem("weights.cast", "copy", n * (4 + 2), saves=(("w.block", 2 * n),))] if n else []

    def _float8(self, ops: list[Op]) -> Pass:
        """``ops``, with the float8 Linears' matmuls and casts under ``train.precision = "fp8"``."""
        if not self.u.float8:
            return Pass(ops)
        return Pass(to_float8(ops, float8_linears(self), weight_cast=not self.u.float8_gathered))

    def _residual(self, tag: str) -> list[Op]:
        M, C, a, r = self.Mn, self.C, self.a, self.r
        if self.u.stack == "megatron":  # fused bias-dropout-add: read the branch and the residual, write once
            mask = M * C if self.s.dropout > 0 else 0
            return [mem(f"{tag}.bias_dropout_add", "copy", 3 * M * C * a + mask,
                        saves=((f"{tag}.mask", mask),) if mask else ())]
        ops = []
        if self.s.dropout > 0:
            ops.append(mem(f"{tag}.dropout", "copy", 2 * M * C * a + M * C, saves=((f"{tag}.mask", M * C),)))
        ops.append(mem(f"{tag}.add", "copy", M * C * (2 * r + a)))  # the residual plus the branch
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
            # cp: keys of the whole sequence; every cp_impl keeps only its shard's (allgather gathers them again in
            # backward)
            flops = 4.0 * BH * T * T * D * (0.5 if u.causal else 1.0) * u.cp
            return [Op("attn.sdpa", "attention", flops=flops, attn=(BH, T, D),
                       saves=(ctx, ("attn.lse", BH * T * 4)), out=ctx[1] + BH * T * 4)]
        sq = BH * T * T
        ops = []
        if u.stack == "metaseq":  # q and k pre-scaled by sqrt(scaling); non-finite scores zeroed (nan_to_num)
            ops.append(mem("attn.scale_qk", "copy", 2 * self.M * (self.Cq + self.Ckv) * a))
        ops.append(matmul("attn.scores", T, T, D, a, batch=BH))
        if u.stack == "metaseq":
            ops.append(mem("attn.nan_to_num", "copy", 2 * sq * a, saves=(("attn.scores", sq * a),)))
        ops.append(mem("attn.softmax", "softmax", 2 * sq * a, saves=(("attn.probs", sq * a),)))
        if s.dropout > 0:
            ops.append(mem("attn.dropout", "copy", 2 * sq * a + sq, saves=(("attn.pmask", sq), ("attn.pdrop", sq * a))))
        ops += [matmul("attn.context", T, D, T, a, batch=BH),
                mem("attn.merge_heads", "copy", 2 * self.M * self.Cq * a, saves=(ctx,))]
        return ops

    def attention_core_backward(self) -> list[Op]:
        s, u, a, BH = self.s, self.u, self.a, self.BH
        T, D = s.seq_len, s.head_dim
        if u.attention == "flash":
            flops = 2.5 * 4.0 * BH * T * T * D * (0.5 if u.causal else 1.0) * u.cp
            return [Op("attn.sdpa.bwd", "attention", flops=flops, attn=(BH, T, D), backward=True)]
        sq = BH * T * T
        ops = [mem("attn.merge_heads.bwd", "copy", 2 * self.M * self.Cq * a, backward=True)]
        ops += matmul_backward("attn.context", T, D, T, a, bias=False, batch=BH)
        if s.dropout > 0:
            ops.append(mem("attn.dropout.bwd", "copy", 2 * sq * a + sq, backward=True))
        ops.append(mem("attn.softmax.bwd", "softmax_bwd", 3 * sq * a, backward=True))
        if u.stack == "metaseq":
            ops.append(mem("attn.nan_to_num.bwd", "copy", 3 * sq * a, backward=True))
        ops += matmul_backward("attn.scores", T, T, D, a, bias=False, batch=BH)
        if u.stack == "metaseq":
            ops.append(mem("attn.scale_qk.bwd", "copy", 2 * self.M * (self.Cq + self.Ckv) * a, backward=True))
        return ops

    def _qkv_saves(self) -> tuple:
        a, M = self.a, self.M
        return (("attn.q", M * self.Cq * a), ("attn.k", M * self.Ckv * a), ("attn.v", M * self.Ckv * a))

    # -- the block ----------------------------------------------------------------------------------
    def forward(self) -> Pass:
        s, a, M, C, F = self.s, self.a, self.M, self.C, self.F
        ops = self._weight_casts() + self._norm("ln1", 1 if self.u.stack != "plait" else 3)
        if self.u.stack != "plait":  # one fused QKV projection; metaseq copies q, k, v into contiguous chunks
            ops.append(matmul("attn.qkv", M, self.Cq + 2 * self.Ckv, C, a, saves=self._qkv_saves()))
            if self.u.stack == "metaseq":
                ops.append(mem("attn.qkv_split", "copy", 2 * M * (self.Cq + 2 * self.Ckv) * a))
        else:
            ops += [matmul("attn.q", M, self.Cq, C, a), matmul("attn.k", M, self.Ckv, C, a),
                    matmul("attn.v", M, self.Ckv, C, a, saves=self._qkv_saves())]
        if s.norm == "rmsnorm":  # rotary positions on q and k
            ops.append(mem("attn.rotary", "copy", 2 * M * (self.Cq + self.Ckv) * a))
        ops += self.attention_core()
        ops.append(matmul("attn.proj", M, C, self.Cq, a))
        if self.u.tp > 1:
            ops.append(self._row_output("attn"))
        ops += self._residual("res1") + self._norm("ln2", 2 if s.gated_mlp and not self.moe else 1)
        if self.moe:
            return self._float8(ops + moe_forward(self) + self._residual("res2"))
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
        return self._float8(ops)

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
            ops += moe_backward(self)
        else:
            ops += self._mlp_backward()
        if t > 1 and not self.u.sp:
            ops.append(comm("mlp.input_grad.allreduce", "all_reduce", M * C * a, backward=True))
        ops += self._norm_backward("ln2")
        if s.dropout > 0:
            ops.append(mem("res1.dropout.bwd", "copy", 2 * self.Mn * C * a + self.Mn * C, backward=True))
        ops += self._attention_backward()
        return self._float8(ops)

    def _mlp_backward(self) -> list[Op]:
        s, a, M, C, F, b = self.s, self.a, self.M, self.C, self.F, self.s.bias
        ops = matmul_backward("mlp.proj", M, C, F, a, b)
        if s.gated_mlp:
            ops.append(mem("mlp.silu_mul.bwd", "act_bwd", 5 * M * F * a, backward=True))
            ops += self._regather_backward("ln2")
            ops += matmul_backward("mlp.gate", M, F, C, a, b) + matmul_backward("mlp.up", M, F, C, a, b)
            ops.append(mem("mlp.input_grad_sum", "copy", 3 * M * C * a, backward=True))
        else:
            ops.append(mem("mlp.gelu.bwd", "act_bwd", 3 * M * F * a, backward=True))
            ops += self._regather_backward("ln2") + matmul_backward("mlp.fc", M, F, C, a, b)
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
        if self.u.stack != "plait":
            ops += matmul_backward("attn.qkv", M, self.Cq + 2 * self.Ckv, C, a, b)
        else:
            ops += self._regather_backward("ln1")
            ops += (matmul_backward("attn.v", M, self.Ckv, C, a, b) + matmul_backward("attn.k", M, self.Ckv, C, a, b)
                    + matmul_backward("attn.q", M, self.Cq, C, a, b))
            ops.append(mem("attn.input_grad_sum", "copy", 6 * M * C * a, backward=True))
        if t > 1 and not self.u.sp:
            ops.append(comm("attn.input_grad.allreduce", "all_reduce", M * C * a, backward=True))
        return ops + self._norm_backward("ln1")


def norm_forward(shape: ModelShape, u: Setup, tag: str, Mn: int) -> list[Op]:
    """A norm over ``Mn`` tokens and what it saves itself: a fused LayerNorm / RMSNorm kernel keeps its
    input and float32 statistics; Hugging Face's RMSNorm (Python: ``x.float()``, ``pow``, ``mean``,
    ``rsqrt``, ``x * rsqrt``, ``.to(dtype)``, ``weight * .``) keeps a float32 copy of its input, the float32
    ``rsqrt`` and the normalized tensor before the weight, in the input's dtype."""
    C, r = shape.d_model, u.residual_bytes
    stats = (2 if shape.norm == "layernorm" else 1) * Mn * 4
    if shape.norm == "rmsnorm" and u.stack != "megatron":
        upcast = (r + 4) if r < 4 else 0
        saves = ((f"{tag}.in", Mn * C * 4), (f"{tag}.stats", stats), (f"{tag}.normalized", Mn * C * r))
        return [mem(tag, "norm", Mn * C * (upcast + 24 + 3 * r), saves=saves)]
    return [mem(tag, "norm", 2 * Mn * C * r, saves=((f"{tag}.in", Mn * C * r), (f"{tag}.stats", stats)))]


def consumed(u: Setup, tag: str, M: int, Mn: int, C: int, consumers: int, ops: list[Op],
             regather: bool = False) -> list[Op]:
    """What is kept of a norm's output for the ``consumers`` Linears reading it (``ops``: the norm, whose
    saves may grow): the output itself, once; under sequence parallelism the all-gathered input, once for all
    its Linears (plait's head and MoE feed-forward; under autocast plait casts the shard to half precision before
    the gather, ``plait.parallel.tensor.plan.PrepareGatheredInput``) or the shard, gathered again in backward
    (Megatron-LM; plait's attention and dense MLP, ``regather``: ``plait.parallel.tensor.regather``, which also
    casts the shard first under autocast and keeps the cast); under autocast without sequence parallelism one
    half-precision copy per Linear, which autocast casts separately for each (it caches only parameters' casts)."""
    a, r = u.act_bytes, u.residual_bytes
    out: list[Op] = []
    if u.sp:
        full = M * C * a
        keep = ((f"{tag}.out", Mn * C * a),) if u.stack == "megatron" or regather else ((f"{tag}.gathered", full),)
        if u.casts and u.stack != "megatron":
            out.append(mem(f"{tag}.cast", "copy", Mn * C * (r + 2)))
        out.append(Op(f"{tag}.allgather", "comm", bytes=full, comm="all_gather", saves=keep))
    elif u.casts:
        out += [mem(f"{tag}.cast{i}", "copy", M * C * (r + 2), saves=((f"{tag}.cast{i}", M * C * 2),))
                for i in range(consumers)]
    else:
        ops[0] = replace(ops[0], saves=ops[0].saves + ((f"{tag}.out", Mn * C * r),))
    return out


def embedding_ops(shape: ModelShape, setup: Setup) -> tuple[Pass, Pass]:
    """Forward and backward of the token (and learned position) embedding on the first stage."""
    M, C, a, t = setup.micro_batch * shape.seq_len, shape.d_model, setup.act_bytes, setup.tp
    Mn = M // t if setup.sp else M
    r = setup.residual_bytes
    fwd = [mem("embed.lookup", "copy", 2 * M * C * r, saves=(("embed.ids", M * 8),))]
    if shape.norm == "rmsnorm":  # rotary cos and sin, computed once per forward and kept by every block
        fwd.append(mem("embed.rotary", "copy", 2 * shape.seq_len * shape.head_dim * r,
                       saves=(("embed.rotary", 2 * shape.seq_len * shape.head_dim * r),)))
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
    fwd = norm_forward(shape, setup, "head.norm", Mn)
    fwd += consumed(setup, "head.norm", M, Mn, C, 1, fwd)
    if setup.casts:  # the head's weight, cast once per forward and kept for backward
        fwd.append(mem("head.weight.cast", "copy", V * C * (4 + 2), saves=(("w.head", V * C * 2),)))
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
