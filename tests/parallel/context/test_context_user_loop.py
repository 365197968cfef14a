"""Context parallelism in the user's own loop equals one process on the whole sequence.

The loop is the user's: ``loss = model(input_ids=x, labels=y).loss`` (or a loss they compute from
``model(input_ids=x).logits``, or ``cross_entropy(model(x), ...)`` for plait's GPT), ``p.backward(loss)``,
``p.step()``, on whole micro-batches; plait cuts them in the model's forward (``plait.parallel.context.user_forward``).

On 2 ranks (cp=2): a Llama (GQA: 4 heads, 2 key-value heads) and a Qwen2 (q/k/v biases) under ``ring`` and
``alltoall`` with labels; the Llama with a loss the user computes from the gathered logits; the Llama under
``allgather`` with a padding ``attention_mask`` (one row padded on the right, one on the left, labels ``-100`` there)
and full activation checkpointing (backward recomputes the attention layers, under the cut of their forward);
plait's GPT with the loss of ``test_context`` computed from its logits, and with its own loss (``model(x, targets)``,
under ``alltoall``, selective checkpointing). On 4 ranks
(cp=2 x dp=2): the Llama under ``ring`` with labels and under ``alltoall`` from the logits, both with
``p.num_items_in_batch`` (its value is the one at cp=1, so a loss over the whole logits takes it as it is). Labels
hold ``-100`` over uneven prompts (differing per row, per dp rank and per cp shard).

Each run trains 3 AdamW steps (clip 1.0) and is compared with plain PyTorch in one process over the whole global
batch (``F.cross_entropy`` over every real token, or the model's own loss with the mask): the loss of every step as
``StepInfo.loss`` and ``global_loss`` (the whole sequence's at a log step, not a shard's share), every parameter's
gradient at step 1 (before the optimizer) and every parameter after 3 steps; and, before training, ``model.eval()``
and ``model(...)`` on the first batch (with and without ``torch.no_grad``): the whole sequence's loss, not
differentiable, and logits (B, T, V), equal to the reference model's (the padded run: the logits of real tokens; a
padding query sees only itself under cp, nothing under one process). float32; the ring merges blocks by their
log-sum-exp and dp x cp sums gradients in another order, so results differ by rounding only. Observed: losses
9.5e-7, gradients 1.5e-8, parameters 2.5e-5 (AdamW turns rounding in gradient entries near zero into update
differences up to ~lr x their relative error), evaluated losses 4.8e-7, logits 1.5e-7. Allowed: those of
``test_context_hf`` (losses 2e-5, gradients 1e-7, parameters 3e-5), logits 1e-6.

The same groups check the refusals: a 4-D attention mask, generation (``use_cache=True``) and a sequence length that
2 x cp does not divide each give one message naming the fix.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import run_ranks
from references import MP_LOSS_ATOL, MP_PARAM_ATOL

from . import test_context as gpt_case
from .test_context_hf import CLIP, GLOBAL, GRAD_ATOL, SEQ, adamw, batches, llama

LOGITS_ATOL = 1e-6
# (model, cp_impl, how the loss is made, activation checkpointing): "labels" model(..., labels=y).loss ("mask": with
# a padding mask), "logits" the user's cross-entropy of model(x)'s logits, "targets" plait's GPT's own loss
RUNS = {2: [("llama", "ring", "labels", "none"), ("llama", "alltoall", "labels", "none"),
            ("qwen2", "ring", "labels", "none"), ("qwen2", "alltoall", "labels", "none"),
            ("llama", "ring", "logits", "none"), ("llama", "allgather", "mask", "full"),
            ("gpt", "ring", "logits", "none"), ("gpt", "alltoall", "targets", "selective")],
        4: [("llama", "ring", "labels", "none"), ("llama", "alltoall", "logits", "none")]}


def padded(batch: dict) -> dict:
    """``batch`` with a padding mask: row 0 padded on the right (40 tokens), row 1 on the left (24), labels -100."""
    ids, labels, mask = batch["input_ids"].clone(), batch["labels"].clone(), torch.ones_like(batch["input_ids"])
    mask[0, SEQ - 40:] = 0
    mask[1, :24] = 0
    ids[mask == 0], labels[mask == 0] = 0, -100
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def data(kind: str, how: str) -> list[dict]:
    if kind == "gpt":
        return gpt_case.batches()
    return [padded(b) for b in batches()] if how == "mask" else batches()


def shifted(labels: torch.Tensor) -> torch.Tensor:
    target = torch.full_like(labels, -100)
    target[:, :-1] = labels[:, 1:]
    return target


def user_loss(model, batch: dict, how: str, n=None) -> torch.Tensor:
    """The user's loss: the model's own with labels (plait's GPT: targets), or cross-entropy of the logits (sum / n
    with ``n``)."""
    if how == "targets":
        return model(batch["input_ids"], shifted(batch["labels"]))
    if how in ("labels", "mask"):
        extra = {} if n is None else {"num_items_in_batch": n}
        return model(**batch, **extra).loss
    out = model(batch["input_ids"])
    logits = getattr(out, "logits", out)  # (B, T, V): whole under cp
    target = shifted(batch["labels"])
    if n is None:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum") / n


def reference(kind: str, how: str) -> dict:
    model = gpt_case.gpt() if kind == "gpt" else llama(kind)
    model.eval()  # evaluated first, with the weights every run starts from
    with torch.no_grad():
        batch = data(kind, how)[0]
        out = model(batch["input_ids"]) if kind == "gpt" else model(**batch)
        logits = getattr(out, "logits", out)
        evaluated = gpt_case.causal_loss(model, batch).item() if kind == "gpt" else out.loss.item()
    model.train()
    if kind == "gpt":
        losses, first, state, _ = gpt_case.reference()
    else:
        opt, losses, first = adamw(model), [], {}
        for batch in data(kind, how):
            loss = user_loss(model, batch, how)
            loss.backward()
            first = first or {n: q.grad.detach().clone() for n, q in model.named_parameters()}
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        state = model.state_dict()
    return {"losses": losses, "grads": first, "state": {k: v.detach().clone() for k, v in state.items()},
            "eval": evaluated, "logits": logits}


def _train(run_dir: str, dp: int, kind: str, impl: str, how: str, checkpointing: str) -> dict:
    import plait

    global_batch = gpt_case.GLOBAL if kind == "gpt" else GLOBAL
    share = global_batch // dp
    p = plait.Plait(parallel={"cp": 2, "cp_impl": impl, "dp": dp}, optim={"grad_clip": CLIP},
                    train={"global_batch_size": global_batch, "micro_batch_size": share,
                           "activation_checkpointing": checkpointing},
                    run={"dir": f"{run_dir}/{kind}-{impl}-{how}-dp{dp}"}, observe={"progress": False, "trackers": []})
    model, opt = p.setup(gpt_case.gpt() if kind == "gpt" else llama(kind),
                         optimizer=gpt_case.adamw if kind == "gpt" else adamw)
    out = _evaluate(model, data(kind, how)[0], kind)  # before training: the reference's weights
    names = {id(q): n.replace("_checkpoint_wrapped_module.", "") for n, q in model.named_parameters()}
    grads: dict = {}

    def first_grads(o, args, kwargs) -> None:
        if not grads:
            grads.update({names[id(q)]: q.grad.detach().clone() for g in o.param_groups for q in g["params"]})
    opt.register_step_pre_hook(first_grads)
    losses, global_losses = [], []
    for batch in data(kind, how):
        mine = {k: v[p.dp_rank * share:(p.dp_rank + 1) * share] for k, v in batch.items()}
        n = p.num_items_in_batch([mine["labels"]]) if dp > 1 else None  # one loss over the global batch's tokens
        p.backward(user_loss(model, mine, how, n))
        info = p.step(log=True)
        losses.append(p.reduce(info.loss))  # over dp: info.loss is this replica's, the whole sequence's (dp=1: itself)
        global_losses.append(info.global_loss)
    out.update(losses=losses, global_losses=global_losses, grads=grads,
               state={k: v.detach().clone() for k, v in model.state_dict().items()})
    if how == "logits" and kind == "llama" and dp == 1:
        out["errors"] = _refusals(model)
    p.close()
    return out


def _evaluate(model, batch: dict, kind: str) -> dict:
    """``model.eval(); model(...)`` on the whole first batch: its loss and logits, under no_grad and without."""
    model.eval()
    ids = batch["input_ids"]
    if kind == "gpt":  # plait's GPT: its logits, or given targets (the next tokens) its own mean loss
        with torch.no_grad():
            logits, loss = model(ids), model(ids, shifted(batch["labels"]))
        graded = model(ids, shifted(batch["labels"]))
    else:
        kwargs = {k: v for k, v in batch.items() if k != "input_ids"}
        with torch.no_grad():
            out = model(ids, **kwargs)
        logits, loss = out.logits, out.loss
        graded = model(ids, **kwargs).loss
    model.train()
    return {"eval": float(loss), "eval_grad_mode": float(graded), "logits": logits,
            "differentiable": graded.requires_grad}


def _refusals(model) -> list[str]:
    from plait.config import ConfigError

    ids = torch.zeros(1, SEQ, dtype=torch.long)
    errors = []
    for call in (lambda: model(ids, attention_mask=torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool)),
                 lambda: model(ids, use_cache=True),
                 lambda: model(torch.zeros(1, SEQ - 6, dtype=torch.long))):
        try:
            call()
            errors.append("no error")
        except ConfigError as e:
            errors.append(str(e))
    return errors


def _group(rank: int, world: int, run_dir: str) -> list[dict]:
    return [_train(run_dir, world // 2, *run) for run in RUNS[world]]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _check(world: int, ranks: list[list[dict]]) -> None:
    refs: dict = {}
    for i, (kind, impl, how, checkpointing) in enumerate(RUNS[world]):
        ref = refs.setdefault((kind, how), reference(kind, how))
        what = f"{kind} {impl} {how} checkpointing={checkpointing} world={world}"
        for rank in ranks:
            run = rank[i]
            for losses in (run["losses"], run["global_losses"]):  # the whole sequence's, not a shard's share
                assert max(abs(a - b) for a, b in zip(losses, ref["losses"], strict=True)) < MP_LOSS_ATOL, what
            assert _max_diff(run["grads"], ref["grads"]) < GRAD_ATOL, what
            assert _max_diff(run["state"], ref["state"]) < MP_PARAM_ATOL, what
            assert abs(run["eval"] - ref["eval"]) < MP_LOSS_ATOL, what
            assert abs(run["eval_grad_mode"] - ref["eval"]) < MP_LOSS_ATOL, what
            assert not run["differentiable"], what  # evaluation: nothing to backpropagate
            logits = run["logits"]
            assert logits.shape == ref["logits"].shape, (what, logits.shape)  # (B, T, V): whole
            real = data(kind, how)[0].get("attention_mask", torch.ones(logits.shape[:2])).bool()
            assert (logits - ref["logits"])[real].abs().max().item() < LOGITS_ATOL, what


def test_context_parallel_user_loop_cp2(tmp_path: Path) -> None:
    ranks = run_ranks(_group, 2, str(tmp_path), timeout=600)
    _check(2, ranks)
    mask, cache, length = ranks[0][RUNS[2].index(("llama", "ring", "logits", "none"))]["errors"]
    assert "padding attention_mask of shape (batch, 128)" in mask and "(1, 1, 128, 128)" in mask, mask
    assert "use_cache=True" in cache and "parallel.cp=1" in cache, cache
    assert "2 x cp = 4 equal chunks" in length and "122" in length, length


def test_context_parallel_user_loop_cp2_dp2(tmp_path: Path) -> None:
    _check(4, run_ranks(_group, 4, str(tmp_path), timeout=600))


def test_models_plait_cannot_cut_are_one_message() -> None:
    """No process group needed: both are refused before any collective. A module around a causal LM (plait cannot
    tell its inputs from its labels) and labels for a model whose loss would shift the shard's labels itself."""
    from plait.parallel.context.sharding import ContextError, padding_docs
    from plait.parallel.context.user_forward import install

    attention = types.SimpleNamespace(positions=None, group=None, ring=types.SimpleNamespace(size=2, rank=0))

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.llm = llama()

        def forward(self, x, y):
            return self.llm(input_ids=x, labels=y).loss

    wrapped = Wrapped()
    install(wrapped, attention)
    with pytest.raises(ContextError, match="Wrapped.forward is neither.*p.forward_backward"):
        wrapped(torch.zeros(1, SEQ, dtype=torch.long), torch.zeros(1, SEQ, dtype=torch.long))
    model = llama()
    model.loss_function = lambda logits, labels, vocab_size, **kwargs: logits.sum()
    install(model, attention)
    ids = torch.zeros(1, SEQ, dtype=torch.long)
    with pytest.raises(ContextError, match="needs transformers' ForCausalLMLoss.*without labels"):
        model(input_ids=ids, labels=ids)
    # real tokens keep their document, each padding token is its own
    docs = padding_docs(torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1]]), torch.tensor([[0, 1, 1, 1], [2, 2, 3, 3]]), 4)
    assert docs.tolist() == [[0, 1, -3, -4], [-1, 2, 3, 3]]
