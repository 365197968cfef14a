"""Mixed precision in the user's own loop: ``model(...)`` returns float32 what bf16 made of it, so the loss the user
computes after it (``cross_entropy(model(x), y)``, as docs/api.md writes it) runs in float32, as in the plain
PyTorch loop whose autocast region covers the loss (autocast runs cross-entropy in float32).

Measured on the tiny GPT, 6 AdamW steps at lr 1e-2 on batches of 8: the plain bf16 autocast loop's losses are within
6.0e-4 of the float32 loop's; plait's were within 2.6e-2 while the loss ran on bf16 logits (multiples of 1/32 at a
loss of 5.5), and now equal the plain bf16 loop's exactly at world 1 (the same operations: autocast's float32
cross-entropy is the cast of the logits, then cross-entropy). At dp=2 the ranks' bf16 forward runs on half batches
and the gradients are averaged (a different rounding of the same bf16 computation, of the size of bf16's own
distance from float32): plait's distance from the float32 loop is bounded by twice the plain bf16 loop's (measured
1.2x under plait's reducer, 1.4x under DDP, 0.8x under FSDP2's bf16 policy, which casts parameters instead of
autocast); before, 44x.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import run_ranks
from torch import nn

from plait.models.tiny import seeded_gpt, tiny_config, token_batches

STEPS, LR, BATCH = 6, 1e-2, 8
CONFIG = tiny_config(n_layer=2, d_model=32, n_head=4, seq_len=16, vocab_size=256)
FACTOR = 2.0  # dp=2: plait's distance from the float32 loop against the plain bf16 loop's (see the docstring)


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return token_batches(STEPS, BATCH, seq_len=16, vocab_size=256, seed=1)


def _plain(bf16: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The user's loop in plain PyTorch: autocast (when ``bf16``) over the forward and the loss."""
    model = seeded_gpt(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x, y in _data():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _plait(root: str, rank: int, world: int, parallel: dict[str, Any]) -> dict[str, Any]:
    """The same loop through plait at train.precision=bf16: each rank its share of every batch."""
    import plait

    p = plait.Plait(run={"dir": root}, parallel=parallel, optim={"grad_clip": 1.0},
                    train={"precision": "bf16", "global_batch_size": BATCH, "micro_batch_size": BATCH // world},
                    observe={"progress": False, "trackers": []})
    model, _ = p.setup(seeded_gpt(CONFIG), optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=LR))
    share, losses, dtypes = BATCH // world, [], set()
    for x, y in _data():
        out = model(x[rank * share:(rank + 1) * share])
        dtypes.add(out.dtype)
        p.backward(F.cross_entropy(out.flatten(0, 1), y[rank * share:(rank + 1) * share].flatten()))
        losses.append(p.step().global_loss)
    state = {k: v.detach().clone() for k, v in p.full_state_dict(model).items()}
    p.close()
    return {"losses": losses, "state": state, "dtypes": dtypes}


def _distance(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_the_user_loop_at_bf16_equals_the_plain_autocast_loop(tmp_path: Path) -> None:
    run = _plait(str(tmp_path), 0, 1, {})
    bf16, fp32 = _plain(True), _plain(False)
    assert run["dtypes"] == {torch.float32}
    assert run["losses"] == bf16[0]
    assert all(torch.equal(run["state"][k], v) for k, v in bf16[1].items())
    assert 0 < _distance(bf16[0], fp32[0]) < 2e-3  # bf16 is not float32, but close: what the equality above keeps


def _two_ranks(rank: int, world: int, root: str) -> dict[str, dict[str, Any]]:
    layouts = {"reducer": {}, "ddp": {"impl": "torch"}, "zero3": {"zero": 3}}
    return {name: _plait(f"{root}/{name}", rank, world, parallel) for name, parallel in layouts.items()}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, dict[str, Any]]:
    return run_ranks(_two_ranks, 2, str(tmp_path_factory.mktemp("bf16")), timeout=300)[0]


@pytest.mark.parametrize("layout", ["reducer", "ddp", "zero3"])
def test_the_user_loop_at_bf16_over_two_ranks_stays_near_the_plain_loop(two_ranks: dict, layout: str) -> None:
    """Plait's reducer and DDP autocast the forward; ZeRO-3 runs it through FSDP2's bf16 policy (no autocast):
    every one returns float32 logits, and its losses stay as near the float32 loop's as the plain bf16 loop's."""
    run = two_ranks[layout]
    bf16, fp32 = _plain(True), _plain(False)
    assert run["dtypes"] == {torch.float32}
    assert _distance(run["losses"], fp32[0]) <= FACTOR * _distance(bf16[0], fp32[0])


def test_outputs_in_containers_come_back_float32_and_the_rest_as_they_were() -> None:
    from plait.parallel.prepare import float32_outputs

    low, ids = torch.ones(2, dtype=torch.bfloat16), torch.arange(3)
    half, own = torch.ones(2, dtype=torch.float16), torch.ones(2, dtype=torch.float64)
    out = float32_outputs({"logits": low, "ids": ids, "pair": (low, [half, own]), "note": "x"}, torch.bfloat16)
    assert out["logits"].dtype == out["pair"][0].dtype == torch.float32
    assert out["ids"] is ids and out["pair"][1][0] is half and out["pair"][1][1] is own and out["note"] == "x"
    transformers = pytest.importorskip("transformers")
    result = float32_outputs(transformers.modeling_outputs.CausalLMOutputWithPast(loss=low.sum().float(), logits=low),
                             torch.bfloat16)
    assert type(result).__name__ == "CausalLMOutputWithPast" and result.logits.dtype == torch.float32
    assert result["logits"] is result.logits and result.loss.dtype == torch.float32


def test_a_model_the_user_holds_in_bf16_keeps_its_outputs() -> None:
    from plait.parallel.prepare import route_forward

    for dtype, returned in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)):
        model = nn.Linear(4, 2).to(dtype)
        route_forward(model, None, "bf16", True, torch.device("cpu"))
        assert model(torch.ones(3, 4, dtype=dtype)).dtype == returned
