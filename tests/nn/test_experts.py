"""Grouped experts (``plait.nn.experts``) against the loop over experts, single process.

The three implementations compute the same per-expert matmuls; the grouped and padded kernels sum each dot
product in their own order, so forward outputs and gradients agree to float32 rounding: within ``ATOL`` = 1e-6
(values of order 0.1; measured 0.0, bitwise, on torch 2.13 CPU, whose kernels run the same per-group
matmuls; GPU kernels sum in their own order). Hugging Face's Mixtral block is compared the same
way between its ``grouped_mm`` and ``eager`` experts implementations (its own code, which plait's expert-parallel
forward calls).
"""

from __future__ import annotations

import pytest
import torch

from plait.nn.experts import GroupedExperts, choose_impl, count_ids

E, C, H, R = 4, 16, 32, 40
ATOL = 1e-6


def _rows(seed: int = 0, padding: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """R rows of x, a row index per assignment, and local expert ids with ``padding`` rows of id E (and one
    expert, 2, that gets no row)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, C, generator=g)
    rows = torch.randint(0, R, (R,), generator=g)
    ids = torch.tensor([0, 1, 3])[torch.randint(0, 3, (R,), generator=g)]
    ids[torch.randperm(R, generator=g)[:padding]] = E
    return x, rows, ids


def _run(impl: str, x: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, dtype=torch.float32) -> dict:
    torch.manual_seed(0)
    experts = GroupedExperts(E, C, H, impl).to(dtype)
    xr = x.to(dtype).clone().requires_grad_()
    y = experts(xr, rows, ids, cap=R)
    (y.float() * torch.linspace(-1, 1, C)).sum().backward()  # a non-uniform output gradient
    return {"y": y.detach().float(), "x": xr.grad.float(), "w1": experts.w1.grad.float(), "w2": experts.w2.grad.float()}


@pytest.mark.parametrize("impl", ["grouped", "padded"])
def test_grouped_and_padded_equal_the_loop_forward_and_gradients(impl) -> None:
    x, rows, ids = _rows()
    ref, got = _run("loop", x, rows, ids), _run(impl, x, rows, ids)
    for key in ref:
        assert torch.allclose(got[key], ref[key], atol=ATOL, rtol=0), (impl, key, (got[key] - ref[key]).abs().max())
    assert (got["y"][ids == E] == 0).all()  # padding rows come back as zeros
    assert (got["w1"][2] == 0).all() and (got["w2"][2] == 0).all()  # an expert without rows: zero, not None


def test_grouped_runs_in_bf16_and_auto_chooses_per_device() -> None:
    x, rows, ids = _rows(1)
    ref, got = _run("loop", x, rows, ids, torch.bfloat16), _run("grouped", x, rows, ids, torch.bfloat16)
    assert torch.allclose(got["y"], ref["y"], atol=2e-2)  # bf16: 8 mantissa bits
    cpu = torch.device("cpu")
    assert choose_impl("auto", cpu, torch.float32, (C, H)) == "grouped"
    assert choose_impl("auto", cpu, torch.float32, (C, 30)) == "loop"  # a 120-byte row: not 16-byte aligned
    assert choose_impl("auto", cpu, torch.float16, (C, H)) == "loop"
    assert choose_impl("padded", cpu, torch.float32, (C, H)) == "padded"
    assert count_ids(torch.tensor([0, 2, 2, 5, 3]), 4).tolist() == [1, 0, 2, 1]  # id 5 >= 4: not counted


def test_compiled_grouped_experts_equal_eager_in_float32() -> None:
    """torch's meta function of _grouped_mm takes bf16 only: float32 goes through plait's custom op."""
    x, rows, ids = _rows(2)
    torch.manual_seed(0)
    experts = GroupedExperts(E, C, H, "grouped")
    eager = experts(x, rows, ids)
    compiled = torch.compile(experts)(x, rows, ids)
    assert torch.allclose(compiled, eager, atol=ATOL)


def test_hf_mixtral_block_grouped_equals_its_loop() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(hidden_size=C, intermediate_size=H, num_local_experts=E, num_experts_per_tok=2,
                                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=32)
    out = {}
    for impl in ("eager", "grouped_mm"):
        torch.manual_seed(0)
        cfg._experts_implementation = impl
        block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(cfg)
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.1)
        x = torch.randn(2, 5, C, generator=torch.Generator().manual_seed(3), requires_grad=True)
        y = block(x)
        y = y[0] if isinstance(y, tuple) else y
        (y * torch.linspace(-1, 1, C)).sum().backward()
        out[impl] = [y.detach(), x.grad] + [p.grad for p in block.parameters()]
    for a, b in zip(out["eager"], out["grouped_mm"], strict=True):
        assert torch.allclose(a, b, atol=ATOL), (a - b).abs().max()
