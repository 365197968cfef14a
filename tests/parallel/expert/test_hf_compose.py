"""A Hugging Face mixture-of-experts model with every dimension at once, in the user's own loop, equals one process.

The model: a tiny Qwen3-MoE from a config (2 layers, hidden 32, 4 heads of 8, 2 key-value heads, per-head q/k norms;
4 experts of width 32, top-2; its own auxiliary load-balancing loss on, ``output_router_logits=True`` with coefficient
0.1), random fp32 weights, every rank starting from other ones (plait broadcasts rank 0's). The loop is the user's:
``loss = model(input_ids=x, labels=x).loss; p.backward(loss); p.step()`` on each data-parallel rank's rows of a global
batch of 4 sequences of 16 tokens.

One spawned group of 8 ranks (the smallest world holding them: expert-parallel ranks are data-parallel ranks, so ep=2
needs dp=2, times tp=2 times cp=2; mesh dp_replicate 1 x ep 2 x cp 2 x tp 2), two layouts:

- ``zero3-tp2-ep2-cp2``: ZeRO-3 (FSDP2 over dp x cp, 2-D with tp), tensor parallelism by the model's shipped plan
  (attention only: the MoE blocks stay whole on every tp rank, their experts sharded over ep and, under ZeRO-3, over
  the cp ranks holding the same experts), context parallelism (ring attention) cutting each sequence in the model's
  forward;
- ``tp2-sp-ep2-cp2``: sequence parallelism (each tp rank routes its own sequence shard through the MoE blocks, whose
  gradients are summed over tp; plait's reducer), with ep and cp as above.

Under cp and sp each rank routes a shard of each sequence, yet the router, its top-k and the tokens each expert gets
are the model's own, token by token; the auxiliary loss is taken over the whole sequences (the router logits gathered
over the shards: ``plait.parallel.expert.apply.WholeRouterLogits``), so it is the one process's.

The reference is the same loop in one plain PyTorch process: each data-parallel rank's rows as one accumulation
micro-step of 1/dp, ``clip_grad_norm_(1.0)``, AdamW at lr 1e-3, 3 steps. Compared: every step's loss (``global_loss``),
every parameter's gradient at step 1 after clipping (gathered whole: DTensors with ``full_tensor``, expert gradients
as the global ``(E, ...)`` tensors), every parameter after 3 steps (``p.full_state_dict``). fp32, the same maths summed
in another order (ring attention's blocks, tp's partial sums, gradients averaged over dp x cp, the experts' all-to-all),
so: losses within ``LOSS_ATOL``; gradients within ``GRAD_RTOL`` of their tensor's largest element; parameters within
``PARAM_ATOL`` beyond each element's AdamW slack (``references.adam_slack`` for gradients off by that rounding: near a
zero gradient AdamW's first update has slope lr / eps). Largest measured on torch 2.13 CPU, transformers 5.24, over
both layouts and all 8 ranks: losses 7.2e-7, gradients 7.4e-7 of their tensor's largest element (3.0e-8 absolute),
parameters 4.8e-7 (6e-9 beyond their slack).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from helpers import run_ranks
from references import adam_slack, beyond_slack

transformers = pytest.importorskip("transformers", reason="the hf extra (pip install 'plait[hf]') is not installed")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

STEPS, GLOBAL, SEQ, V, LR, CLIP = 3, 4, 16, 64, 1e-3, 1.0
LOSS_ATOL, PARAM_ATOL, GRAD_RTOL = 1e-5, 3e-5, 2e-6
LAYOUTS = {"zero3-tp2-ep2-cp2": {"zero": 3, "tp": 2, "ep": 2, "cp": 2},
           "tp2-sp-ep2-cp2": {"tp": 2, "sequence_parallel": True, "ep": 2, "cp": 2}}
WORLD, DP = 8, 2


def build(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=64, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1))


def batch(step: int) -> torch.Tensor:
    """The global batch of ``step``: (GLOBAL, SEQ) token ids; data-parallel rank r takes the r-th of dp row blocks."""
    return torch.randint(0, V, (GLOBAL, SEQ), generator=torch.Generator().manual_seed(100 + step))


def reference() -> dict:
    """The user's loop in one plain PyTorch process: losses, step-1 gradients (clipped), final state, each parameter's
    AdamW slack summed over the steps."""
    return user_loop(build(0), lambda s: [{"input_ids": rows, "labels": rows} for rows in batch(s).chunk(DP)])


def user_loop(model: torch.nn.Module, micro_steps: Any, steps: int = STEPS, lr: float = LR, clip: float = CLIP
              ) -> dict:
    """``steps`` AdamW steps (``lr``) of ``model`` in one process, each over ``micro_steps(step)`` (the model's keyword
    arguments of each micro-step, each 1 / their number of the step), clipped at ``clip``: the losses, the step-1
    gradients, the final state and each parameter's AdamW slack for gradients off by ``GRAD_RTOL``, summed."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    names = {id(q): n for n, q in model.named_parameters()}
    slack = {n: torch.zeros_like(q) for n, q in model.named_parameters()}
    losses, grads = [], {}
    for s in range(steps):
        total, parts = 0.0, micro_steps(s)
        for kwargs in parts:
            loss = model(**kwargs).loss
            (loss / len(parts)).backward()
            total += loss.item() / len(parts)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        grads = grads or {n: q.grad.detach().clone() for n, q in model.named_parameters()}
        with torch.no_grad():
            for q in model.parameters():
                slack[names[id(q)]] += adam_slack(opt, q, s + 1, GRAD_RTOL * q.grad.abs().max())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "grads": grads, "slack": slack,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _whole_grads(p, model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient whole (collective: every rank calls it at the same point)."""
    from torch.distributed.tensor import DTensor

    experts = p.layout.experts
    out = {}
    for n, q in model.named_parameters():
        g = q.grad if q.grad is not None else torch.zeros_like(q)
        if experts is not None and id(q) in experts._ids:
            g = experts._to_dtensor(g, q)  # the global (E, ...) tensor over ep (and FSDP's expert shards)
        out[n.replace("_checkpoint_wrapped_module.", "")] = (g.full_tensor() if isinstance(g, DTensor) else g).clone()
    return out


def _train(root: str, name: str, parallel: dict, rank: int) -> dict:
    import plait

    p = plait.Plait(parallel=parallel, run={"dir": f"{root}/{name}"}, optim={"grad_clip": CLIP},
                    train={"global_batch_size": GLOBAL, "micro_batch_size": GLOBAL // DP, "seed": 0},
                    observe={"progress": False, "trackers": []})
    model, opt = p.setup(build(rank), optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=LR))
    assert p.topology.dp == DP
    grads: dict = {}

    def first(*_args) -> None:  # after clipping, before the update (every rank steps the dense optimizer)
        if not grads:
            grads.update(_whole_grads(p, model))
    getattr(opt, "optimizer", opt).register_step_pre_hook(first)
    losses = []
    for s in range(STEPS):
        rows = batch(s).chunk(DP)[p.dp_rank]
        p.backward(model(input_ids=rows, labels=rows).loss)
        losses.append(p.step().global_loss)
    state = {k: v.detach().clone() for k, v in p.full_state_dict(model).items()}
    p.close()
    return {"losses": losses, "grads": grads, "state": state}


def _group(rank: int, world: int, root: str) -> dict:
    return {name: _train(root, name, parallel, rank) for name, parallel in LAYOUTS.items()}


@pytest.fixture(scope="module")
def eight(tmp_path_factory) -> list[dict]:
    return run_ranks(_group, WORLD, str(tmp_path_factory.mktemp("hfcompose")), timeout=900)


@pytest.fixture(scope="module")
def ref() -> dict:
    return reference()


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_hf_moe_composes_with_every_dimension(eight, ref, name) -> None:
    for rank, r in enumerate(eight):
        run = r[name]
        assert run["losses"] == pytest.approx(ref["losses"], abs=LOSS_ATOL), (name, rank, run["losses"])
        assert run["grads"].keys() == ref["grads"].keys(), (name, sorted(set(run["grads"]) ^ set(ref["grads"])))
        for k, g in ref["grads"].items():
            assert (run["grads"][k] - g).abs().max() <= GRAD_RTOL * g.abs().max(), (name, rank, k)
        assert beyond_slack(run["state"], ref["state"], ref["slack"]) < PARAM_ATOL, (name, rank)
    moved = max(float((ref["state"][k] - v).abs().max()) for k, v in build(0).state_dict().items())
    assert moved > 30 * PARAM_ATOL  # training moved the weights far beyond the tolerance
