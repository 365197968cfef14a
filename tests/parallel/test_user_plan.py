"""Settings on a user's model that is neither plait's GPT nor a Hugging Face model (``tests/fused_model.py``: blocks in
a ``ModuleDict``, as torchtitan keeps them) take effect or are refused (2 ranks, one spawned group):

* ``parallel.sequence_parallel`` with the user's own tp plan: a plan that splits no sequence is refused in one line
  on every rank; the plan that does (``sp_plan``) runs the first norm on a sequence shard (``T / 2`` tokens) and
  trains like one process.
* blocks in a ``ModuleDict`` are found: ZeRO-3 makes each one an FSDP unit (and says so in the log), activation
  checkpointing wraps each one for recomputation; trained like one process.
* a Linear or Embedding style on a module whose forward is its own (torchtitan's ``Embedding`` reads
  ``weight.to_local()`` itself) is refused by name, before any collective.
* a spec registered for the user's class (``plait.register_train_spec``) gives ``parallel.tp_plan = "auto"`` its
  tensor-parallel plan: called once per rank with the tp mesh and the parallel config, and trained like one process.

Reference: the same model, seeded, trained in plain PyTorch over the global batches plait's loader forms; losses
and parameters after 2 AdamW steps within ``tests/fused_model.py``'s bounds (sums in another order).
"""

from __future__ import annotations

import logging

import pytest
import torch
from fused_model import (
    ATOL,
    GLOBAL,
    LOSS_RTOL,
    LR,
    SEED,
    SEQ,
    STEPS,
    TP_PLAN,
    FusedDecoder,
    dataset,
    sp_plan,
    user_loss,
)
from helpers import run_ranks
from torch import nn

from plait.config import ConfigError

CASES = {"tp2-sp": ({"tp": 2, "sequence_parallel": True}, 8, "sp"),
         "zero3-ac": ({"zero": 3}, 4, None),
         "tp2-spec": ({"tp": 2}, 8, "registered")}


class RegisteredDecoder(FusedDecoder):
    """The same model under a class of its own, for which the test registers a spec."""


CALLS: list[tuple[int, int]] = []  # (tp mesh size, parallel.tp) of each call of the registered plan


def registered_plan(model: nn.Module, tp_mesh, p) -> nn.Module:
    """``TP_PLAN`` as torch's own styles, the way a user's spec writes its plan."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    CALLS.append((tp_mesh.size(), p.tp))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return parallelize_module(model, tp_mesh, {name: styles[style]() for name, style in TP_PLAN.items()})


def seeded(cls: type = FusedDecoder) -> FusedDecoder:
    torch.manual_seed(0)
    return cls()


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def train(name: str, root: str) -> dict:
    import plait

    parallel, micro, plan = CASES[name]
    p = plait.Plait(parallel=parallel, run={"dir": f"{root}/{name}"}, optim={"grad_clip": 1.0},
                    train={"global_batch_size": GLOBAL, "micro_batch_size": micro, "seed": SEED,
                           "activation_checkpointing": "full" if name.endswith("-ac") else "none"},
                    observe={"progress": False, "trackers": []})
    lines = Lines()
    logging.getLogger("plait").addHandler(lines)
    if plan == "registered":
        plait.register_train_spec(RegisteredDecoder, plait.TrainSpec(parallelize=registered_plan))
    model = seeded(RegisteredDecoder if plan == "registered" else FusedDecoder)
    seen: list[tuple[int, ...]] = []  # the first norm's input as this rank holds it
    model.layers["0"].attention_norm.register_forward_pre_hook(lambda m, args: seen.append(tuple(args[0].shape)))
    model, _ = p.setup(model, optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=LR),
                       tp_plan=sp_plan() if plan == "sp" else None)
    wqkv = model.layers["0"].attention.qkv.wqkv.weight
    wqkv = tuple(wqkv.to_local().shape if hasattr(wqkv, "to_local") else wqkv.shape)
    logging.getLogger("plait").removeHandler(lines)
    losses = []
    for batch in p.setup_dataloader(dataset()):
        p.backward(user_loss(model, batch))
        info = p.step()
        if info is not None:
            losses.append(info.global_loss)
        if p.steps == STEPS:
            break
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule

    layers = list(model.layers.values())
    out = {"losses": losses, "state": p.full_state_dict(model), "seen": seen[0], "log": lines.lines,
           "units": [isinstance(b, FSDPModule) for b in layers],
           "recomputed": [isinstance(b, CheckpointWrapper) for b in layers], "calls": list(CALLS), "wqkv": wqkv}
    p.close()
    return out


def refused(root: str) -> str:
    import plait

    p = plait.Plait(parallel={"tp": 2, "sequence_parallel": True}, run={"dir": f"{root}/refused"},
                    train={"global_batch_size": GLOBAL, "micro_batch_size": 8}, observe={"progress": False,
                                                                                          "trackers": []})
    try:
        p.setup(seeded(), tp_plan=TP_PLAN)
        return "set up"
    except ConfigError as e:
        return str(e)
    finally:
        p.barrier()
        p.close()


def _worker(rank: int, world: int, root: str) -> dict:
    return {**{name: train(name, root) for name in CASES}, "refused": refused(root)}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(_worker, 2, str(tmp_path_factory.mktemp("user_plan")), timeout=600)


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict]:
    from plait.data.loader import DistributedBatchSampler

    model = seeded()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    data, losses = dataset(), []
    for idx in DistributedBatchSampler(len(data), GLOBAL, dp_rank=0, dp_size=1, seed=SEED).batches(0)[:STEPS]:
        loss = user_loss(model, data[idx])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _diff(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max((got[k] - want[k]).abs().max().item() for k in want)


def test_trained_like_one_process(results, reference) -> None:
    losses, state = reference
    for name in CASES:
        for r in results:
            assert r[name]["losses"] == pytest.approx(losses, rel=LOSS_RTOL), name
            assert _diff(r[name]["state"], state) <= ATOL, name


def test_sequence_parallel_splits_the_users_plan(results) -> None:
    micro = CASES["tp2-sp"][1]
    for r in results:
        assert r["tp2-sp"]["seen"] == (micro, SEQ // 2, 32)  # this rank's half of the sequence
        assert r["zero3-ac"]["seen"] == (CASES["zero3-ac"][1], SEQ, 32)
        assert "splits no sequence" in r["refused"] and "sequence_parallel=false" in r["refused"]


def test_registered_spec_gives_the_plan(results) -> None:
    for r in results:
        assert r["tp2-sp"]["calls"] == [] and r["tp2-spec"]["calls"] == [(2, 2)]
        assert r["tp2-spec"]["wqkv"] == (3 * 32 // 2, 32)  # this rank's half of the fused q, k, v rows


def test_module_dict_blocks_are_units(results) -> None:
    r = results[0]["zero3-ac"]
    assert r["units"] == [True, True] and r["recomputed"] == [True, True]
    assert any("ZeRO-3 shards layers.0 .. layers.1 (2 Block) as one unit each" in line for line in r["log"]), r["log"]


class OwnEmbedding(nn.Embedding):
    """An embedding that reads its weight's local shard itself, as torchtitan's does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.to_local() if hasattr(self.weight, "to_local") else self.weight
        return nn.functional.embedding(x, w)


def test_style_refused_where_the_forward_is_its_own() -> None:
    from plait.parallel.tensor.plan import TensorParallelError, validate_plan

    model = nn.Sequential(OwnEmbedding(8, 4), nn.Linear(4, 4))
    with pytest.raises(TensorParallelError, match=r"'0' -> vocab: 0 is a .*OwnEmbedding, whose forward is its own"):
        validate_plan(model, {"0": "vocab"}, 2)
    validate_plan(model, {"1": "colwise"}, 2)  # torch's own Linear: taken

