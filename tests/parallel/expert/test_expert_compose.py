"""Experts and hybrid sharding composed with the other dimensions: plait's GPT with an MoE block in each of its 2
blocks, trained through ``plait.Plait.forward_backward``, equals the user's own loop in one plain PyTorch process.

Layouts (two spawned groups, several layouts each; ``LAYOUTS``). On 4 ranks: ep=2 x cp=2 (ring, 2 micro-steps per
step; all-to-all under ZeRO-3, the experts then FSDP2-sharded over their cp replicas), ep=2 x tp=2 with sequence
parallelism (each tp rank's MoE layers route its own sequence shard), MoE at ep=1 under sp x cp=2 (the statistics
summed over tp and cp), ep=2 x tp=2 at ZeRO-3 without and with sp, and the zero-bubble V schedule over ZeRO-3 stages.
On 8 ranks: HSDP (2 replicas of 2-rank shard groups) x cp=2, ring and all-to-all; HSDP x ep=2 (the experts sharded
over their shard group, replicated over the replicas); zbv over HSDP; ep=2 x pp=2 x cp=2 x ZeRO-3 and ep=2 x tp=2 x sp
x cp=2 x ZeRO-3 (the 5-D ZeRO-3 x tp x pp x cp x ep layout less one dimension each, at 8 ranks); ep=2 x zbv x ZeRO-1
at dp=4 (the experts' own ZeRO optimizer under a pipeline). Two checkpoints are loaded into another layout: experts
replicated over tp (sp) and experts sharded under HSDP, each loaded at ep=4.

The model's balancing terms are all on, with large coefficients (Switch aux 0.3, DeepSeek-V3's sequence-wise 0.3,
z-loss 0.01), so a statistic taken over a shard of the sequence instead of the whole, or a misscaled auxiliary
gradient, moves the routers far beyond the tolerance (measured: without the counts summed over the shards, ep x cp's
router gradients differ by 1.2e-2; without the experts' gradients summed over tp under sp, the norm by 26%). The
reference is the user's loop: each data-parallel rank's micro-batch (each pipeline micro-batch of it, under a
pipeline: the balancing losses are per micro-batch) one accumulation micro-step of a single process on whole
sequences, then clipping at 0.5 (below the gradient norm, so the norm every layout computes is checked) and AdamW.

Compared: the logged loss and gradient norm of every step, every parameter's gradient at step 1 (after the
reduction, gathered whole: ZeRO-1/2's chunks over their group, FSDP's and tensor parallelism's DTensors with
``full_tensor``, expert slices over ep; a pipeline rank its stage's, every parameter on some rank), and every
parameter after 3 steps (``p.full_state_dict``). float32; the layouts sum in other orders (all-to-all, ring
attention's blocks, reduce-scatters), so results differ by rounding: losses within ``MP_LOSS_ATOL``, norms within a
relative 1e-5, gradients within ``GRAD_ATOL``, parameters within ``MP_PARAM_ATOL`` beyond each element's AdamW slack
(``references.adam_slack`` for gradients off by ``GRAD_ATOL``: AdamW's first update has slope lr / eps where a gradient
cancels to near zero). Measured: losses 7e-7, norms 9e-8, gradients 4.5e-8, parameters 6e-7 beyond the slack.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import run_ranks
from references import MP_LOSS_ATOL, MP_PARAM_ATOL, adam_slack, beyond_slack

V, T, GLOBAL, STEPS, LR, CLIP = 64, 16, 8, 3, 1e-3, 0.5
GRAD_ATOL = 1e-7
MODEL = ["--model.n_layer=2", "--model.d_model=32", "--model.n_head=2", f"--model.seq_len={T}",
         f"--model.vocab_size={V}", "--model.dropout=0.0", "--moe.num_experts=4", "--moe.top_k=2", "--moe.every=1",
         "--moe.aux_loss_coef=0.3", "--moe.seq_aux_loss_coef=0.3", "--moe.z_loss_coef=0.01"]


def gpt(seed: int = 0):
    from plait.config import load_config
    from plait.models.tiny import seeded_gpt

    cfg = load_config(overrides=MODEL)
    return seeded_gpt(cfg.model, seed, cfg.moe)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, V, (GLOBAL, T), generator=g) for _ in range(STEPS)]


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=False)


def reference(chunks: int, slack: dict | None = None) -> dict:
    """The user's loop in one process: each of the ``chunks`` micro-batches of a global batch one accumulation
    micro-step (the MoE layers' balancing gradients scaled like the loss), clip, AdamW. ``slack``: filled with each
    parameter's AdamW slack for gradients off by ``GRAD_ATOL``, summed over the steps."""
    from plait.nn import moe_layers

    model = gpt()
    opt = adamw(model)
    for layer in moe_layers(model):
        layer.grad_scale = 1.0 / chunks
    losses, norms, first = [], [], {}
    for step, batch in enumerate(batches(), 1):
        total = 0.0
        for x in batch.chunk(chunks):
            logits = model(x)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1))
            (loss / chunks).backward()
            total += loss.item() / chunks
        first = first or {n: q.grad.detach().clone() for n, q in model.named_parameters()}
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        if slack is not None:
            with torch.no_grad():
                for n, q in model.named_parameters():
                    slack[n] = slack.get(n, 0.0) + adam_slack(opt, q, step, GRAD_ATOL)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "norms": norms, "grads": first,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _whole_grads(p) -> dict[str, torch.Tensor]:
    """This rank's reduced gradients as whole tensors (collective: every rank of a stage in the same order): ZeRO-1/2's
    reduced chunks gathered over their group (the dense optimizer's and the experts'), FSDP's and tensor parallelism's
    DTensors with ``full_tensor``, then expert slices over ep."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from plait.parallel.units import is_expert

    named = p.layout.named_parameters()
    names = {id(q): n for n, q in named}
    out = {}
    experts = p.layout.experts
    for zero in (p.layout.policy.optimizer, experts.optimizer if experts is not None else None):
        for b in getattr(zero, "buckets", []):
            parts = [torch.empty_like(b.grad_shard) for _ in range(zero.world)]
            dist.all_gather(parts, b.grad_shard, group=zero.group)
            flat = torch.cat(parts)
            out.update({names[id(q)]: flat[off:off + q.numel()].view(q.shape).clone()
                        for q, off in zip(b.params, b.offsets, strict=True)})
    for n, q in named:
        g = out.get(n, q.grad)
        if isinstance(g, DTensor):
            g = g.full_tensor()
        if is_expert(q) and p.topology.ep > 1:
            parts = [torch.empty_like(g) for _ in range(p.topology.ep)]
            dist.all_gather(parts, g.contiguous(), group=p.topology.ep_group)
            g = torch.cat(parts)
        out[n] = g.detach().clone()
    return out


def _plait(run_dir: str, name: str, parallel: dict, accum: int = 1):
    import plait
    from plait.config import load_config

    micro = GLOBAL // parallel["dp"] // accum
    cfg = load_config(overrides=MODEL + [f"--parallel.{k}={str(v).lower() if isinstance(v, bool) else v}"
                                         for k, v in parallel.items()] + [
        f"--train.global_batch_size={GLOBAL}", f"--train.micro_batch_size={micro}", f"--run.dir={run_dir}/{name}",
        f"--optim.grad_clip={CLIP}", "--observe.progress=false", "--observe.trackers=[]"])
    return plait.Plait(cfg)


def _train(run_dir: str, name: str, parallel: dict, accum: int) -> dict:
    """Three steps of ``parallel``, each of ``accum`` micro-steps per data-parallel rank; saved where ``RESUME`` loads
    it."""
    dp = parallel["dp"]
    micro = GLOBAL // dp // accum
    p = _plait(run_dir, name, parallel, accum)
    model, _ = p.setup(gpt(), optimizer=adamw, loss_fn="causal_lm")
    assert p.topology.dp == dp
    grads: dict = {}
    finish = p.layout.finish

    def capture() -> None:  # the first step's reduced gradients, before clipping
        finish()
        if not grads:
            grads.update(_whole_grads(p))

    p.layout.finish = capture
    losses, norms = [], []
    for batch in batches():
        mine = batch[p.dp_rank * micro * accum:(p.dp_rank + 1) * micro * accum]
        for i in range(accum):
            p.forward_backward(model, mine[i * micro:(i + 1) * micro])
            info = p.step(log=True)
        losses.append(info.global_loss)
        norms.append(info.grad_norm)
    out = {"losses": losses, "norms": norms, "grads": grads,
           "state": {k: v.clone() for k, v in p.full_state_dict(model).items()}, "layout": p.layout.describe(),
           "report": p.layout.report(None, None, p.device).get("expert_parallel")}
    if any(saved == name for saved, _ in RESUME.get(p.topology.world_size, [])):
        p.save(f"{run_dir}/{name}-ckpt", model=model)
    p.close()
    return out


def _resume(run_dir: str, saved: str, parallel: dict) -> dict:
    """The checkpoint of ``saved`` loaded at ``parallel`` into other initial weights: the whole state after the load."""
    p = _plait(run_dir, f"{saved}-resumed", parallel)
    model, _ = p.setup(gpt(seed=5), optimizer=adamw, loss_fn="causal_lm")
    p.load(f"{run_dir}/{saved}-ckpt", model=model)
    out = {k: v.clone() for k, v in p.full_state_dict(model).items()}
    p.close()
    return out


# (name, parallel settings, micro-steps per optimizer step). The zero-bubble V schedule's 4 stages: the embedding
# alone, one block each, the head alone (no MoE layer on the first and the last)
ALONE = {"pp_split_embedding": True, "pp_split_head": True}
PP = {"pp": 2, "microbatches": 2}
LAYOUTS = {
    4: [("ep2-cp2-ring", {"dp": 2, "ep": 2, "cp": 2, "cp_impl": "ring"}, 2),
        ("ep2-cp2-alltoall-zero3", {"dp": 2, "ep": 2, "cp": 2, "cp_impl": "alltoall", "zero": 3}, 1),
        ("ep2-tp2-sp", {"dp": 2, "ep": 2, "tp": 2, "sequence_parallel": True}, 1),
        ("tp2-sp-cp2", {"dp": 1, "tp": 2, "sequence_parallel": True, "cp": 2}, 1),
        ("ep2-tp2-zero3", {"dp": 2, "ep": 2, "tp": 2, "zero": 3}, 1),
        ("ep2-tp2-sp-zero3", {"dp": 2, "ep": 2, "tp": 2, "sequence_parallel": True, "zero": 3}, 2),
        ("zbv-zero3", {"dp": 2, "zero": 3, "pp_schedule": "zbv", **PP, **ALONE}, 1)],
    8: [("hsdp-cp2-ring", {"dp": 4, "cp": 2, "cp_impl": "ring", "zero": 3, "dp_shard": 2}, 1),
        ("hsdp-cp2-alltoall", {"dp": 4, "cp": 2, "cp_impl": "alltoall", "zero": 3, "dp_shard": 2}, 1),
        ("hsdp-ep2", {"dp": 8, "ep": 2, "zero": 3, "dp_shard": 2}, 1),
        ("zbv-hsdp", {"dp": 4, "zero": 3, "dp_shard": 2, "pp_schedule": "zbv", **PP, **ALONE}, 1),
        ("ep2-pp2-cp2-zero3", {"dp": 2, "ep": 2, "cp": 2, "zero": 3, "pp_schedule": "1f1b", **PP}, 1),
        ("ep2-zbv-zero1", {"dp": 4, "ep": 2, "zero": 1, "pp_schedule": "zbv", **PP, **ALONE}, 1),
        ("ep2-tp2-sp-cp2-zero3", {"dp": 2, "ep": 2, "tp": 2, "sequence_parallel": True, "cp": 2, "zero": 3}, 1)],
}


# how the experts' weights (fsdp) or optimizer states (zero) are sharded over their replicas (else replicated; "none":
# a pipeline stage without an MoE layer)
SHARDED = {"ep2-cp2-alltoall-zero3": "fsdp", "hsdp-ep2": "fsdp", "ep2-pp2-cp2-zero3": "fsdp",
           "ep2-tp2-sp-cp2-zero3": "fsdp", "ep2-zbv-zero1": "zero"}


def _chunks(parallel: dict, accum: int) -> int:
    """The reference's micro-batches per step: every rank's micro-steps, each pipeline micro-batch of them."""
    return parallel["dp"] * accum * parallel.get("microbatches", 1)


# each group's checkpoints loaded elsewhere: (the layout that saved it, where it is loaded); expert weights are saved as
# global (E, ...) DTensors: here from replicated DTensors over tp (sequence parallelism) and from shards over a shard
# group replicated over the replicas (HSDP), loaded as ep=4 slices (FSDP2-sharded over the expert replicas at 8 ranks)
RESUME = {4: [("ep2-tp2-sp", {"dp": 4, "ep": 4})],
          8: [("hsdp-ep2", {"dp": 8, "ep": 4, "zero": 3})]}


def _group(rank: int, world: int, run_dir: str, layouts: list) -> list[dict]:
    trained = [_train(run_dir, *layout) for layout in layouts]
    return trained + [_resume(run_dir, saved, parallel) for saved, parallel in RESUME[world]]


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("world", [4, 8])
def test_experts_and_hybrid_sharding_compose(tmp_path: Path, world: int) -> None:
    ranks = run_ranks(_group, world, str(tmp_path), LAYOUTS[world], timeout=900)
    refs: dict = {}
    for i, (name, parallel, accum) in enumerate(LAYOUTS[world]):
        chunks = _chunks(parallel, accum)
        if chunks not in refs:
            slack: dict = {}
            refs[chunks] = (reference(chunks, slack), slack)
        ref, slack = refs[chunks]
        held = set().union(*(r[i]["grads"] for r in ranks))
        assert held == ref["grads"].keys(), (name, sorted(held ^ set(ref["grads"])))
        for run in (r[i] for r in ranks):
            assert max(abs(a - b) for a, b in zip(run["losses"], ref["losses"], strict=True)) < MP_LOSS_ATOL, name
            assert run["norms"] == pytest.approx(ref["norms"], rel=1e-5), name
            assert _max_diff(run["grads"], ref["grads"]) < GRAD_ATOL, name
            assert run["state"].keys() == ref["state"].keys(), name
            assert beyond_slack(run["state"], ref["state"], slack) < MP_PARAM_ATOL, name
        modes = {r[i]["report"]["expert_sharding"] for r in ranks} if parallel.get("ep") else set()
        assert modes <= {SHARDED.get(name, "replicated"), "none"} and modes != {"none"}, (name, modes)
    names = [name for name, _, _ in LAYOUTS[world]]
    for j, (saved, _) in enumerate(RESUME[world]):  # the weights moved exactly, on every rank
        for r in ranks:
            assert _max_diff(r[len(names) + j], r[names.index(saved)]["state"]) == 0.0, saved
