"""One loss over the global batch's tokens: at dp=2 x accumulation 2, with ``-100`` labels spread unevenly over the
micro-batches, training equals one process on the whole batch.

* plait's trainer (``plait.Trainer``, the loop ``plait train`` runs) on plait's GPT over packed documents with the
  document mask: some rows hold one long document (every label counts), others many short ones (a ``-100`` label
  where each starts), so a mean per micro-batch would weigh their tokens differently.
* plait's trainer on a small Hugging Face Llama with its own loss (``train.loss=hf``): the trainer passes the count
  to the model as ``num_items_in_batch`` (transformers' convention);
* the keep-your-loop API on the same Llama: the user's loop passes ``p.num_items_in_batch(labels)`` to
  the model's own loss (``num_items_in_batch``, transformers' convention) and calls ``p.backward``.

The reference is plain PyTorch in one process: the mean cross-entropy over every real token of the global batch,
one backward, gradient clipping at 1.0, AdamW. Compared: the logged loss of every step, every parameter's
gradient at step 1 and every parameter after 3 steps. float32; only the summation order differs (two ranks, two
micro-steps, per-token sums instead of one mean). Observed: losses 2.4e-7, gradients 1.9e-8 (entries up to
0.12), parameters 1.2e-6. Allowed: the model-parallel tests' bounds (``references.MP_*``: losses 2e-5,
parameters 3e-5) and 1e-7 on gradients. The test also checks that the data is uneven enough to matter: the
gradient of the old mean of micro-batch means is 9e-3 from the reference's (required: over 20x the tolerance).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from helpers import CollectiveCounter, run_ranks
from references import MP_LOSS_ATOL, MP_PARAM_ATOL

STEPS, GLOBAL, MICRO, SEQ, LR, CLIP = 3, 8, 2, 32, 1e-3, 1.0
GRAD_ATOL = 1e-7
LLAMA = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


# -- data ----------------------------------------------------------------------------------------------
def packed_rows(count: int = 24) -> list[dict[str, torch.Tensor]]:
    """Packed rows of ``SEQ`` tokens: every third row one document, the others documents of 2-5 tokens."""
    from plait.data.packing import packed_fields

    g = torch.Generator().manual_seed(3)
    rows = []
    for r in range(count):
        tokens = torch.randint(0, 256, (1, SEQ), generator=g)
        if r % 3 == 0:
            docs = torch.zeros(1, SEQ, dtype=torch.long)
        else:
            lengths = torch.randint(2, 6, (SEQ,), generator=g)
            docs = torch.repeat_interleave(torch.arange(SEQ), lengths)[:SEQ].unsqueeze(0)
        rows.append({k: v[0] for k, v in packed_fields(tokens, docs + 100 * r).items()})
    return rows


def llama_batches() -> list[dict[str, torch.Tensor]]:
    """``STEPS`` global batches of token ids with labels: rows masked (-100) over a prompt of 0 to 12 tokens."""
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 256, (GLOBAL, 16), generator=g)
        labels = ids.clone()
        for r, prompt in enumerate(torch.randint(0, 13, (GLOBAL,), generator=g).tolist()):
            labels[r, :prompt if r % 2 else 0] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def llama_rows() -> list[dict[str, torch.Tensor]]:
    """The Llama's batches as rows of a data set (what plait's trainer reads and shares over the ranks)."""
    return [{k: v[r] for k, v in batch.items()} for batch in llama_batches() for r in range(GLOBAL)]


def gpt_model():
    from plait.models.gpt import GPT
    from plait.models.tiny import tiny_config

    torch.manual_seed(0)
    return GPT(tiny_config(n_layer=2, d_model=32, n_head=2, seq_len=SEQ), document_mask=True)


def llama_model():
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=False)


def shifted(labels: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(labels, -100)
    out[:, :-1] = labels[:, 1:]
    return out


def gpt_loss(model, batch: dict, reduction: str = "mean") -> torch.Tensor:
    logits = model(batch["input_ids"], position_ids=batch["position_ids"], doc_ids=batch["doc_ids"])
    return F.cross_entropy(logits.view(-1, logits.size(-1)), shifted(batch["labels"]).view(-1), reduction=reduction)


def stack(batches: list[dict]) -> dict:
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


# -- the ranks -----------------------------------------------------------------------------------------
def _grads_at_first_step(optimizer, names: dict) -> dict:
    seen: dict = {}

    def hook(opt, args, kwargs):
        if not seen:
            seen.update({names[id(p)]: p.grad.detach().clone() for g in opt.param_groups for p in g["params"]})
    optimizer.register_step_pre_hook(hook)
    return seen


def _ranks(rank: int, world: int, run_dir: str) -> dict:
    import plait
    from plait.config import Config, from_sections

    sections = {"parallel": {"dp": world}, "optim": {"grad_clip": CLIP},
                "train": {"global_batch_size": GLOBAL, "micro_batch_size": MICRO, "steps": STEPS, "log_every": 1,
                          "eval_every": 0}, "observe": {"progress": False, "trackers": [], "report": False}}
    out: dict = {}
    # plait's trainer on the GPT
    cfg = from_sections({**sections, "run": {"dir": f"{run_dir}/trainer"}}, Config())
    trainer = plait.Trainer(gpt_model(), train_data=packed_rows(), loss_fn="causal_lm", optimizer=adamw,
                            scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), config=cfg)
    consumed: list = []
    read = trainer._next_batch
    trainer._next_batch = lambda: consumed.append(read()) or consumed[-1]
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    grads = _grads_at_first_step(trainer.optimizer, names)
    out["gpt_losses"] = [trainer.train_step(log=True)["global_loss"] for _ in range(STEPS)]
    out["gpt_batches"], out["gpt_grads"] = consumed, grads
    out["gpt_state"] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    trainer.p.close()
    # plait's trainer on the Llama with its own loss (train.loss=hf): the model gets num_items_in_batch
    cfg = from_sections({**sections, "run": {"dir": f"{run_dir}/trainer-hf"}}, Config())
    trainer = plait.Trainer(llama_model(), train_data=llama_rows(), loss_fn="hf", optimizer=adamw,
                            scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), config=cfg)
    consumed = []
    read_hf = trainer._next_batch
    trainer._next_batch = lambda: consumed.append(read_hf()) or consumed[-1]
    grads = _grads_at_first_step(trainer.optimizer, {id(q): n for n, q in trainer.model.named_parameters()})
    out["hf_losses"] = [trainer.train_step(log=True)["global_loss"] for _ in range(STEPS)]
    out["hf_batches"], out["hf_grads"] = consumed, grads
    out["hf_state"] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    out["hf_weighted"] = trainer.token_weighted
    trainer.p.close()
    # plait's token windows (every target counts): the step's count is known, nothing counted or all-reduced
    from plait.data.text import TokenWindows

    cfg = from_sections({**sections, "run": {"dir": f"{run_dir}/windows"}}, Config())
    windows = TokenWindows(torch.arange(4000) % 251, SEQ)
    trainer = plait.Trainer(gpt_model(), train_data=windows, loss_fn="causal_lm", optimizer=adamw, config=cfg)
    consumed = []
    read_w = trainer._next_batch
    trainer._next_batch = lambda: consumed.append(read_w()) or consumed[-1]
    out["windows_known"] = trainer.items_per_step
    trainer.train_step(log=True)
    with CollectiveCounter() as c:
        trainer.train_step(log=False)
    out["windows_collectives"], out["windows_buckets"] = c.calls, len(trainer.p.layout.policy.engine.buckets)
    out["windows_items"] = [float(trainer.p.num_items_in_batch(consumed[i:i + 2], trainer.loss)) for i in (0, 2)]
    out["windows_known_items"] = float(trainer.p.num_items_known(trainer.items_per_step))
    trainer.p.close()
    # the keep-your-loop API on a Hugging Face Llama, with the helper
    p = plait.Plait(from_sections({**sections, "run": {"dir": f"{run_dir}/api"}}, Config()))
    model, opt = p.setup(llama_model(), optimizer=adamw)
    grads = _grads_at_first_step(opt, {id(q): n for n, q in model.named_parameters()})
    share = GLOBAL // p.dp
    losses = []
    for batch in llama_batches():
        mine = {k: v[p.dp_rank * share:(p.dp_rank + 1) * share] for k, v in batch.items()}
        micro = [{k: v[i:i + MICRO] for k, v in mine.items()} for i in range(0, share, MICRO)]
        n = p.num_items_in_batch([mb["labels"] for mb in micro])
        for mb in micro:
            p.backward(model(**mb, num_items_in_batch=n).loss)
            info = p.step(log=True)
        losses.append(info.global_loss)
    out["llama_losses"], out["llama_grads"] = losses, grads
    out["llama_state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    p.close()
    return out


# -- the references ------------------------------------------------------------------------------------
def _reference(model, global_batches: list, loss_of) -> tuple[list[float], dict, dict]:
    opt = adamw(model)
    losses, first = [], {}
    for batch in global_batches:
        loss = loss_of(model, batch)
        loss.backward()
        if not first:
            first = {n: q.grad.detach().clone() for n, q in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, first, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _mean_of_means_grads(model, micro_batches: list, loss_of) -> dict:
    """The first step's gradients as a mean per micro-batch weighs them (what token weighting replaces)."""
    for mb in micro_batches:
        (loss_of(model, mb) / len(micro_batches)).backward()
    return {n: q.grad for n, q in model.named_parameters()}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_dp2_accumulation2_weighs_every_real_token_like_one_process(tmp_path: Path) -> None:
    r0, r1 = run_ranks(_ranks, 2, str(tmp_path), timeout=300)
    for key in ("gpt_losses", "llama_losses"):
        assert r0[key] == r1[key], key  # the logged loss is the agreed global one on every rank
    for key in ("gpt_state", "llama_state"):
        assert _max_diff(r0[key], r1[key]) == 0.0, key  # data parallelism: the same parameters on every rank

    # plait's GPT through the trainer: each step's global batch is what the two ranks read
    per_step = [stack([*r0["gpt_batches"][2 * s:2 * s + 2], *r1["gpt_batches"][2 * s:2 * s + 2]])
                for s in range(STEPS)]
    ref_losses, ref_grads, ref_state = _reference(gpt_model(), per_step, gpt_loss)
    old = _mean_of_means_grads(gpt_model(), r0["gpt_batches"][:2] + r1["gpt_batches"][:2], gpt_loss)
    assert _max_diff(old, ref_grads) > 20 * GRAD_ATOL, "the data must make micro-batch means differ"
    assert max(abs(a - b) for a, b in zip(r0["gpt_losses"], ref_losses, strict=True)) < MP_LOSS_ATOL
    assert _max_diff(r0["gpt_grads"], ref_grads) < GRAD_ATOL
    assert _max_diff(r0["gpt_state"], ref_state) < MP_PARAM_ATOL

    # token windows: the known count is the counted one, and a non-logging step runs the gradient buckets alone
    assert r0["windows_known"] == GLOBAL // 2 * SEQ  # this rank's targets over the step (dp = 2)
    assert r0["windows_items"] == [r0["windows_known_items"]] * 2 == [GLOBAL * SEQ / 4] * 2
    assert r0["windows_collectives"] == r0["windows_buckets"] == r1["windows_collectives"], r0

    # the Llama through plait's trainer with its own loss (train.loss=hf)
    assert r0["hf_weighted"]
    per_step = [stack([*r0["hf_batches"][2 * s:2 * s + 2], *r1["hf_batches"][2 * s:2 * s + 2]]) for s in range(STEPS)]
    ref_losses, ref_grads, ref_state = _reference(llama_model(), per_step, lambda m, b: m(**b).loss)
    assert max(abs(a - b) for a, b in zip(r0["hf_losses"], ref_losses, strict=True)) < MP_LOSS_ATOL
    assert _max_diff(r0["hf_grads"], ref_grads) < GRAD_ATOL
    assert _max_diff(r0["hf_state"], ref_state) < MP_PARAM_ATOL

    # the Llama through the API: the model's own loss over the whole global batch
    ref_losses, ref_grads, ref_state = _reference(llama_model(), llama_batches(), lambda m, b: m(**b).loss)
    first = llama_batches()[0]
    micro = [{k: v[i:i + MICRO] for k, v in first.items()} for i in range(0, GLOBAL, MICRO)]
    old = _mean_of_means_grads(llama_model(), micro, lambda m, b: m(**b).loss)
    assert _max_diff(old, ref_grads) > 20 * GRAD_ATOL, "the data must make micro-batch means differ"
    assert max(abs(a - b) for a, b in zip(r0["llama_losses"], ref_losses, strict=True)) < MP_LOSS_ATOL
    assert _max_diff(r0["llama_grads"], ref_grads) < GRAD_ATOL
    assert _max_diff(r0["llama_state"], ref_state) < MP_PARAM_ATOL
