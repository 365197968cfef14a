"""``train.precision = "fp8"`` with every dimension: tensor and sequence parallelism, the three pipeline schedules,
expert parallelism, context parallelism (ring and all-to-all) and activation offload, against the user's own
torchao loop.

One spawned group of 2 ranks trains plait's GPT (4 blocks, d_model 64: every Linear but the head multiplies in
float8) for 3 AdamW steps (lr 3e-3, no clipping) through ``plait.Plait.forward_backward`` in each layout: tp=2;
tp=2 with sequence parallelism, without and with activation offload; pp=2 with 1F1B, interleaved 1F1B and ZBV over 2
micro-batches; ep=2 (an MoE GPT: 4 experts in every block, ep inside dp=2); cp=2 ring and all-to-all; activation
offload at dp=2.

The reference is the user's loop in one process: torchao's ``convert_to_float8_training`` on the same Linears, the
model under ``torch.autocast(bfloat16)``, AdamW, over the micro-batches float8 sees in that layout as accumulation
micro-steps (dynamic float8 scales are per tensor and micro-batch: the whole global batch under tp, sp and cp, the
pipeline's two micro-batches, each data-parallel rank's half). Compared: the logged loss of every step, every
gradient at step 1 (tensor parallelism's DTensors gathered, a pipeline rank's stage's, the experts gathered over
ep), every parameter after 3 steps.

Tolerances, by what each layout changes in the arithmetic:

- activation offload: bit for bit (the saved tensors come back unchanged); sp with offload bit for bit equal to sp
  without (torchao's float8 tensors offloaded by their inner tensors). Losses within 2e-5: the logged loss is
  averaged over the ranks in float32.
- pipelines: the same float8 casts of the same micro-batches; only the tied embedding/head weight, whose uses sit on
  two stages, has its two gradients added in another order. Step 1: every gradient bit for bit but that one
  (float32 rounding: relative 1e-6), losses within 2e-5; the parameters after 3 steps as below (a rounding in the
  tied weight can move a later float8 cast).
- everything else: within float8's own rounding. The layout casts the same tensors to float8, but either with
  other scales (cp: each rank's Linears scale their own sequence shard) or from inputs summed in another order (tp's
  row-parallel partial outputs added over tp in bf16; the experts' outputs combined over ep), where one rounding can
  move an element across a float8 rounding boundary: one float8_e4m3 step (1/8 relative), a float8_e5m2 step for a
  gradient (1/4). Such a result is the exact one plus another draw of float8's rounding error E', where the
  reference is the exact one plus E; bf16 rounds 32 times finer than float8_e4m3, so the same loop in bf16 measures
  |E| (``||X_ref - X_bf16||`` per tensor) and ``||X - X_ref|| <= |E'| + |E|``. Allowed: 3 x ``||X_ref - X_bf16||``
  per gradient and parameter tensor (a draw up to twice the measured one; AdamW's sign-like first steps amplify
  both alike where a gradient is near 0) plus float32's 1e-6 relative, and per loss 3 x the largest step's
  fp8-to-bf16 difference plus 2e-5. Observed parameter ratios (torch 2.13 CPU, torchao 0.18): <= 2.8 under tp and
  sp (a LayerNorm weight), <= 2.6 under cp, 0.1 under ep. The batches repeat a pattern of 8 tokens along each row
  (``_batches``): on random tokens the gradients are mostly noise, which float8 rounds by as much as their own size,
  and the parameters after 3 steps then measure nothing but that noise (cp's were 4.9x their fp8-to-bf16 distance).
  A lost or doubled gradient, or a scale taken over a shard where the plan promises the whole tensor's, moves the
  results by the gradients themselves, beyond these bounds (the bias gradients torchao's styles would round to
  float8_e5m2, before plait kept them in high precision, were 18x the bound).

Checked besides: under tp and sp, attention's q, k, v and proj and the MLP's fc read float8 inputs (torchao's
float8 styles; q, k and v one cast, gathered under sp), which plain DTensor styles would leave in high precision;
which Linears convert (24 in the dense GPT; in the MoE GPT the 16 of attention, its routers and experts not).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import run_ranks
from references import MP_LOSS_ATOL

pytest.importorskip("torchao.float8")

SEQ, GLOBAL, STEPS, LR = 32, 8, 3, 3e-3
MOE = {"num_experts": 4, "top_k": 2}
FP8_FACTOR, F32_REL = 3.0, 1e-6
TIED = ("tok_emb.weight", "head.weight")

# name: (parallel, train, MoE model, the reference's accumulation micro-steps per step, how it is held)
LAYOUTS: dict[str, tuple[dict, dict, bool, int, str]] = {
    "tp": ({"tp": 2}, {}, False, 1, "float8"),
    "sp": ({"tp": 2, "sequence_parallel": True}, {}, False, 1, "float8"),
    "sp-offload": ({"tp": 2, "sequence_parallel": True}, {"activation_offload": True}, False, 1, "as sp"),
    "1f1b": ({"pp": 2, "pp_schedule": "1f1b", "microbatches": 2}, {}, False, 2, "pipeline"),
    "interleaved": ({"pp": 2, "pp_schedule": "interleaved", "microbatches": 2}, {}, False, 2, "pipeline"),
    "zbv": ({"pp": 2, "pp_schedule": "zbv", "microbatches": 2}, {}, False, 2, "pipeline"),
    "ep": ({"ep": 2}, {}, True, 2, "float8"),
    "cp-ring": ({"cp": 2, "cp_impl": "ring"}, {}, False, 1, "float8"),
    "cp-alltoall": ({"cp": 2, "cp_impl": "alltoall"}, {}, False, 1, "float8"),
    "offload": ({}, {"activation_offload": True}, False, 2, "exact"),
}


def _gpt(moe: bool) -> torch.nn.Module:
    from plait.config import ModelConfig, MoeConfig
    from plait.models.tiny import seeded_gpt

    cfg = ModelConfig(n_layer=4, d_model=64, n_head=4, seq_len=SEQ, vocab_size=256, dropout=0.0)
    return seeded_gpt(cfg, seed=1, moe=MoeConfig(**MOE) if moe else None)


def _batches() -> list[torch.Tensor]:
    """A pattern of 8 tokens repeated along each row, moved on by one token each step: gradients the model can follow
    (on random tokens they are mostly noise, which float8 rounds by as much as their own size)."""
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 256, (GLOBAL, 8), generator=g).repeat(1, SEQ // 8 + 1)[:, :SEQ]
    return [base.roll(-i, dims=1) for i in range(STEPS)]


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)


def _reference(micro: int, moe: bool) -> dict[str, Any]:
    """The user's loop: float8 Linears under bf16 autocast, ``micro`` accumulation micro-steps per step. Beside it the
    same loop in bf16 measures float8's rounding: of the losses (``bf16_losses``), of the first gradients
    (``grad_err``) and of the parameters after the last step (``bf16_state``)."""
    from torchao.float8 import convert_to_float8_training

    from plait.parallel.float8 import eligible

    model, bf16 = _gpt(moe), _gpt(moe)
    names = set(eligible(model))
    convert_to_float8_training(model, module_filter_fn=lambda _m, fqn: fqn in names)
    opt, bf16_opt = _adamw(model), _adamw(bf16)
    out: dict[str, Any] = {"losses": [], "bf16_losses": []}
    for x in _batches():
        out["losses"].append(_accumulate(model, x, micro))
        out["bf16_losses"].append(_accumulate(bf16, x, micro))
        other = dict(bf16.named_parameters())
        with torch.no_grad():
            out.setdefault("grads", {n: q.grad.clone() for n, q in model.named_parameters()})
            out.setdefault("grad_err", {n: q.grad - other[n].grad for n, q in model.named_parameters()})
        for o in (opt, bf16_opt):
            o.step()
            o.zero_grad()
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out["bf16_state"] = {k: v.detach().clone() for k, v in bf16.state_dict().items()}
    return out


def _accumulate(model: torch.nn.Module, x: torch.Tensor, micro: int) -> float:
    """One step's gradients over ``micro`` accumulation micro-steps of ``x``; returns the step's loss."""
    from plait.nn.moe import moe_layers

    for layer in moe_layers(model):
        layer.grad_scale = 1.0 / micro  # its balancing loss weighs like the main loss of a micro-step
    total = 0.0
    for part in x.chunk(micro):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(part)
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), part[:, 1:].flatten()) / micro
        loss.backward()
        total += loss.item()
    return total


def _float8_inputs(model: torch.nn.Module) -> dict[str, str]:
    """Record the kind of tensor block 0's attention and MLP Linears are handed by their styles."""
    seen: dict[str, str] = {}
    block = model.blocks[0]
    for name in ("attn.q", "attn.proj", "mlp.fc"):
        def hook(_m: Any, args: tuple, name: str = name) -> None:
            local = getattr(args[0], "_local_tensor", args[0])
            seen.setdefault(name, type(local).__name__)
        block.get_submodule(name).register_forward_pre_hook(hook)
    return seen


def _train(rank: int, root: str, name: str) -> dict[str, Any]:
    import torch.distributed as dist

    import plait
    from plait.parallel.units import is_expert

    parallel, train, moe, _, _ = LAYOUTS[name]
    dp = 2 // (parallel.get("tp", 1) * parallel.get("pp", 1) * parallel.get("cp", 1))
    p = plait.Plait(parallel=parallel, moe=MOE if moe else {},
                    train={"global_batch_size": GLOBAL, "micro_batch_size": GLOBAL // dp, "precision": "fp8", **train},
                    optim={"grad_clip": 0.0, "lr": LR, "warmup_steps": 0, "min_lr_ratio": 1.0},
                    run={"dir": f"{root}/{name}"}, observe={"progress": False, "trackers": []})
    model, _ = p.setup(_gpt(moe), optimizer=_adamw, loss_fn="causal_lm")
    inputs = _float8_inputs(model) if "tp" in parallel else {}
    grads: dict[str, torch.Tensor] = {}
    step = p.layout._step

    def first_grads() -> None:  # the reduced gradients the first update reads
        if not grads:
            grads.update({n: (q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad).detach().clone()
                          for n, q in model.named_parameters() if q.grad is not None})
        step()

    p.layout._step = first_grads
    losses = []
    for x in _batches():
        mine = x.chunk(dp)[p.dp_rank]
        p.forward_backward(model, {"input_ids": mine, "labels": mine})
        losses.append(p.step(log=True).global_loss)
    params = dict(model.named_parameters())
    for n in [n for n in grads if is_expert(params[n])]:  # this rank's experts: gathered into (E, ...) over ep
        parts = [torch.empty_like(grads[n]) for _ in range(p.topology.ep)]
        dist.all_gather(parts, grads[n].contiguous(), group=p.topology.ep_group)
        grads[n] = torch.cat(parts)
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in p.full_state_dict(model).items()}
    linears = {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    p.close()
    return {"losses": losses, "grads": grads, "state": state, "linears": linears, "inputs": inputs}


def _group(rank: int, world: int, root: str) -> dict[str, Any]:
    return {name: _train(rank, root, name) for name in LAYOUTS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_group, 2, str(tmp_path_factory.mktemp("fp8")), timeout=900)


@pytest.fixture(scope="module")
def references() -> dict[tuple[int, bool], dict[str, Any]]:
    return {(micro, moe): _reference(micro, moe) for micro, moe in {(m, e) for _, _, e, m, _ in LAYOUTS.values()}}


def _norm(t: torch.Tensor) -> float:
    return float(t.double().norm())


def _within_float8(name: str, got: dict, ref: dict, err: dict) -> None:
    """Every tensor of ``got`` within FP8_FACTOR x float8's own rounding of it (``err``: the reference's distance
    from the same loop in bf16; module docstring)."""
    for k, want in ref.items():
        bound = FP8_FACTOR * _norm(err[k]) + F32_REL * _norm(want)
        assert _norm(got[k] - want) <= bound, (name, k, _norm(got[k] - want), bound)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_float8_composes(name: str, runs: list[dict[str, Any]], references: dict) -> None:
    parallel, _, moe, micro, held = LAYOUTS[name]
    ref = references[(micro, moe)]
    grads: dict[str, torch.Tensor] = {}
    for rank in runs:  # a pipeline rank holds its stage's gradients: every parameter's on some rank
        grads.update(rank[name]["grads"])
    assert grads.keys() == ref["grads"].keys(), (name, sorted(grads.keys() ^ ref["grads"].keys()))
    for rank in runs:
        run = rank[name]
        losses, state = run["losses"], run["state"]
        assert state.keys() == ref["state"].keys(), name
        if held == "exact":
            assert max(abs(a - b) for a, b in zip(losses, ref["losses"], strict=True)) < MP_LOSS_ATOL, (name, losses)
            assert all(torch.equal(run["grads"][k], g) for k, g in ref["grads"].items()), name
            assert all(torch.equal(state[k], v) for k, v in ref["state"].items()), name
            continue
        if held == "as sp":  # offload returns what sp saved, bit for bit
            sp = rank["sp"]
            assert losses == sp["losses"], (losses, sp["losses"])
            assert all(torch.equal(run["grads"][k], g) for k, g in sp["grads"].items()), name
            assert all(torch.equal(state[k], v) for k, v in sp["state"].items()), name
            continue
        if held == "pipeline":
            assert abs(losses[0] - ref["losses"][0]) < MP_LOSS_ATOL, (name, losses)
            for k, g in run["grads"].items():
                if k in TIED:
                    assert _norm(g - ref["grads"][k]) <= F32_REL * _norm(ref["grads"][k]), (name, k)
                else:
                    assert torch.equal(g, ref["grads"][k]), (name, k)
        else:
            _within_float8(name, run["grads"], ref["grads"], ref["grad_err"])
        loss_bound = FP8_FACTOR * max(abs(a - b) for a, b in zip(ref["losses"], ref["bf16_losses"], strict=True))
        for got, want in zip(losses, ref["losses"], strict=True):
            assert abs(got - want) <= loss_bound + MP_LOSS_ATOL, (name, losses, ref["losses"], loss_bound)
        _within_float8(name, state, ref["state"], {k: v - ref["bf16_state"][k] for k, v in ref["state"].items()})
    run = runs[0][name]
    converted = sum(kind == "Float8Linear" for kind in run["linears"].values())
    if moe:  # attention's Linears; the routers stay Linears, the experts are not Linears
        assert converted == 4 * 4 and run["linears"]["blocks.0.mlp.router"] == "Linear", run["linears"]
    elif "pp" not in parallel:  # a pipeline rank holds its stages' Linears only
        assert converted == 6 * 4 and run["linears"]["head"] == "Linear", run["linears"]
    if "tp" in parallel:  # torchao's float8 styles hand their Linears float8 inputs
        assert run["inputs"] == dict.fromkeys(("attn.q", "attn.proj", "mlp.fc"), "Float8TrainingTensor"), run["inputs"]


def test_float8_refuses_only_the_parameter_server() -> None:
    from plait.parallel.matrix import refusal

    for other in ("tp", "sp", "1f1b", "interleaved", "zbv", "ep", "cp_ring", "cp_alltoall", "offload"):
        assert refusal(("fp8", other)) is None, other
    assert "parallel.mode=ps" in (refusal(("fp8", "ps")) or ""), refusal(("fp8", "ps"))
