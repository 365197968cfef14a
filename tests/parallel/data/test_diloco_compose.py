"""DiLoCo around the layout inside each replica: 2 replicas (the ``dp_replicate`` axis) of 2 ranks each on 4 gloo
ranks, against a single-process DiLoCo written in plain PyTorch that simulates the 2 replicas, each doing its inner
layout's maths (its share of every global batch, its own AdamW and clip), and torch's Nesterov ``SGD`` (0.7, 0.9)
outside.

Layouts, one spawned group: inside each replica ZeRO-1, ZeRO-2 and ZeRO-3 (FSDP2) over its 2 data-parallel ranks
(``parallel.dp_shard=2``: under DiLoCo the replicas are HSDP's replicate axis, so this is the matrix's ``hsdp`` and
``zero3``), tensor parallelism (tp=2) without and with sequence parallelism, a pipeline of 2 stages under 1F1B, the
interleaved and the zero-bubble V schedules (plait's GPT, 4 layers, embedding and head tied), and expert parallelism
(ep=2: plait's MoE GPT, 4 experts, Switch auxiliary loss). H = 2 for 4 steps (two synchronisations), AdamW (lr 1e-3,
weight decay 0.1), clip 1.0, float32.

Compared: the loss of every step (the mean of the replicas'), every gradient at step 1 (the inner layout's own
reduction over its replica: gathered whole where sharded, a pipeline rank its stage's), the whole model after step 3
(``p.full_state_dict`` one step into the second period: the first synchronisation's weights, not the replica's own)
and after step 4, and, for the layouts whose entries are DTensors (FSDP2, tensor parallelism, experts) or stages, a
checkpoint saved at step 3 and loaded after step 4: the model holds the first synchronisation's weights again and the
outer momentum is the one saved; read back as one process (DCP's ``dcp_to_torch_save``) the checkpoint holds them as
whole tensors, the outer momentum equal to torch's SGD momentum buffer.

Tolerances: the inner layouts sum in another order than one process (reductions over the replica's ranks, pipeline
micro-batches, vocabulary-parallel softmax): losses within ``MP_LOSS_ATOL``, step-1 gradients within 1e-7 (measured
<= 3e-8), parameters within ``MP_PARAM_ATOL`` beyond their slack: each replica's AdamW moves an element whose
gradient is off by 1e-7 by up to ``references.adam_slack`` (near a zero gradient its slope is lr / eps), and the outer
Nesterov step is a linear map with positive coefficients of the replicas' mean, so the slack is carried through it
(0.7 x (1 + 0.9) of the first period's, and so on; the momentum buffer's the same way). Replicas after a
synchronisation: bit-identical.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import run_ranks
from references import MP_LOSS_ATOL, MP_PARAM_ATOL, adam_slack, beyond_slack

from plait.config import MoeConfig
from plait.models.tiny import seeded_gpt, tiny_config, token_batches

GLOBAL, SEQ, VOCAB, STEPS, H, LR, CLIP, GRAD_ATOL = 8, 16, 256, 4, 2, 1e-3, 1.0, 1e-7
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
PIPE = {"pp": 2, "microbatches": 2, "pp_balance": "count"}
# name -> (the [parallel] section inside DiLoCo's, the model, whether a checkpoint round trip is checked)
LAYOUTS: dict[str, tuple[dict, str, bool]] = {
    "zero1": ({"zero": 1, "dp_shard": 2}, "gpt", False),
    "zero2": ({"zero": 2, "dp_shard": 2}, "gpt", False),
    "zero3": ({"zero": 3, "dp_shard": 2}, "gpt", True),
    "tp": ({"tp": 2}, "gpt", True),
    "sp": ({"tp": 2, "sequence_parallel": True}, "gpt", False),
    "1f1b": ({**PIPE, "pp_schedule": "1f1b"}, "gpt", True),
    "interleaved": ({**PIPE, "pp_schedule": "interleaved"}, "gpt", False),
    "zbv": ({**PIPE, "pp_schedule": "zbv"}, "gpt", False),
    "ep": ({"ep": 2}, "moe", True),
}


def build(kind: str) -> torch.nn.Module:
    if kind == "moe":
        return seeded_gpt(tiny_config(n_layer=2, d_model=32, n_head=4, seq_len=SEQ, vocab_size=VOCAB),
                          moe=MoeConfig(num_experts=4, every=2))
    return seeded_gpt(tiny_config(n_layer=4, d_model=32, n_head=4, seq_len=SEQ, vocab_size=VOCAB))


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return token_batches(STEPS, GLOBAL, seq_len=SEQ, vocab_size=VOCAB, seed=11, shifted=True)


def ce(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)  # (B, T, V)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))


# -- the 4 ranks --------------------------------------------------------------------------------------------
def _grads(p, model, opt) -> dict[str, torch.Tensor]:
    """This rank's step-1 gradients, whole: ZeRO's reduced chunks gathered over its group, DTensors gathered, the
    experts gathered over ep (collectives inside the replica, in the same order on its ranks)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from plait.parallel.units import is_expert

    names = {id(q): n for n, q in model.named_parameters()}
    out = {}
    zero = p.layout.optimizer
    if hasattr(zero, "buckets"):
        for b in zero.buckets:
            parts = [torch.empty_like(b.grad_shard) for _ in range(zero.world)]
            dist.all_gather(parts, b.grad_shard, group=zero.group)
            flat = torch.cat(parts)
            for q, off in zip(b.params, b.offsets, strict=True):
                out[names[id(q)]] = flat[off:off + q.numel()].view(q.shape).clone()
    for q in (q for g in getattr(opt, "optimizer", opt).param_groups for q in g["params"]):
        if id(q) not in names or q.grad is None:
            continue
        g = q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad
        if is_expert(q):
            parts = [torch.empty_like(g) for _ in range(p.layout.topo.ep)]
            dist.all_gather(parts, g.contiguous(), group=p.layout.topo.ep_group)
            g = torch.cat(parts)
        out[names[id(q)]] = g.detach().clone()
    return out


def _train(root: str, name: str) -> dict:
    import plait

    parallel, kind, roundtrip = LAYOUTS[name]
    pp = parallel.get("pp", 1) > 1
    p = plait.Plait(parallel={**parallel, "sync": "diloco", "diloco_inner_steps": H}, optim={"grad_clip": CLIP},
                    train={"global_batch_size": GLOBAL, "micro_batch_size": GLOBAL * parallel.get("tp", 1)
                           * parallel.get("pp", 1) // 4},
                    moe={"num_experts": 4} if kind == "moe" else {},
                    run={"dir": f"{root}/{name}"}, observe={"progress": False, "trackers": []})
    model, opt = p.setup(build(kind), optimizer=adamw, loss_fn="causal_lm" if pp else None)
    grads: dict = {}
    seen: list[bool] = []

    def first(o, args, kwargs) -> None:
        if not seen:  # the first optimizer step
            seen.append(True)
            grads.update(_grads(p, model, opt))
    getattr(opt, "optimizer", opt).register_step_pre_hook(first)
    diloco = next(d for d in p.layout.drivers if type(d).__name__ == "DiLoCo")
    out: dict = {"describe": p.layout.describe(), "policy_ranks": p.layout.policy.ranks, "losses": []}
    share = GLOBAL // p.dp
    for step, (x, y) in enumerate(batches(), start=1):
        mine = (x[p.dp_rank * share:(p.dp_rank + 1) * share], y[p.dp_rank * share:(p.dp_rank + 1) * share])
        if pp or "tp" in parallel:
            p.forward_backward(model, mine, loss_fn="causal_lm")
        else:  # the user's own forward and loss
            p.backward(ce(model, *mine))
        out["losses"].append(p.step().global_loss)
        if step == 3:
            out["state3"] = p.full_state_dict(model)
            if roundtrip:
                p.save(f"{root}/{name}/ckpt", model=model, optimizer=opt)
                out["momentum3"] = diloco._momentum.clone()
    out["state4"], out["grads"] = p.full_state_dict(model), grads
    if roundtrip:
        p.load(f"{root}/{name}/ckpt", model=model, optimizer=opt)
        out["loaded"] = p.full_state_dict(model)
        out["momentum_loaded"] = torch.equal(diloco._momentum, out.pop("momentum3"))
    p.close()
    return out


def _group(rank: int, world: int, root: str) -> dict[str, dict]:
    return {name: _train(root, name) for name in LAYOUTS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("diloco_compose")
    return root, run_ranks(_group, 4, str(root), timeout=900)


# -- one process ----------------------------------------------------------------------------------------------
def reference(kind: str) -> dict:
    """2 replicas, each its own copy, AdamW and clip, on its half of every global batch as the 2 micro-steps of its
    ranks (MoE: each micro-step's auxiliary loss at 1/2, as each rank's is averaged over the replica); torch's
    Nesterov SGD on the replicas' mean every H steps. Returns the mean loss per step, each replica's step-1 gradients,
    the outer weights and momentum after each synchronisation, and each element's slack (module docstring)."""
    from plait.nn.moe import moe_layers

    base = build(kind)
    replicas = [copy.deepcopy(base) for _ in range(2)]
    inner = [adamw(m) for m in replicas]
    outer = copy.deepcopy(base)
    outer_opt = torch.optim.SGD(outer.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    for m in replicas:
        for layer in moe_layers(m):
            layer.grad_scale = 0.5
    out: dict = {"losses": [], "grads": [], "synced": {}, "momentum": {}, "slack": {}, "momentum_slack": {}}
    period = [{n: torch.zeros_like(q) for n, q in base.named_parameters()} for _ in replicas]  # inner slack
    slack_anchor = {n: torch.zeros_like(q) for n, q in base.named_parameters()}
    slack_momentum = {n: torch.zeros_like(q) for n, q in base.named_parameters()}
    named = dict(base.named_parameters())  # each state-dict entry's parameter (the tied head's is the embedding)
    entries = {k: n for k, v in base.state_dict(keep_vars=True).items() for n, q in named.items() if v is q}
    for step, (x, y) in enumerate(batches(), start=1):
        total = 0.0
        for r, (m, opt) in enumerate(zip(replicas, inner, strict=True)):
            for i in (2 * r, 2 * r + 1):  # the replica's 2 micro-steps of 2 sequences
                loss = ce(m, x[2 * i:2 * i + 2], y[2 * i:2 * i + 2]) / 2
                loss.backward()
                total += loss.item() / 2
            torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
            if step == 1:
                out["grads"].append({n: q.grad.clone() for n, q in m.named_parameters()})
            for n, q in m.named_parameters():
                period[r][n] += adam_slack(opt, q, step, GRAD_ATOL)
            opt.step()
            opt.zero_grad()
        out["losses"].append(total)
        if step % H:
            continue
        with torch.no_grad():
            for n, q in outer.named_parameters():
                q.grad = q - torch.stack([dict(m.named_parameters())[n] for m in replicas]).mean(0)
                e = sum(s[n] for s in period) / len(period)  # the mean's slack, carried as the update carries it
                slack_momentum[n] = OUTER_MOMENTUM * slack_momentum[n] + e
                slack_anchor[n] += OUTER_LR * (e + OUTER_MOMENTUM * slack_momentum[n])
                for s in period:  # the replicas restart from the outer weights: the next deltas' slack is
                    s[n].zero_()  # their inner steps' alone (the weights' own is common to start and end)
            outer_opt.step()
            for m in replicas:
                m.load_state_dict(outer.state_dict())
        out["synced"][step] = {k: v.clone() for k, v in outer.state_dict().items()}
        out["momentum"][step] = {n: outer_opt.state[q]["momentum_buffer"].clone() for n, q in outer.named_parameters()}
        out["slack"][step] = {k: slack_anchor[n].clone() for k, n in entries.items()}  # by state-dict entry
        out["momentum_slack"][step] = {n: v.clone() for n, v in slack_momentum.items()}
    return out


def test_diloco_composes_with_every_inner_layout(runs: tuple[Path, list[dict]]) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root, ranks = runs
    refs = {kind: reference(kind) for kind in ("gpt", "moe")}
    for name, (parallel, kind, roundtrip) in LAYOUTS.items():
        ref = refs[kind]
        got = [r[name] for r in ranks]
        # the mesh is (pp, dp_replicate, dp_shard, ep, cp, tp), outermost first: ranks 0, 1 are replica 0, except
        # under pp, where they are the first stage of replicas 0 and 1
        replica = [0, 1, 0, 1] if parallel.get("pp") else [0, 0, 1, 1]
        for rank, run in enumerate(got):
            assert run["describe"].startswith("DiLoCo (H=2) over "), (name, run["describe"])
            if "zero" in parallel:  # the policy averages over the replica's 2 ranks, not the 4
                assert run["policy_ranks"] == 2, (name, run["policy_ranks"])
            assert max(abs(a - b) for a, b in zip(run["losses"], ref["losses"], strict=True)) < MP_LOSS_ATOL, name
            want = ref["grads"][replica[rank]]
            assert run["grads"].keys() <= want.keys() and run["grads"], (name, sorted(set(run["grads"]) - set(want)))
            diff = max((run["grads"][k] - want[k]).abs().max().item() for k in run["grads"])
            assert diff < GRAD_ATOL, (name, rank, diff)
            for state, step in (("state3", 2), ("state4", 4)):  # step 3: the weights of step 2's synchronisation
                assert run[state].keys() == ref["synced"][step].keys(), name
                assert beyond_slack(run[state], ref["synced"][step], ref["slack"][step]) < MP_PARAM_ATOL, (name, state)
                assert all(torch.equal(run[state][k], got[0][state][k]) for k in run[state]), (name, state)
            if roundtrip:
                assert run["momentum_loaded"], name
                assert all(torch.equal(run["loaded"][k], run["state3"][k]) for k in run["state3"]), name
        held = set().union(*(r["grads"] for r in got))  # a pipeline rank holds its stage's: every one on some rank
        assert held == ref["grads"][0].keys(), (name, sorted(held ^ set(ref["grads"][0])))
        if roundtrip:  # the checkpoint as one process reads it: whole tensors, the first synchronisation's
            dcp_to_torch_save(root / name / "ckpt", root / f"{name}.pt")
            saved = torch.load(root / f"{name}.pt", weights_only=True)
            model = {k: v for k, v in saved["model"].items() if k in ref["synced"][2]}
            assert model.keys() == ref["synced"][2].keys(), name
            assert beyond_slack(model, ref["synced"][2], ref["slack"][2]) < MP_PARAM_ATOL, name
            momentum = saved["optim"]["diloco_outer_momentum"]
            assert momentum.keys() == ref["momentum"][2].keys(), name
            assert beyond_slack(momentum, ref["momentum"][2], ref["momentum_slack"][2]) < MP_PARAM_ATOL, name


def test_dp_shard_is_the_ranks_of_a_replica() -> None:
    """Under DiLoCo ``parallel.dp_shard`` is the data-parallel ranks of one replica for every ZeRO stage; ZeRO in
    replicas of one rank is refused with the fix."""
    from plait.config import ConfigError, from_sections
    from plait.parallel.matrix import refusal
    from plait.validate import validate

    for zero in (0, 1, 2, 3):
        cfg = validate(from_sections({"train": {"global_batch_size": 8},
                                      "parallel": {"sync": "diloco", "zero": zero, "dp_shard": 2}}), 4)
        assert cfg.parallel.dp == 4
    with pytest.raises(ConfigError, match=r"a replica here has one: set parallel.dp_shard=N"):
        validate(from_sections({"train": {"global_batch_size": 8}, "parallel": {"sync": "diloco", "zero": 1}}), 2)
    for other in ("zero1", "zero2", "zero3", "hsdp", "tp", "sp", "1f1b", "interleaved", "zbv", "ep", "replicas"):
        assert refusal(("diloco", other)) is None, other
