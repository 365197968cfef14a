"""A Hugging Face MoE model's auxiliary loss under context parallelism in the user's own loop equals one process's:
in evaluation (taken once, not once per cp rank) and with a padding ``attention_mask`` (padding tokens left out).

The model: ``test_hf_compose``'s tiny Qwen3-MoE (2 layers, 4 experts top-2, ``output_router_logits=True`` with
coefficient 0.1), every rank starting from other weights (plait broadcasts rank 0's). One spawned group of 4 ranks,
two layouts, ring attention:

- ``cp2-ep2``: cp=2 x ep=2 (expert-parallel ranks are data-parallel ranks: dp=2);
- ``tp2-sp-cp2``: sequence parallelism (each tp rank routes its slice of its cp shard through the MoE blocks) with
  cp=2: the router logits gathered over cp x tp are put back in token order through both cuts.

Each data-parallel rank takes its rows of a global batch of 4 sequences of 16 tokens, right-padded to 16, 11, 7 and
13 real tokens (labels -100 on the padding; the unpadded evaluation uses the same ids without a mask). Compared with
the same calls in one plain PyTorch process on each data-parallel rank's rows:

- before training, ``model.eval(); model(input_ids=x, labels=x).loss`` without a mask, and under ``torch.no_grad()``
  with the padding mask: the whole sequences' loss, main term plus the auxiliary term once;
- then 2 AdamW steps (clip 1.0) of ``p.backward(model(input_ids=x, attention_mask=m, labels=y).loss)``: every step's
  ``global_loss``, every parameter's gradient at step 1 after clipping (expert gradients as the global ``(E, ...)``
  tensors), every parameter after 2 steps.

Under cp a padding query attends to itself only (one process: to the real tokens before it), so padding tokens'
router logits differ; with the mask they count in neither loss, so the results are the one process's. fp32, the same
maths summed in another order (ring attention's blocks, tp's partial sums, gradients averaged over dp x cp, the
experts' all-to-all): tolerances those of ``test_hf_compose``. Measured on torch 2.13 CPU, transformers 5.24, over
both layouts and all 4 ranks: evaluated losses 9.5e-7, step losses 2.4e-7, gradients 6.8e-7 of their tensor's
largest element, parameters 5.8e-8 beyond their AdamW slack. Before the fix: the evaluated losses were off by the
auxiliary term once more (0.200 to 0.202 at cp=2), the step losses by up to 7.8e-4 (padding tokens counted in the
auxiliary loss, and the mask weighting rows out of order), gradients by 4.4 times their tensor's largest element,
parameters by 4.0e-3 beyond their slack.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import run_ranks
from references import beyond_slack

from ..expert.test_hf_compose import GRAD_RTOL, LOSS_ATOL, PARAM_ATOL, V, _whole_grads, build, user_loop

os.environ.setdefault("HF_HUB_OFFLINE", "1")
STEPS, GLOBAL, SEQ, LR, CLIP = 2, 4, 16, 1e-3, 1.0
REAL = (16, 11, 7, 13)  # real tokens of each row, the rest padding on the right
# name: (parallel settings, its data-parallel degree on 4 ranks)
LAYOUTS = {"cp2-ep2": ({"cp": 2, "ep": 2}, 2), "tp2-sp-cp2": ({"tp": 2, "sequence_parallel": True, "cp": 2}, 1)}


def batch(step: int) -> dict[str, torch.Tensor]:
    """The global batch of ``step``, padded: input_ids, attention_mask and labels (GLOBAL, SEQ)."""
    ids = torch.randint(0, V, (GLOBAL, SEQ), generator=torch.Generator().manual_seed(200 + step))
    mask = (torch.arange(SEQ) < torch.tensor(REAL)[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def rows(b: dict[str, torch.Tensor], dp: int, dp_rank: int) -> dict[str, torch.Tensor]:
    return {k: v.chunk(dp)[dp_rank] for k, v in b.items()}


def evaluate(model: torch.nn.Module, dp: int, dp_rank: int) -> tuple[float, float]:
    """``model.eval()``'s loss on ``dp_rank``'s rows without a mask, and under ``no_grad`` with the padding mask (in
    train mode: evaluation either way)."""
    b = rows(batch(0), dp, dp_rank)
    model.eval()
    plain = model(input_ids=b["input_ids"], labels=b["input_ids"]).loss.item()
    model.train()
    with torch.no_grad():
        padded = model(**b).loss.item()
    return plain, padded


def reference(dp: int) -> dict:
    """One plain process: each dp rank's evaluations, then the loop (each dp rank's rows one micro-step of 1/dp)."""
    model = build(0)
    evals = [evaluate(model, dp, r) for r in range(dp)]
    return {"evals": evals, **user_loop(model, lambda s: [rows(batch(s), dp, r) for r in range(dp)], STEPS, LR, CLIP)}


def _train(root: str, name: str, rank: int) -> dict:
    import plait

    parallel, dp = LAYOUTS[name]
    p = plait.Plait(parallel=parallel, run={"dir": f"{root}/{name}"}, optim={"grad_clip": CLIP},
                    train={"global_batch_size": GLOBAL, "micro_batch_size": GLOBAL // dp, "seed": 0},
                    observe={"progress": False, "trackers": []})
    model, opt = p.setup(build(rank), optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=LR))
    assert p.topology.dp == dp
    evals = evaluate(model, dp, p.dp_rank)
    grads: dict = {}

    def first(*_args) -> None:  # after clipping, before the update
        if not grads:
            grads.update(_whole_grads(p, model))
    getattr(opt, "optimizer", opt).register_step_pre_hook(first)
    losses = []
    for s in range(STEPS):
        p.backward(model(**rows(batch(s), dp, p.dp_rank)).loss)
        losses.append(p.step().global_loss)
    state = {k: v.detach().clone() for k, v in p.full_state_dict(model).items()}
    p.close()
    return {"dp_rank": p.dp_rank, "evals": evals, "losses": losses, "grads": grads, "state": state}


def _group(rank: int, world: int, root: str) -> dict:
    return {name: _train(root, name, rank) for name in LAYOUTS}


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> list[dict]:
    return run_ranks(_group, 4, str(tmp_path_factory.mktemp("cpmoe")), timeout=300)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_moe_aux_loss_under_cp_equals_one_process(four, name) -> None:
    ref = reference(LAYOUTS[name][1])
    for rank, run in ((r, g[name]) for r, g in enumerate(four)):
        plain, padded = ref["evals"][run["dp_rank"]]
        what = (name, rank)
        assert run["evals"][0] == pytest.approx(plain, abs=LOSS_ATOL), (what, run["evals"], plain)
        assert run["evals"][1] == pytest.approx(padded, abs=LOSS_ATOL), (what, run["evals"], padded)
        assert run["losses"] == pytest.approx(ref["losses"], abs=LOSS_ATOL), (what, run["losses"], ref["losses"])
        assert run["grads"].keys() == ref["grads"].keys()
        for k, g in ref["grads"].items():
            assert (run["grads"][k] - g).abs().max() <= GRAD_RTOL * g.abs().max(), (what, k)
        assert beyond_slack(run["state"], ref["state"], ref["slack"]) < PARAM_ATOL, what
    moved = max(float((ref["state"][k] - v).abs().max()) for k, v in build(0).state_dict().items())
    assert moved > 10 * PARAM_ATOL  # training moved the weights beyond the tolerance
