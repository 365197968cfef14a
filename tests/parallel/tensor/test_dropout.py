"""Dropout under tensor parallelism: which masks tensor-parallel ranks share and which they do not.

Replicated activations (the residual stream without sequence parallelism) must get the same mask on
every tp rank, or the ranks' copies drift apart; attention dropout over each rank's own heads, and
residual dropout over each rank's own sequence slice (sequence parallelism), need masks of their own.
Dropout changes the random stream, so these runs are not compared with one process; they check the
invariants instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import run_ranks

from plait.config import ModelConfig
from plait.models.gpt import GPT, CausalSelfAttention
from plait.recipes import load_recipe_config as load_config  # plait train's config: the gpt recipe's defaults
from plait.recipes import validate_config as validate

TP_DROPOUT = ["--model.n_layer=2", "--model.d_model=32", "--model.n_head=4", "--model.seq_len=16",
              "--model.dropout=0.2", "--train.steps=3", "--train.global_batch_size=4", "--train.micro_batch_size=4",
              "--train.eval_every=0", "--train.eval_sequences=4", "--checkpoint.every=0",
              "--observe.progress=false", "--observe.trackers=[]", "--parallel.tp=2"]


def _train(rank: int, world: int, root: str) -> dict:
    from plait.recipes import build_trainer

    cfg = validate(load_config(overrides=TP_DROPOUT + [f"--run.dir={root}"]), world)
    Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
    trainer = build_trainer(cfg)
    losses = [trainer.train_step()["loss"] for _ in range(3)]
    m = trainer.layout.model
    # LayerNorm parameters stay plain, replicated tensors without sequence parallelism: each tp rank
    # updates its own copy from its own (identical, if the masks agree) gradient.
    norms = {n: p.detach().clone() for n, p in m.named_parameters() if ".ln" in n or n.startswith("ln_f")}
    return {"losses": losses, "norms": norms}


def test_replicated_dropout_masks_agree_across_tp_ranks(tmp_path) -> None:
    a, b = run_ranks(_train, 2, str(tmp_path))
    assert all(x == x for x in a["losses"]) and a["losses"] == b["losses"]
    assert a["norms"].keys() == b["norms"].keys() and a["norms"]
    for name in a["norms"]:
        assert torch.equal(a["norms"][name], b["norms"][name]), f"{name} differs between tp ranks"
    # Training moved them (the check above is not comparing untouched initial values).
    assert not torch.equal(a["norms"]["blocks.0.ln1.weight"], torch.ones(32))


def _attn(stream: int) -> CausalSelfAttention:
    torch.manual_seed(0)
    attn = CausalSelfAttention(ModelConfig(n_layer=1, d_model=16, n_head=2, seq_len=8, dropout=0.5))
    attn.dropout_stream = stream
    return attn


def test_dropout_streams_differ_and_leave_the_shared_stream_in_step() -> None:
    x = torch.randn(2, 8, 16)
    outs, after = {}, {}
    for stream in (0, 1, 2):
        attn = _attn(stream)
        torch.manual_seed(123)
        outs[stream] = attn(x)
        after[stream] = torch.rand(1)  # the shared stream's next draw after the attention call
    assert not torch.equal(outs[1], outs[2]) and not torch.equal(outs[0], outs[1])
    assert torch.equal(after[1], after[2])  # both advanced the shared stream by the same one draw
    attn = _attn(1)
    torch.manual_seed(123)
    assert torch.equal(attn(x), outs[1])  # reproducible from the shared stream


@pytest.mark.parametrize("stream", [0, 1])
def test_activation_checkpoint_recompute_replays_dropout_streams(stream: int) -> None:
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(2, 8, 16)
    grads = []
    for use_ckpt in (False, True):
        attn = _attn(stream)
        torch.manual_seed(5)
        y = checkpoint(attn, x, use_reentrant=False) if use_ckpt else attn(x)
        y.square().sum().backward()
        grads.append([p.grad.clone() for p in attn.parameters()])
    for g0, g1 in zip(*grads, strict=True):
        torch.testing.assert_close(g1, g0, rtol=0, atol=0)


def test_gpt_dropout_modules_take_a_stream() -> None:
    model = GPT(ModelConfig(n_layer=1, d_model=16, n_head=2, seq_len=8, dropout=0.1))
    assert model.drop.stream == 0 and model.blocks[0].drop.stream == 0 and model.blocks[0].attn.dropout_stream == 0
