"""The experts of a mixture-of-experts layer, run as grouped matrix products: ``plait.nn.GroupedExperts``.

``GroupedExperts`` holds ``E`` two-layer MLPs ``C -> H -> C`` (GELU) as 3-D weights ``w1 (E, C, H)`` and
``w2 (E, H, C)``. A forward receives rows and the local expert of each row; a row whose expert id is ``E`` or
more is padding (a dropped assignment, an empty slot of the dispatch buffer) and comes back as zeros. Three
implementations of the same maths (``moe.experts``), each one pass over the rows:

* ``grouped``: rows sorted by expert, the group offsets computed on the device, one grouped GEMM per weight
  (``torch._grouped_mm``: CUTLASS on CUDA in bf16, torch's own kernel on CPU). No host read. Rows past the
  last offset (padding) are left unwritten by the kernel, so they are zeroed before the first product and after
  the second (forward and backward), as transformers' grouped experts do. torch's meta function of
  ``_grouped_mm`` accepts bf16 only, so other dtypes go through plait's custom op ``plait::grouped_mm`` (the
  same kernel, its shapes declared), which torch.compile traces as one opaque call.
* ``padded``: rows scattered into an ``(E, cap, C)`` buffer (``cap``: the most rows one expert can get, a
  static bound from the caller) and one batched ``bmm`` per weight. No host read, static shapes, but
  ``E x cap`` rows of work however few rows arrived.
* ``loop``: one matmul per expert on the rows it got, sized by a host read of the counts (the reference,
  and the exact-FLOPs choice where neither kernel above applies).

``auto`` (the default) chooses per device and dtype: ``grouped`` where ``torch._grouped_mm`` runs without a host
read (CUDA compute capability >= 8.0 in bf16; CPU in float32 or bf16), with every row stride a multiple of
16 bytes (``C`` and ``H`` multiples of 4 in float32, of 8 in bf16); otherwise ``padded`` while torch.compile
traces (static shapes, no graph break) and ``loop`` in eager. On CUDA in float32 or fp16 torch's grouped kernel
is not the CUTLASS one (its fallback reads the offsets on the host), hence not chosen there.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

IMPLS = ("auto", "grouped", "padded", "loop")


@torch.library.custom_op("plait::grouped_mm", mutates_args=())
def _grouped_mm_op(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x, w, offs=offs)


@_grouped_mm_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.size(0), w.size(-1))


@torch.library.custom_op("plait::grouped_mm_weight_grad", mutates_args=())
def _weight_grad_op(x: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x.t(), grad, offs=offs)  # (G, K, N): per group x_g^T @ grad_g; empty groups 0


@_weight_grad_op.register_fake
def _(x: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(offs.size(0), x.size(1), grad.size(1))


def _grouped_mm_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    x, w, offs = ctx.saved_tensors
    grad = grad.contiguous()  # the kernel takes no zero-stride (expanded) operand
    grad_x = _grouped_mm_op(grad, w.transpose(-2, -1), offs)  # (R, K), per group grad @ w_g^T
    return grad_x, _weight_grad_op(x, grad, offs), None


def _grouped_mm_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x (R, K)`` rows grouped by ``offs`` (int32 ends of each group, on the device) times ``w (G, K, N)``:
    rows ``[offs[g-1], offs[g])`` by ``w[g]``; rows past ``offs[-1]`` are unspecified."""
    if x.dtype == torch.bfloat16:
        return torch._grouped_mm(x, w, offs=offs)
    return _grouped_mm_op(x, w, offs)


def _aligned(*sizes: int, dtype: torch.dtype) -> bool:
    step = 16 // torch.empty((), dtype=dtype).element_size()
    return all(s % step == 0 for s in sizes)


def choose_impl(requested: str, device: torch.device, dtype: torch.dtype, widths: tuple[int, ...]) -> str:
    """The implementation ``auto`` means on ``device`` for ``dtype`` and row widths ``widths`` (see the module
    docstring); an explicit request is returned as it is."""
    if requested != "auto":
        return requested
    grouped = hasattr(torch, "_grouped_mm") and _aligned(*widths, dtype=dtype)
    if device.type == "cuda":
        grouped = grouped and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 0)
    elif device.type == "cpu":
        grouped = grouped and dtype in (torch.float32, torch.bfloat16)
    else:
        grouped = False
    if grouped:
        return "grouped"
    return "padded" if torch.compiler.is_compiling() else "loop"


def count_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    """How many of ``ids`` equal each of ``0 .. n-1`` (ids >= n are not counted), on the device: a static
    shape, unlike ``bincount``, so torch.compile keeps one graph."""
    ones = torch.ones_like(ids)
    return torch.zeros(n + 1, dtype=ids.dtype, device=ids.device).scatter_add_(0, ids.clamp(max=n), ones)[:n]


class GroupedExperts(nn.Module):
    """``num_experts`` MLPs ``C -> H -> C`` (GELU) as 3-D weights ``w1 (E, C, H)``, ``w2 (E, H, C)``, run by
    ``impl`` (see the module docstring)."""

    def __init__(self, num_experts: int, d_model: int, d_hidden: int, impl: str = "auto") -> None:
        super().__init__()
        if impl not in IMPLS:
            raise ValueError(f"moe.experts={impl!r}: choose one of {IMPLS}")
        self.impl = impl
        self.w1 = nn.Parameter(torch.empty(num_experts, d_model, d_hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, d_hidden, d_model))
        nn.init.normal_(self.w1, std=0.02)
        nn.init.normal_(self.w2, std=0.02 / math.sqrt(2))

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's experts' weights as plain tensors (a DTensor's local shard under expert parallelism)."""
        w1, w2 = self.w1, self.w2
        if hasattr(w1, "to_local"):
            w1, w2 = w1.to_local(), w2.to_local()
        return w1, w2

    def forward(self, x: torch.Tensor, rows: torch.Tensor, local_experts: torch.Tensor,
                cap: int | None = None) -> torch.Tensor:
        """Each row ``x[rows[i]]`` through local expert ``local_experts[i]`` (ids >= E: zeros); returns ``(R, C)``
        in row order. ``cap``: the most rows one expert can get (``padded`` sizes its buffer by it; default R).

        Dispatchers call the module (not a method), once per MoE forward, so FSDP2's hooks gather its weights
        when the experts are sharded over the expert-data-parallel ranks (``parallel.zero=3``). Every local
        expert's weights take part in the graph, so a weight no row reached gets a zero gradient, never None."""
        w1, w2 = self.local_weights()
        w1, w2 = w1.to(x.dtype), w2.to(x.dtype)
        n = w1.size(0)
        impl = choose_impl(self.impl, x.device, x.dtype, (w1.size(1), w1.size(2)))
        ids = local_experts.clamp(max=n)  # n: padding
        order = torch.argsort(ids, stable=True)  # grouped by expert, padding last
        ids_sorted = ids.index_select(0, order)
        xs = x.index_select(0, rows.index_select(0, order))  # (R, C): one gather
        counts = count_ids(ids_sorted, n)  # (n,)
        if impl == "grouped":
            y = self._grouped(xs, ids_sorted < n, counts, w1, w2)
        elif impl == "padded":
            y = self._padded(xs, ids_sorted, counts, w1, w2, cap if cap is not None else len(rows))
        elif impl == "loop":
            y = self._loop(xs, counts, w1, w2)
        else:
            raise ValueError(f"moe.experts={impl!r}: choose one of {IMPLS}")
        return y.new_empty(y.shape).index_copy(0, order, y)  # back to row order: one scatter

    @staticmethod
    def _grouped(xs: torch.Tensor, valid: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor,
                 w2: torch.Tensor) -> torch.Tensor:
        offs = counts.cumsum(0).to(torch.int32)
        keep = valid[:, None]
        xs = torch.where(keep, xs, 0.0)  # backward: the kernel's unwritten padding rows never reach x
        h = F.gelu(grouped_mm(xs, w1, offs), approximate="tanh")  # (R, H)
        return torch.where(keep, grouped_mm(h, w2, offs), 0.0)  # (R, C), padding rows zero

    @staticmethod
    def _padded(xs: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                cap: int) -> torch.Tensor:
        n, r = w1.size(0), xs.size(0)
        start = counts.cumsum(0) - counts  # (n,) first sorted row of each expert
        pos = torch.arange(r, device=xs.device) - torch.cat([start, start.new_zeros(1)]).index_select(0, ids)
        slot = torch.where(ids < n, ids * cap + pos, n * cap)  # padding rows: the spare slot at the end
        buf = xs.new_zeros(n * cap + 1, xs.size(-1)).index_copy(0, slot, xs)[:-1].view(n, cap, -1)  # (n, cap, C)
        h = F.gelu(torch.bmm(buf, w1), approximate="tanh")  # (n, cap, H)
        y = torch.bmm(h, w2).reshape(n * cap, -1)  # (n cap, C)
        return torch.cat([y, y.new_zeros(1, y.size(-1))]).index_select(0, slot)

    @staticmethod
    def _loop(xs: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        outs, start = [], 0
        for e, c in enumerate(counts.tolist()):  # the host read this implementation is sized by
            h = F.gelu(xs[start:start + c] @ w1[e], approximate="tanh")  # (c, H)
            outs.append(h @ w2[e])  # (c, C)
            start += c
        outs.append(xs.new_zeros(xs.size(0) - start, w2.size(-1)))  # padding rows
        return torch.cat(outs)
