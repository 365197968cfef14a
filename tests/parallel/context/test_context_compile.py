"""Context parallelism under ``train.compile`` equals one eager process on the whole sequence.

One spawned group of 2 ranks (cp=2), six runs in which each pair of ring or all-to-all attention, compile unit
(``train.compile=true``: the whole model, and with the loss under ``p.forward_backward``, in one region; or
"blocks"), micro-step (``p.forward_backward``, or the user's own ``model(...)`` and ``p.backward(loss)``, cut in the
model's forward) and model (plait's GPT at sequence 256, the test_context batches; a Hugging Face Llama with
grouped-query attention at 128, the test_context_hf batches) occurs:

    gpt    ring      forward_backward    whole model        gpt    alltoall  forward_backward    whole model
    gpt    ring      user loop (logits)  blocks             gpt    alltoall  user loop (logits)  blocks
    llama  ring      user loop (labels)  whole model        llama  alltoall  forward_backward    blocks

``backend="aot_eager"`` (dynamo and AOTAutograd, no C++ compiler). Each run trains 3 AdamW steps (clip 1.0) and is
compared with plain eager PyTorch in one process over the whole batch: the logged loss of every step, every
parameter's gradient at step 1 and every parameter after 3 steps. float32; the tolerances of test_context (losses
2e-5, gradients 1e-7, parameters 3e-5 beyond each element's AdamW slack, ``references.adam_slack``): the cp attention
merges blocks by their log-sum-exp and AOTAutograd's decompositions round as eager does up to summation order.
Observed: losses 1.2e-6, gradients 1.2e-8, parameters 4.1e-7 beyond the slack (2.5e-5 without it).

What dynamo made of each (``torch._dynamo.utils.counters``): the all-to-all attention is traced into the blocks'
graphs (dynamo rewrites its c10d all-to-all into a functional collective, forward and backward): no graph break. The
ring's batched point-to-point transfers are not traceable (dynamo refuses P2P), so the ring attention is
``torch.compiler.disable``d: the only graph breaks are there, one per attention layer, each block two graphs around
its attention, which runs eagerly between them.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from helpers import run_ranks
from references import MP_LOSS_ATOL, MP_PARAM_ATOL, adam_slack, beyond_slack

from . import test_context as gpt_case
from . import test_context_hf as hf_case

CLIP, GRAD_ATOL = gpt_case.CLIP, gpt_case.GRAD_ATOL
# (model, cp_impl, the micro-step: "fb" p.forward_backward or "user" the user's loop, train.compile)
RUNS = [("gpt", "ring", "fb", True), ("gpt", "ring", "user", "blocks"), ("gpt", "alltoall", "fb", True),
        ("gpt", "alltoall", "user", "blocks"), ("llama", "ring", "user", True), ("llama", "alltoall", "fb", "blocks")]


def _case(kind: str):
    return gpt_case if kind == "gpt" else hf_case


def _model(kind: str) -> torch.nn.Module:
    return gpt_case.gpt() if kind == "gpt" else hf_case.llama()


def _logits_loss(model, batch: dict, reduction: str = "mean") -> torch.Tensor:
    """The user's loss from the logits (plait's GPT): cross-entropy over the real next tokens."""
    target = torch.full_like(batch["labels"], -100)
    target[:, :-1] = batch["labels"][:, 1:]
    logits = model(batch["input_ids"])
    logits = getattr(logits, "logits", logits)  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100, reduction=reduction)


def reference(kind: str, slack: dict) -> tuple[list[float], dict, dict]:
    """The plain eager loop's losses, first gradients and final state; ``slack`` filled with each parameter's
    ``adam_slack`` for gradients off by ``GRAD_ATOL``, summed over the steps."""
    model, losses, first = _model(kind), [], {}
    opt = _case(kind).adamw(model)
    for step, batch in enumerate(_case(kind).batches(), 1):
        loss = _logits_loss(model, batch)
        loss.backward()
        first = first or {n: q.grad.detach().clone() for n, q in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        with torch.no_grad():
            for n, q in model.named_parameters():
                slack[n] = slack.get(n, 0.0) + adam_slack(opt, q, step, GRAD_ATOL)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, first, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(run_dir: str, kind: str, impl: str, how: str, compile_: bool | str) -> dict:
    import torch._dynamo.utils as dynamo

    import plait

    case = _case(kind)
    p = plait.Plait(parallel={"cp": 2, "cp_impl": impl}, optim={"grad_clip": CLIP},
                    train={"global_batch_size": case.GLOBAL, "micro_batch_size": case.GLOBAL, "compile": compile_,
                           "compile_backend": "aot_eager"},
                    run={"dir": f"{run_dir}/{kind}-{impl}-{how}"}, observe={"progress": False, "trackers": []})
    model, opt = p.setup(_model(kind), optimizer=case.adamw, loss_fn="causal_lm" if how == "fb" else None)
    names = {id(q): n for n, q in model.named_parameters()}
    grads: dict = {}

    def first_grads(o, args, kwargs) -> None:
        if not grads:
            grads.update({names[id(q)]: q.grad.detach().clone() for g in o.param_groups for q in g["params"]})
    opt.register_step_pre_hook(first_grads)
    torch._dynamo.reset()  # this run's own graphs: a cached one from an earlier run would count no frame
    dynamo.counters.clear()
    losses = []
    for batch in case.batches():
        if how == "fb":
            p.forward_backward(model, batch)
        elif kind == "gpt":  # the user's loss from the logits, gathered whole
            p.backward(_logits_loss(model, batch))
        else:  # the model's own loss over labels plait shifts whole
            p.backward(model(**batch).loss)
        losses.append(p.step(log=True).global_loss)
    out = {"losses": losses, "grads": grads, "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
           "frames": dynamo.counters["frames"]["ok"], "breaks": [str(k) for k in dynamo.counters["graph_break"]],
           "whole": getattr(model, "_compiled_call_impl", None) is not None,
           "blocks": sum(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())}
    p.close()
    return out


def _group(rank: int, world: int, run_dir: str) -> list[dict]:
    return [_train(run_dir, *run) for run in RUNS]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_context_parallel_compiled_equals_one_eager_process(tmp_path: Path) -> None:
    ranks = run_ranks(_group, 2, str(tmp_path), timeout=900)
    refs: dict = {}
    for i, (kind, impl, how, compile_) in enumerate(RUNS):
        if kind not in refs:
            slack: dict = {}
            refs[kind] = (*reference(kind, slack), slack)
        ref_losses, ref_grads, ref_state, slack = refs[kind]
        what = f"{kind} {impl} {how} compile={compile_}"
        for run in (r[i] for r in ranks):
            assert run["frames"] > 0, what  # dynamo compiled this run's code
            assert run["whole"] == (compile_ is True), what  # true: the whole model (cp does not need blocks)
            assert run["blocks"] == (1 if compile_ is True else 2), what  # "blocks": each of the 2 decoder blocks
            if impl == "alltoall":  # traced into the graphs
                assert run["breaks"] == [], (what, run["breaks"])
            else:  # the ring attention alone runs eager between the graphs
                assert run["breaks"] and all("ring_attention" in b for b in run["breaks"]), (what, run["breaks"])
            assert max(abs(a - b) for a, b in zip(run["losses"], ref_losses, strict=True)) < MP_LOSS_ATOL, what
            assert _max_diff(run["grads"], ref_grads) < GRAD_ATOL, what
            assert beyond_slack(run["state"], ref_state, slack) < MP_PARAM_ATOL, what
