"""The vocabulary of the operator lists (``plait.plan.ops``): operators, how a rank runs them, passes.

An ``Op`` is one operator with its FLOPs, the bytes it reads and writes, the collective it is (if any)
and the tensors it saves for backward; a ``Pass`` is a list of them; ``Setup`` is how one block runs on
one rank (micro-batch, tensor and sequence parallelism, precision regime, attention kernel, stack).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MEMORY_KINDS = ("copy", "norm", "norm_bwd", "act", "act_bwd", "softmax", "softmax_bwd", "reduce", "embed_bwd",
                "optimizer")


@dataclass(frozen=True)
class Op:
    """One operator: a matmul (``m, n, k``, ``batch`` for a batched one), an attention kernel, a
    memory-bound kernel (``kind`` in ``MEMORY_KINDS``) or a collective (``kind="comm"``) in the compute
    stream. ``bytes`` is what it reads plus writes (a collective: its buffer); ``saves`` names the tensors
    it keeps for backward with their bytes; ``out`` is the bytes of its output (set for matmuls and attention
    kernels, whose outputs plait's selective checkpointing keeps); ``dtype`` a matmul's own precision where it is not
    the rank's (``fp8``: a float8 Linear's, ``plait.plan.ops_float8``)."""

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
    out: float = 0.0  # bytes of what it returns (matmuls and attention kernels: what a selective policy keeps)
    dtype: str = ""


@dataclass(frozen=True)
class Setup:
    """How one block runs on one rank: sequences per forward, tensor-parallel degree, sequence
    parallelism, activation bytes (4 fp32, 2 bf16/fp16: what matmuls write), attention kernel, software
    stack, and ``autocast``: half-precision matmuls over float32 parameters (plait's bf16 and fp16 outside
    FSDP2's bf16 policy), where the residual stream and the norms stay float32 and every Linear saves its
    own half-precision copy of a float32 input and of its weight (module docstring of ``plait.plan.ops``)."""

    micro_batch: int
    tp: int = 1
    sp: bool = False
    act_bytes: int = 4
    attention: str = "flash"
    stack: str = "plait"
    causal: bool = True
    ep: int = 1
    autocast: bool = False
    # context parallelism (plait.plan.workload.Workload.rank_view): the block runs on its 1 / cp of the sequence and
    # each query attends to cp times its own keys; allgather saves the gathered keys and values
    cp: int = 1
    cp_impl: str = "ring"
    # train.precision = "fp8": the block Linears multiply in float8 (plait.plan.ops_float8); float8_gathered: their
    # weights arrive in float8 from FSDP2's all-gather (ZeRO-3), so no cast of them runs in the block
    float8: bool = False
    float8_gathered: bool = False

    @property
    def residual_bytes(self) -> int:
        """Bytes per element of the residual stream and the norms' inputs: float32 under autocast."""
        return 4 if self.autocast else self.act_bytes

    @property
    def casts(self) -> bool:
        """Whether Linears take float32 inputs they cast (and save) in half precision: autocast."""
        return self.autocast and self.act_bytes < 4


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
              m=m, n=n, k=k, batch=batch, saves=saves, out=float(batch * m * n * a))


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


def flops_of(ops: list[Op]) -> float:
    """FLOPs executed by ``ops`` (matmuls and attention kernels)."""
    return sum(op.flops for op in ops)
