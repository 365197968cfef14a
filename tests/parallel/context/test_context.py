"""Context parallelism on plait's GPT at sequence 256 equals one process on the whole sequence.

Layouts: cp=2 and cp=4 with ``ring``, ``alltoall`` and ``allgather``, and cp=2 x dp=2 with each (two spawned
groups, several layouts each). Every run trains 3 AdamW steps (clip 1.0) from the same weights through
``plait.Plait.forward_backward``, on dict batches whose labels hold ``-100`` over uneven prompt lengths, so the
shards hold different numbers of real tokens: the losses must be combined over the real tokens of the whole
sequence, never as a mean of the shards' means. The cp-only runs take the global batch in one micro-step without
the helper (the strategy counts the micro-batch's real tokens itself); cp x dp, and cp=2 ring once more, take two
micro-steps per step with ``p.num_items_in_batch`` (one loss over the optimizer step's tokens, what plait's
trainer uses; its divisor counts the cp ranks among those gradients are averaged over). The reference is the
mean over every real token of the global batch.

Compared with plain PyTorch in one process (F.cross_entropy over the whole global batch): the logged loss of
every step, every parameter's gradient at step 1, every parameter after 3 steps, and then ``p.evaluate`` of the
first batch (the shards' sums over the real tokens added over cp). float32; ring attention
merges blocks by their log-sum-exp and the gradients of dp x cp ranks are summed in another order, so results
differ by rounding only. Observed: losses 1.2e-6, gradients 1.5e-8 (entries up to 5.6e-2), parameters 2.0e-5
(AdamW turns rounding in gradient entries near zero into update differences up to ~lr x their relative error).
Allowed: losses 2e-5, gradients 1e-7, parameters 3e-5 (the model-parallel tests' bounds; one update moves a
parameter ~1e-3).

Bad input: a sequence length that 2 x cp does not divide, in the config and in a batch, gives one message
naming both remedies; heads that cp does not divide under ``alltoall`` one naming ``ring``; calling one of the
model's blocks on a whole sequence under cp (the model's own forward cuts it: ``test_context_user_loop``) is refused
with the remedy.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import run_ranks
from references import MP_LOSS_ATOL, MP_PARAM_ATOL, adam_slack

SEQ, GLOBAL, STEPS, LR, CLIP = 256, 4, 3, 1e-3, 1.0
GRAD_ATOL = 1e-7


def gpt():
    from plait.models.gpt import GPT
    from plait.models.tiny import tiny_config

    torch.manual_seed(0)
    return GPT(tiny_config(n_layer=2, d_model=32, n_head=4, seq_len=SEQ, vocab_size=256))


def batches() -> list[dict[str, torch.Tensor]]:
    """``STEPS`` global batches of token ids; in every other row a prompt of up to 200 tokens does not count."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 256, (GLOBAL, SEQ), generator=g)
        labels = ids.clone()
        for r, prompt in enumerate(torch.randint(0, 200, (GLOBAL,), generator=g).tolist()):
            labels[r, :prompt if r % 2 else 0] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=False)


def causal_loss(model, batch: dict) -> torch.Tensor:
    target = torch.full_like(batch["labels"], -100)
    target[:, :-1] = batch["labels"][:, 1:]
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1), ignore_index=-100)


def reference(slack: dict[str, torch.Tensor] | None = None) -> tuple[list[float], dict, dict, float]:
    """The plain loop's losses, first gradients, final state and evaluated loss; ``slack`` (a dict) is filled with each
    parameter's ``adam_slack`` for gradients off by ``GRAD_ATOL``, summed over the steps."""
    model, losses, first = gpt(), [], {}
    opt = adamw(model)
    for step, batch in enumerate(batches(), 1):
        loss = causal_loss(model, batch)
        loss.backward()
        first = first or {n: q.grad.detach().clone() for n, q in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        if slack is not None:
            with torch.no_grad():
                for n, q in model.named_parameters():
                    slack[n] = slack.get(n, 0.0) + adam_slack(opt, q, step, GRAD_ATOL)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        evaluated = causal_loss(model, batches()[0]).item()
    return losses, first, {k: v.detach().clone() for k, v in model.state_dict().items()}, evaluated


def _train(run_dir: str, cp: int, impl: str, dp: int, helper: bool) -> dict:
    import plait

    micro = GLOBAL // dp // 2 if helper else GLOBAL  # with the helper: two micro-steps per optimizer step
    p = plait.Plait(parallel={"cp": cp, "cp_impl": impl, "dp": dp}, optim={"grad_clip": CLIP},
                    train={"global_batch_size": GLOBAL, "micro_batch_size": micro},
                    run={"dir": f"{run_dir}/{impl}-cp{cp}-dp{dp}-{helper}"},
                    observe={"progress": False, "trackers": []})
    model, opt = p.setup(gpt(), optimizer=adamw, loss_fn="causal_lm")
    names = {id(q): n for n, q in model.named_parameters()}
    grads: dict = {}

    def first_grads(o, args, kwargs) -> None:
        if not grads:
            grads.update({names[id(q)]: q.grad.detach().clone() for g in o.param_groups for q in g["params"]})
    opt.register_step_pre_hook(first_grads)
    losses = []
    for batch in batches():
        share = GLOBAL // dp
        mine = {k: v[p.dp_rank * share:(p.dp_rank + 1) * share] for k, v in batch.items()}
        micro_batches = [{k: v[i:i + micro] for k, v in mine.items()} for i in range(0, share, micro)]
        n = p.num_items_in_batch(micro_batches) if helper else None
        for mb in micro_batches:
            p.forward_backward(model, mb, num_items_in_batch=n)
            info = p.step(log=True)
        losses.append(info.global_loss)
    out = {"losses": losses, "grads": grads, "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
           "layout": p.strategy.describe(), "eval": float(p.evaluate(model, batches()[0]))}
    if dp == 1 and impl == "ring" and not helper:
        out["errors"] = _bad_input(p, model)
    p.close()
    return out


def _bad_input(p, model) -> list[str]:
    """The messages of a batch 2 x cp does not divide, and of a block of the model called on a whole sequence."""
    from plait.config import ConfigError

    errors = []
    for call in (lambda: p.forward_backward(model, {"input_ids": torch.zeros(1, SEQ - 6, dtype=torch.long)}),
                 lambda: model.blocks[0](torch.zeros(1, SEQ, 32))):
        try:
            call()
        except ConfigError as e:
            errors.append(str(e))
    return errors


def _group(rank: int, world: int, run_dir: str, layouts: list[tuple[int, str, int, bool]]) -> list[dict]:
    return [_train(run_dir, *layout) for layout in layouts]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


# (cp, cp_impl, dp, with p.num_items_in_batch over two micro-steps)
LAYOUTS = {2: [(2, "ring", 1, False), (2, "alltoall", 1, False), (2, "allgather", 1, False), (2, "ring", 1, True)],
           4: [(4, "ring", 1, False), (4, "alltoall", 1, False), (4, "allgather", 1, False), (2, "ring", 2, True),
               (2, "alltoall", 2, True), (2, "allgather", 2, True)]}


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_gpt_equals_one_process(tmp_path: Path, world: int) -> None:
    ranks = run_ranks(_group, world, str(tmp_path), LAYOUTS[world], timeout=600)
    ref_losses, ref_grads, ref_state, ref_eval = reference()
    for i, (cp, impl, dp, helper) in enumerate(LAYOUTS[world]):
        runs = [r[i] for r in ranks]
        what = f"cp={cp} {impl} dp={dp} helper={helper}"
        assert "context-parallel" in runs[0]["layout"], what
        for run in runs:
            assert max(abs(a - b) for a, b in zip(run["losses"], ref_losses, strict=True)) < MP_LOSS_ATOL, what
            assert _max_diff(run["grads"], ref_grads) < GRAD_ATOL, what
            assert _max_diff(run["state"], ref_state) < MP_PARAM_ATOL, what
            assert abs(run["eval"] - ref_eval) < MP_LOSS_ATOL, what  # p.evaluate: the whole sequence's mean
    if world == 2:
        batch_error, call_error = ranks[0][0]["errors"]
        assert "2 x cp = 4 equal chunks" in batch_error and "250" in batch_error, batch_error
        assert "call that model (model(...), p.forward_backward, p.evaluate)" in call_error, call_error


def test_bad_config_is_one_message() -> None:
    from plait.config import Config, ConfigError
    from plait.recipes import validate_config

    cfg = Config()
    cfg.parallel.cp, cfg.model.seq_len = 4, 100
    with pytest.raises(ConfigError, match=r"2 x cp = 8 equal chunks .* model.seq_len is 100"):
        validate_config(cfg, 4)
    cfg = Config()
    cfg.parallel.cp, cfg.parallel.cp_impl, cfg.model.n_head, cfg.model.d_model = 4, "alltoall", 6, 48
    with pytest.raises(ConfigError, match=r"6 heads \(model.n_head\), which do not divide by 4; use "
                                          "parallel.cp_impl=ring"):
        validate_config(cfg, 4)
    cfg = Config()
    cfg.parallel.cp, cfg.parallel.dp = 2, 2
    with pytest.raises(ConfigError, match=r"dp=2 x tp=1 x pp=1 x cp=2 = 4 do not match the world size 2"):
        validate_config(cfg, 2)
    cfg = Config()
    cfg.parallel.cp = 3
    with pytest.raises(ConfigError, match="does not divide by tp x pp x cp = 3"):
        validate_config(cfg, 4)
