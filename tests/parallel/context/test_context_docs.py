"""Packed documents under context parallelism: attention never crosses documents, for documents of any length.

plait's GPT built with ``document_mask=True`` takes packed batches (``input_ids``, ``labels``, restarting
``position_ids``, ``doc_ids``; ``plait.data.packing.packed_fields``). The documents have odd lengths (13, 27, 9, 15
tokens in one row, 31 and 33 in the other, of 64), so they start and end inside the load-balanced chunks and span
the shards of different ranks (chunks of 16 tokens at cp=2, 8 at cp=4).

* The probe (as users found the bug elsewhere): one token of a document changed, the logits of every other
  document must stay exactly the same (bit for bit: a masked key adds exp(-inf) = 0), and the logits of the
  changed document's later tokens must change (so the probe can fail); every logit also equals one process on the
  whole sequence within 1e-5. Per ``cp_impl`` at cp=2, and ring, alltoall and allgather at cp=4. The logits
  come from a forward hook on the model's head during ``p.evaluate`` (each rank's shard, put back in order).
* Training: 3 AdamW steps (no clipping: the gradients compared are the raw ones) through
  ``plait.Plait.forward_backward`` at cp=2 per ``cp_impl`` equal one process with the same document mask (plain
  PyTorch, F.cross_entropy over the real tokens). float32. Observed: logits 1.8e-7, losses 4.8e-7, gradients
  3.0e-8, parameters 2.3e-6. Allowed (the bounds of test_context.py): logits 1e-5, losses 2e-5, every gradient at
  step 1 1e-7, every parameter after 3 steps 3e-5.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import run_ranks
from references import MP_LOSS_ATOL, MP_PARAM_ATOL

SEQ, STEPS, LR = 64, 3, 1e-3
GRAD_ATOL, LOGIT_ATOL = 1e-7, 1e-5
DOCS = [[13, 27, 9, 15], [31, 33]]  # document lengths of each row: none a multiple of 2 x cp
IMPLS = ("ring", "alltoall", "allgather")


def gpt():
    from plait.models.gpt import GPT
    from plait.models.tiny import tiny_config

    torch.manual_seed(0)
    return GPT(tiny_config(n_layer=2, d_model=32, n_head=4, seq_len=SEQ, vocab_size=256), document_mask=True)


def doc_ids() -> torch.Tensor:
    rows = [torch.cat([torch.full((n,), 10 * r + d) for d, n in enumerate(lengths)]) for r, lengths in enumerate(DOCS)]
    return torch.stack(rows)  # (B, T)


def packed(tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    from plait.data.packing import packed_fields

    return packed_fields(tokens, doc_ids())


def batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [packed(torch.randint(0, 256, (len(DOCS), SEQ), generator=g)) for _ in range(STEPS)]


def probes() -> list[tuple[int, int, dict]]:
    """(row, changed position, batch): the first batch with one token of one document changed, for a token in
    each document of row 0 (its middle) and one of row 1."""
    base = batches()[0]["input_ids"]
    out = []
    for row, pos in ((0, 6), (0, 20), (0, 45), (0, 55), (1, 30), (1, 40)):
        tokens = base.clone()
        tokens[row, pos] = (tokens[row, pos] + 1) % 256
        out.append((row, pos, packed(tokens)))
    return out


def causal_loss(model, batch: dict) -> torch.Tensor:
    target = torch.full_like(batch["labels"], -100)
    target[:, :-1] = batch["labels"][:, 1:]
    logits = model(batch["input_ids"], position_ids=batch["position_ids"], doc_ids=batch["doc_ids"])
    return F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1), ignore_index=-100)


def reference() -> tuple[list[float], dict, dict, list[torch.Tensor]]:
    model, losses, first = gpt(), [], {}
    with torch.no_grad():
        logits = [model(b["input_ids"], position_ids=b["position_ids"], doc_ids=b["doc_ids"])
                  for b in [batches()[0]] + [p for _, _, p in probes()]]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=False)
    for batch in batches():
        loss = causal_loss(model, batch)
        loss.backward()
        first = first or {n: q.grad.detach().clone() for n, q in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, first, {k: v.detach().clone() for k, v in model.state_dict().items()}, logits


def _run(run_dir: str, cp: int, impl: str, train: bool) -> dict:
    import plait
    from plait.parallel.context.sharding import shard_index

    p = plait.Plait(parallel={"cp": cp, "cp_impl": impl}, optim={"grad_clip": 0.0},
                    train={"global_batch_size": len(DOCS), "micro_batch_size": len(DOCS)},
                    run={"dir": f"{run_dir}/{impl}-cp{cp}"}, observe={"progress": False, "trackers": []})
    model, opt = p.setup(gpt(), optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1,
                                                                      foreach=False), loss_fn="causal_lm")
    index = shard_index(SEQ, cp, p.layout.split.cp_rank)
    seen: list[torch.Tensor] = []
    hook = model.head.register_forward_hook(lambda m, args, out: seen.append(out.detach().clone()))
    logits = []
    for batch in [batches()[0]] + [b for _, _, b in probes()]:
        p.evaluate(model, batch)
        logits.append(seen.pop())
    hook.remove()
    out: dict = {"index": index, "logits": logits, "layout": p.strategy.describe()}
    if train:
        names = {id(q): n for n, q in model.named_parameters()}
        grads: dict = {}

        def first_grads(o, args, kwargs) -> None:
            if not grads:
                grads.update({names[id(q)]: q.grad.detach().clone() for g in o.param_groups for q in g["params"]})
        opt.register_step_pre_hook(first_grads)
        losses = []
        for batch in batches():
            p.forward_backward(model, batch)
            losses.append(p.step(log=True).global_loss)
        out.update(losses=losses, grads=grads,
                   state={k: v.detach().clone() for k, v in model.state_dict().items()})
    p.close()
    return out


def _group(rank: int, world: int, run_dir: str, layouts: list[tuple[str, bool]]) -> list[dict]:
    return [_run(run_dir, world, impl, train) for impl, train in layouts]


def _whole(runs: list[dict], i: int) -> torch.Tensor:
    """Logits of evaluation ``i`` on the whole sequence, from every rank's shard."""
    first = runs[0]["logits"][i]
    whole = torch.empty(first.size(0), SEQ, first.size(2))
    for run in runs:
        whole[:, run["index"]] = run["logits"][i]
    return whole


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


LAYOUTS = {2: [(impl, True) for impl in IMPLS], 4: [(impl, False) for impl in IMPLS]}


@pytest.mark.parametrize("world", [2, 4])
def test_packed_documents_never_attend_across(tmp_path: Path, world: int) -> None:
    ranks = run_ranks(_group, world, str(tmp_path), LAYOUTS[world], timeout=600)
    ref_losses, ref_grads, ref_state, ref_logits = reference()
    docs = doc_ids()
    for j, (impl, train) in enumerate(LAYOUTS[world]):
        runs = [r[j] for r in ranks]
        what = f"cp={world} {impl}"
        assert "context-parallel" in runs[0]["layout"], what
        base = _whole(runs, 0)
        assert (base - ref_logits[0]).abs().max().item() < LOGIT_ATOL, what
        for i, (row, pos, _) in enumerate(probes(), start=1):
            probe = _whole(runs, i)
            assert (probe - ref_logits[i]).abs().max().item() < LOGIT_ATOL, (what, row, pos)
            other = docs != docs[row, pos]  # (B, T): every token of another document
            assert torch.equal(probe[other], base[other]), (what, row, pos)  # not one bit changed
            later = (docs == docs[row, pos]) & (torch.arange(SEQ) >= pos)  # the changed document from the token on
            assert (probe[later] - base[later]).abs().amax(-1).min().item() > 1e-4, (what, row, pos)
        if train:
            for run in runs:
                assert max(abs(a - b) for a, b in zip(run["losses"], ref_losses, strict=True)) < MP_LOSS_ATOL, what
                assert _max_diff(run["grads"], ref_grads) < GRAD_ATOL, what
                assert _max_diff(run["state"], ref_state) < MP_PARAM_ATOL, what
