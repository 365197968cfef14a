"""Routers of ``plait.nn.MoE`` (``plait.nn.routing``), single process: each against its source's formula.

Sigmoid scores with group-limited top-k against transformers' ``DeepseekV3TopkRouter`` (the model's own code) on
the same weights and bias: the same experts chosen and gate weights within 1e-7 (float32, the same operations;
measured 0.0). DeepSeek-V3's sequence-wise balance loss against its equations 17-20 written out per sequence
(1e-7); aux-loss-free balancing moving the bias by the sign of each expert's load error; the capacity drop and the
aux loss staying right with sigmoid scores.
"""

from __future__ import annotations

import pytest
import torch

from plait.nn import MoE
from plait.nn.routing import RouterSpec, select, sequence_aux_loss

E, C, K = 8, 16, 2


def test_sigmoid_group_limited_top_k_equals_deepseek_v3s_router() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV3Config(hidden_size=C, n_routed_experts=E, num_experts_per_tok=K, n_group=4,
                                        topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(generator=g)
        router.e_score_correction_bias.normal_(std=0.3, generator=g)
    x = torch.randn(64, C, generator=g)
    _, hf_weights, hf_top = router(x)
    spec = RouterSpec(E, K, "sigmoid", num_groups=4, topk_groups=2, route_scale=2.5)
    _, top, _, gates = select(x @ router.weight.T, spec, router.e_score_correction_bias)
    ours = torch.sort(top, dim=-1)
    theirs = torch.sort(hf_top, dim=-1)
    assert torch.equal(ours.values, theirs.values)
    assert torch.allclose(gates.gather(1, ours.indices), hf_weights.gather(1, theirs.indices), atol=1e-7)
    groups = top // (E // 4)  # every token's experts lie in at most topk_groups=2 of the 4 groups
    assert all(len(set(row)) <= 2 for row in groups.tolist())


def test_sequence_aux_loss_is_deepseek_v3s_per_sequence_formula() -> None:
    g = torch.Generator().manual_seed(1)
    b, t = 3, 5
    p = torch.rand(b * t, E, generator=g)
    p = p / p.sum(-1, keepdim=True)
    top = torch.sort(torch.rand(b * t, E, generator=g), dim=-1).indices[:, :K]
    expect = 0.0
    for s in range(b):
        f = [E / (K * t) * sum(int(e in top[s * t + i].tolist()) for i in range(t)) for e in range(E)]
        prob = [float(p[s * t:(s + 1) * t, e].mean()) for e in range(E)]
        expect += 0.01 * sum(fe * pe for fe, pe in zip(f, prob, strict=True)) / b
    assert float(sequence_aux_loss(p, top, t, 0.01)) == pytest.approx(expect, abs=1e-7)
    # the same sequences, split into micro-batches: the mean of the parts' losses is the whole's
    parts = [sequence_aux_loss(p[i * t:(i + 1) * t], top[i * t:(i + 1) * t], t, 0.01) for i in range(b)]
    assert float(sum(parts) / b) == pytest.approx(expect, abs=1e-7)


def test_moe_with_sigmoid_routing_trains_its_router_through_every_loss() -> None:
    torch.manual_seed(0)
    layer = MoE(C, 32, E, top_k=K, score="sigmoid", num_groups=2, topk_groups=1, route_scale=1.5,
                balance="bias", seq_aux_loss_coef=0.1, z_loss_coef=0.01, capacity_factor=0.5)
    x = torch.randn(2, 6, C, requires_grad=True)
    (layer(x) * 0).sum().backward()  # main loss zero: the sequence aux and z losses alone reach the router
    assert layer.router.weight.grad.abs().sum() > 0
    stats = layer.last_stats
    assert stats["dropped"] > 0 and stats["seq_aux_loss"] > 0 and stats["aux_loss"] == 0.0  # balance=bias: no Switch
    assert sum(stats["tokens_per_expert"]) == 2 * 6 * K  # counted before the capacity drops
    groups = layer.route(x.detach().reshape(-1, C))[0].experts.view(-1, K) // (E // 2)
    assert all(len(set(row) - {2}) <= 1 for row in groups.tolist())  # one group per token (2: dropped)


def test_aux_loss_free_bias_moves_towards_underloaded_experts_and_only_chooses() -> None:
    layer = MoE(C, 32, 4, top_k=1, score="sigmoid", balance="bias", bias_update_rate=0.1)
    layer.update_bias(torch.tensor([10.0, 0.0, 5.0, 5.0]))
    assert layer.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.0])
    x = torch.randn(5, C)
    with torch.no_grad():
        layer.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 9.0]))  # every token picks expert 3...
    routing, _ = layer.route(x)
    assert routing.experts.tolist() == [3] * 5
    # ...and weighs it by its sigmoid score alone (top-1: no renormalisation), never by the bias
    assert torch.allclose(routing.weights, torch.sigmoid(x @ layer.router.weight.detach().T)[:, 3])
