"""Replica groups of several ranks, sharded or model-parallel inside (``fault.mode = "replicas"``, ``plait run
--replicas 2 --nproc 2``: 2 torchft replica groups x 2 ranks; tests/fault/replica_sharded_script.py is the user's
loop).

One launch for every test here (tests/fault/replica_sharded_script.py runs the failure-free runs, then the one with a
failure; only the killed group's replacement skips to the latter). Failure-free, ZeRO-1, ZeRO-2 and FSDP2 (zero=3)
inside each group, and data parallelism with plait's reducer (zero=0): every rank of every group starts from the same
weights after the first quorum (group 0's where the ranks hold the whole model), and the run equals the user's plain
single-process loop (AdamW on the 16 samples the four ranks read at each step, from those weights): the mean of the
four ranks' losses within 1e-6 and every parameter after 4 steps within 1e-5 (float rounding: the group's reduction,
then torchft's average over the groups, against one backward over the whole batch); the four ranks' full weights are
bit-identical. Tensor parallelism (tp=2) and pipeline parallelism (pp=2, 1F1B) inside each group, on plait's tiny GPT
(embedding and head tied): the two ranks of a group read the same samples (one data-parallel rank per group), the
start is one model on every rank with its tie intact (under pp the head's copy on the last stage equals the
embedding on the first, though torchft healed the two stages from different groups), and the run equals the plain
loop: the mean of the groups' losses within 5e-6 and every parameter after 4 steps within 5e-5 (measured: 5e-7 and
1.4e-5; one AdamW step at lr 1e-2 moves weights ~1e-2). Checkpoints: each group saves its own (sharded) one; a
resumed run where group 1 loads an older checkpoint than group 0 heals group 1 at the load (weights, optimizer state,
step and data position), and ends its next step where the uninterrupted run did (1e-6).

A failure, ZeRO-2 inside each group (tp=2 or pp=2 with PLAIT_TEST_REPLICA_KILL_LAYOUT=tp or pp): rank 1 of group 1
SIGKILLed mid-run. Group 0's processes are the same ones throughout (one pid per rank), its step count only goes up
and it trains alone while group 1 is away; group 1's agent restarts both its ranks, each heals from the same rank of
group 0 (joining at group 0's step, not 0), and at the end each rank's shards (the whole model and its optimizer-
state shard, or its tensor-parallel shard or pipeline stage and their optimizer states) are bit-identical to its
peer's in group 0.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from helpers import jsonl_records, launch_replicas
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
pytest.importorskip("torchft", reason="fault.mode=replicas needs torchft (pip install 'plait[ft]')")

SCRIPT = Path(__file__).with_name("replica_sharded_script.py")
RANKS = [(g, r) for g in (0, 1) for r in (0, 1)]
STEPS, KILL_AT, MIN_STEPS = 4, 6, 20
ZEROS, MODEL_PARALLEL = ["0", "1", "2", "3"], ["tp", "pp"]
# the layout of the run with a failure: ZeRO-2 in the suite; tp or pp (the same checks pass) with this variable set
KILL_LAYOUT = os.environ.get("PLAIT_TEST_REPLICA_KILL_LAYOUT", "2")


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    """One launch for every test here: the compared runs, then the run whose rank 1 of group 1 is killed."""
    out = tmp_path_factory.mktemp("replicas_sharded")
    return launch_replicas(out, "--replicas", "2", "--nproc", "2", "--max-restarts", "1", str(SCRIPT), str(out),
                           ",".join(ZEROS + MODEL_PARALLEL), str(STEPS), KILL_LAYOUT, str(MIN_STEPS),
                           kill=("kill_g1r1.jsonl", KILL_AT))


def _reference(start: dict[str, torch.Tensor], batches: list[list[int]], gpt: bool = False
               ) -> tuple[list[float], dict]:
    """The user's plain loop: one process, AdamW, each step's whole global batch (the MLP's mean squared error, or
    the GPT's next-token cross-entropy)."""
    from replica_sharded_script import build, build_gpt, data, gpt_data

    x, y, _ = (gpt_data() if gpt else data()).tensors
    model = build_gpt() if gpt else build()
    model.load_state_dict(start)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for ids in batches:
        out = model(x[ids])
        if gpt:
            loss = nn.functional.cross_entropy(out.view(-1, out.size(-1)), y[ids].reshape(-1))  # (B T, V)
        else:
            loss = nn.functional.mse_loss(out, y[ids])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_sharded_groups_equal_the_plain_loop(launched: dict, zero: int) -> None:
    out = launched["out"]
    assert launched["rc"] == 0, launched["log"][-3000:]
    starts = [torch.load(out / f"z{zero}_start_g{g}r{r}.pt") for g, r in RANKS]
    assert all(torch.equal(s[k], starts[0][k]) for s in starts for k in starts[0])  # one start everywhere
    if zero < 3:  # the whole model on every rank: group 0's rank 0's (seed 0) (FSDP2: each shard from one group)
        from replica_sharded_script import build

        torch.manual_seed(0)
        assert all(torch.equal(v, starts[0][k]) for k, v in build().state_dict().items())
    # Plait.reduce within a group (2 ranks): a mean of ones is 1 (it was 1/2: divided by both groups' ranks)
    assert all(r["reduce"] == [1.0, 2.0, 1.0] for gr in RANKS
               for r in jsonl_records(out / f"z{zero}_g{gr[0]}r{gr[1]}.jsonl") if "joined_at" in r)
    recs = {gr: [r for r in jsonl_records(out / f"z{zero}_g{gr[0]}r{gr[1]}.jsonl") if "step" in r] for gr in RANKS}
    assert all([r["step"] for r in rs] == list(range(1, STEPS + 1)) for rs in recs.values())
    assert all(r["live"] == 2 for rs in recs.values() for r in rs)
    batches = [sorted(i for rs in recs.values() for i in rs[s]["ids"]) for s in range(STEPS)]
    assert all(len(set(b)) == 16 for b in batches) and len({i for b in batches for i in b}) == 16 * STEPS
    losses, final = _reference(starts[0], batches)
    mean = [sum(rs[s]["loss"] for rs in recs.values()) / 4 for s in range(STEPS)]
    assert mean == pytest.approx(losses, abs=1e-6)
    fulls = [torch.load(out / f"z{zero}_full_g{g}r{r}.pt") for g, r in RANKS]
    assert all(torch.equal(f[k], fulls[0][k]) for f in fulls for k in fulls[0])
    for k, v in final.items():
        torch.testing.assert_close(fulls[0][k], v, rtol=0, atol=1e-5, msg=f"{k} after {STEPS} steps")
    assert max((fulls[0][k] - starts[0][k]).abs().max() for k in final) > 1e-3  # it trained


@pytest.mark.parametrize("layout", MODEL_PARALLEL)
def test_model_parallel_groups_equal_the_plain_loop(launched: dict, layout: str) -> None:
    """tp=2 or pp=2 inside each of 2 groups of 2 ranks against the plain loop (module docstring)."""
    out = launched["out"]
    assert launched["rc"] == 0, launched["log"][-3000:]
    starts = [torch.load(out / f"{layout}_start_g{g}r{r}.pt") for g, r in RANKS]
    assert all(torch.equal(s[k], starts[0][k]) for s in starts for k in starts[0])  # one start everywhere
    assert torch.equal(starts[0]["head.weight"], starts[0]["tok_emb.weight"])  # the tie, across stages under pp
    # Plait.reduce within a group: over its data-parallel ranks, one here (the two ranks are one model)
    assert all(r["reduce"] == [1.0, 1.0, 1.0] for gr in RANKS
               for r in jsonl_records(out / f"{layout}_g{gr[0]}r{gr[1]}.jsonl") if "joined_at" in r)
    recs = {gr: [r for r in jsonl_records(out / f"{layout}_g{gr[0]}r{gr[1]}.jsonl") if "step" in r] for gr in RANKS}
    assert all([r["step"] for r in rs] == list(range(1, STEPS + 1)) for rs in recs.values())
    assert all(r["live"] == 2 for rs in recs.values() for r in rs)
    for g in (0, 1):  # a group's two ranks read the same samples: one data-parallel rank
        assert [r["ids"] for r in recs[(g, 0)]] == [r["ids"] for r in recs[(g, 1)]]
    batches = [sorted(i for g in (0, 1) for i in recs[(g, 0)][s]["ids"]) for s in range(STEPS)]
    assert all(len(set(b)) == 16 for b in batches) and len({i for b in batches for i in b}) == 16 * STEPS
    if layout == "pp":  # the loss is the last stage's (rank 1): 0 on the first
        assert all(r["loss"] == 0.0 for g in (0, 1) for r in recs[(g, 0)])
    else:  # both tensor-parallel ranks compute the group's loss
        assert all([r["loss"] for r in recs[(g, 0)]] == [r["loss"] for r in recs[(g, 1)]] for g in (0, 1))
    losses, final = _reference(starts[0], batches, gpt=True)
    mean = [sum(recs[(g, 1)][s]["loss"] for g in (0, 1)) / 2 for s in range(STEPS)]
    assert mean == pytest.approx(losses, abs=5e-6)
    fulls = [torch.load(out / f"{layout}_full_g{g}r{r}.pt") for g, r in RANKS]
    assert all(torch.equal(f[k], fulls[0][k]) for f in fulls for k in fulls[0])
    assert fulls[0].keys() == final.keys()
    for k, v in final.items():
        torch.testing.assert_close(fulls[0][k], v, rtol=0, atol=5e-5, msg=f"{k} after {STEPS} steps")
    assert max((fulls[0][k] - starts[0][k]).abs().max() for k in final) > 1e-2  # it trained


@pytest.mark.parametrize("layout", ZEROS + MODEL_PARALLEL)
def test_resumed_groups_heal_to_the_newest_checkpoint(launched: dict, layout: str) -> None:
    """Each group loads its own checkpoint (group 1 an older one, into fresh weights of another seed): after the
    load every rank is at group 0's step and data position, and the last step taken again ends where the run that
    was not interrupted ended (within 1e-6)."""
    out, name = launched["out"], layout if layout in MODEL_PARALLEL else f"z{layout}"
    assert launched["rc"] == 0, launched["log"][-3000:]
    resumed = [torch.load(out / f"{name}_resumed_g{g}r{r}.pt") for g, r in RANKS]
    assert [(x["loaded"], x["steps"], x["live"]) for x in resumed] == [(STEPS - 1, STEPS, 2)] * 4
    for (g, r), x in zip(RANKS, resumed, strict=True):  # the data position is group 0's too: the same shares
        last = [rec for rec in jsonl_records(out / f"{name}_g{g}r{r}.jsonl") if rec.get("step") == STEPS]
        assert x["ids"] == last[0]["ids"]
    full = torch.load(out / f"{name}_full_g0r0.pt")
    for k, v in full.items():
        assert all(torch.equal(x[k], resumed[0][k]) for x in resumed)
        torch.testing.assert_close(resumed[0][k], v, rtol=0, atol=1e-6, msg=f"{k} after the resumed step")


def test_killed_rank_of_a_sharded_group_heals_per_rank(launched: dict) -> None:
    out = launched["out"]
    assert launched["rc"] == 0, launched["log"][-3000:]
    assert launched["killed"] is not None
    kill_step = launched["killed"][1]
    for r in (0, 1):
        survivor = [x for x in jsonl_records(out / f"kill_g0r{r}.jsonl") if "step" in x]
        assert len({x["pid"] for x in survivor}) == 1  # never restarted
        steps = [x["step"] for x in survivor]
        assert steps == list(range(1, len(steps) + 1))  # one record per step, never going back
        assert any(x["live"] == 1 for x in survivor if x["step"] > kill_step)  # trained on alone
        group1 = jsonl_records(out / f"kill_g1r{r}.jsonl")
        pids = list(dict.fromkeys(x["pid"] for x in group1))
        assert len(pids) == 2  # the agent restarted both ranks of group 1
        joined = next(x["joined_at"] for x in group1 if x.get("pid") == pids[1] and "joined_at" in x)
        assert joined > kill_step  # healed to the survivor's step, not restarted from 0
        after = [x for x in group1 if x.get("pid") == pids[1] and "step" in x]
        assert after[0]["step"] == joined + 1 and after[-1]["step"] == steps[-1]
        a, b = torch.load(out / f"final_g0r{r}.pt"), torch.load(out / f"final_g1r{r}.pt")
        assert a.keys() == b.keys() and any(k.startswith("optim.") for k in a)
        assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    shards = [torch.load(out / f"final_g0r{r}.pt") for r in (0, 1)]  # each rank its own optimizer shard (or stage)
    assert not torch.equal(shards[0]["optim.0.exp_avg"], shards[1]["optim.0.exp_avg"])
    assert len(launched["log"].split("healed from a live replica: joins at step")) >= 3  # the start, the heal
