"""Settings that act on each torchft replica group's own gradient synchronisation (``fault.mode = "replicas"``, ``plait
run --replicas 2 --nproc 2``: 2 groups x 2 ranks; tests/fault/replica_settings_script.py is the user's loop, 3 AdamW
steps on a small MLP, the global batch of 16 as 4 shares of 4): the group's own all-reduce takes the setting, then
torchft averages the result over the groups in float32, as without it.

One launch for every run here:

- ``ring_syncbn``: ``comm.allreduce=ring``, ``parallel.sync_batchnorm`` and the policy named
  (``parallel.strategy=data``), the MLP with a BatchNorm layer. Against the user's plain loop: each group's 8 samples
  through the model as one batch (SyncBatchNorm normalises over the group's ranks; torchft's groups meet only in the
  gradient average, not in a forward), the loss the mean of the two groups', the running statistics the mean of the
  two groups' updates from the same start (the driver averages them over the groups). Its first Linear has no bias:
  BatchNorm would cancel it, leaving it a gradient of rounding noise that AdamW moves by ~lr.
- ``ddp``: ``parallel.impl=torch`` (PyTorch DDP inside each group). Against the user's plain loop on the 16 samples.
- ``powersgd``: ``comm.compress=powersgd`` at rank 2, lossy here (the MLP's 32 x 8 weight gradient from 8 samples).
  The reference is plait's own 1-group PowerSGD run, honestly: the user's plain loop on two model copies in a spawned
  2-rank world, each copy's gradients (group g's rank j samples on rank j) averaged by plait's reducer with PowerSGD
  (``GradReducer``, what a 2-rank group builds: the same buckets, seed, warm-started Q and error feedback), then the
  exact float32 mean of the two copies' averages (torchft's), AdamW on it. The same operations in the same order:
  held exactly equal (losses, gradients at step 1, parameters after 3 steps); and the compressed gradients differ from
  the uncompressed mean by more than 1e-3 (the compression is on and lossy, so the check could fail).

Bounds (ring_syncbn, ddp: the group's reduction, then the groups' average, against one backward over the batch):
losses within 1e-6, every gradient at step 1 within 5e-7 (float32 rounding of sums of ~16 terms of size ~1), every
entry after 3 steps within 1e-6 beyond its AdamW slack (``references.adam_slack`` for gradients off by 5e-7; near a
zero gradient AdamW's first update's slope is lr / eps; BatchNorm's running statistics have none). The four ranks'
step-1 gradients and final states are bit-identical; each run's records show the setting in effect (ring algorithm,
SyncBatchNorm layers, the named policy, DDP's engine, the PowerSGD compressor and fewer bytes on the wire than the
fp32 reduction).
Measured: losses 4.5e-8 and 7.5e-8, gradients 1.2e-7 and 6.0e-8, entries 2.4e-7 (a running mean) and 1.0e-8 beyond
the slack (ring_syncbn, ddp); PowerSGD's step-1 gradients 2.9e-2 from the uncompressed mean, 1864 bytes on the wire
per step against DDP's 3852.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import launch_replicas, run_ranks
from references import adam_slack, beyond_slack
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
pytest.importorskip("torchft", reason="fault.mode=replicas needs torchft (pip install 'plait[ft]')")

from replica_settings_script import LR, RUNS, STEPS, adamw, build, data  # noqa: E402

SCRIPT = Path(__file__).with_name("replica_settings_script.py")
RANKS = [(g, r) for g in (0, 1) for r in (0, 1)]
LOSS_ATOL, GRAD_ATOL, PARAM_ATOL = 1e-6, 5e-7, 1e-6


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("replicas_settings")
    found = launch_replicas(out, "--replicas", "2", "--nproc", "2", str(SCRIPT), str(out), ",".join(RUNS))
    assert found["rc"] == 0, found["log"][-3000:]
    return {run: {gr: torch.load(out / f"{run}_g{gr[0]}r{gr[1]}.pt") for gr in RANKS} for run in RUNS}


def _common(ranks: dict) -> tuple[dict, list[list[list[list[int]]]]]:
    """The start every rank holds (checked one), and each step's sample ids by group and rank (checked that every
    rank trained on its own 4 and every group was live)."""
    start = ranks[(0, 0)]["start"]
    assert all(torch.equal(x["start"][k], v) for x in ranks.values() for k, v in start.items())
    assert all(len(x["steps"]) == STEPS and all(s["live"] == 2 for s in x["steps"]) for x in ranks.values())
    batches = [[[ranks[(g, r)]["steps"][s]["ids"] for r in (0, 1)] for g in (0, 1)] for s in range(STEPS)]
    assert all(len({i for g in b for ids in g for i in ids}) == 16 for b in batches)
    return start, batches


def _identical(ranks: dict, key: str) -> dict:
    first = ranks[(0, 0)][key]
    assert all(x[key].keys() == first.keys() and all(torch.equal(x[key][k], v) for k, v in first.items())
               for x in ranks.values()), key
    return first


def _plain_loop(run: str, start: dict, batches: list) -> tuple[list[float], dict, dict, dict]:
    """The user's loop in one process: per step each group's 8 samples through the model as one batch, the loss the
    mean of the groups', AdamW; BatchNorm's running statistics the mean of the groups' updates from the same start.
    Returns the losses, the gradients at step 1, the final state and each parameter's AdamW slack."""
    x, y, _ = data().tensors
    model = build(run)
    model.load_state_dict(start)
    opt = adamw(model)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    losses, grads, slack = [], {}, {}
    for step, groups in enumerate(batches, 1):
        before = [{k: v.clone() for k, v in m.state_dict().items() if "running" in k or "tracked" in k} for m in bns]
        after, total = [], 0.0
        for ranks in groups:
            ids = ranks[0] + ranks[1]
            for m, b in zip(bns, before, strict=True):
                m.load_state_dict({**m.state_dict(), **b})
            loss = nn.functional.mse_loss(model(x[ids]), y[ids])
            (loss / 2).backward()
            total += loss.item() / 2
            after.append([{k: v.clone() for k, v in m.state_dict().items()} for m in bns])
        with torch.no_grad():
            for i, m in enumerate(bns):
                m.running_mean.copy_((after[0][i]["running_mean"] + after[1][i]["running_mean"]) / 2)
                m.running_var.copy_((after[0][i]["running_var"] + after[1][i]["running_var"]) / 2)
            for n, q in model.named_parameters():
                slack[n] = slack.get(n, 0.0) + adam_slack(opt, q, step, GRAD_ATOL)
        if step == 1:
            grads = {n: q.grad.clone() for n, q in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, grads, model.state_dict(), slack


@pytest.mark.parametrize("run", ["ring_syncbn", "ddp"])
def test_group_settings_equal_the_plain_loop(launched: dict, run: str) -> None:
    ranks = launched[run]
    facts = ranks[(0, 0)]["facts"]
    assert all(x["facts"] == facts for x in ranks.values())
    if run == "ddp":
        assert facts["engine"] == "TorchDDP" and facts["policy"] == "ddp"
    else:
        assert facts["algorithm"] == "ring" and facts["policy"] == "data" and facts["batchnorm"] == ["SyncBatchNorm"]
    start, batches = _common(ranks)
    losses, grads, final, slack = _plain_loop(run, start, batches)
    mean = [sum(ranks[gr]["steps"][s]["loss"] for gr in RANKS) / 4 for s in range(STEPS)]
    assert mean == pytest.approx(losses, abs=LOSS_ATOL)
    got = _identical(ranks, "grads")
    assert got.keys() == grads.keys()
    assert max(float((got[k] - v).abs().max()) for k, v in grads.items()) < GRAD_ATOL
    state = _identical(ranks, "final")
    assert beyond_slack(state, final, slack) < PARAM_ATOL
    assert max(float((state[k] - start[k]).abs().max()) for k in state) > LR  # it trained


def _powersgd_reference(rank: int, world: int, start: dict, batches: list) -> dict:
    """Rank ``rank`` of both groups in one process: two copies of the model, each copy's gradients averaged over the
    2 ranks by plait's reducer with PowerSGD (as in a group of 2), then the exact mean of the copies' (torchft's), the
    user's AdamW on it, both copies then holding its weights."""
    import torch.distributed as dist

    from plait.comm.collectives import comm_from_config
    from plait.config import from_sections
    from plait.parallel.data.reducer import GradReducer

    cfg = from_sections({"comm": RUNS["powersgd"]["comm"]})
    comm = comm_from_config(cfg.comm, cfg.train.seed, rank, 1)
    x, y, _ = data().tensors
    copies = [build("powersgd") for _ in range(2)]
    for m in copies:
        m.load_state_dict(start)
    reducers = [GradReducer(m, dist.group.WORLD, comm, cfg.parallel.bucket_mb, broadcast=False) for m in copies]
    opt = adamw(copies[0])
    losses, grads = [], {}
    for step, groups in enumerate(batches, 1):
        own = []
        for m, reducer, ranks in zip(copies, reducers, groups, strict=True):
            ids = ranks[rank]
            loss = nn.functional.mse_loss(m(x[ids]), y[ids])
            loss.backward()
            reducer.finish()
            own.append(loss.item())
        losses.append(own)
        with torch.no_grad():
            for a, b in zip(copies[0].parameters(), copies[1].parameters(), strict=True):
                a.grad.copy_((a.grad + b.grad) / 2)
        if step == 1:
            grads = {n: q.grad.clone() for n, q in copies[0].named_parameters()}
        opt.step()
        with torch.no_grad():
            for a, b in zip(copies[0].parameters(), copies[1].parameters(), strict=True):
                b.copy_(a)
        for reducer in reducers:
            reducer.zero_grad()
    comm.close()
    return {"losses": losses, "grads": grads, "final": copies[0].state_dict()}


def test_powersgd_compresses_each_group_as_its_own_run(launched: dict) -> None:
    ranks = launched["powersgd"]
    assert all(x["facts"]["compressors"] == ["powersgd"] for x in ranks.values())
    start, batches = _common(ranks)
    ref = run_ranks(_powersgd_reference, 2, start, batches)
    for (g, r), x in ranks.items():
        assert [s["loss"] for s in x["steps"]] == [losses[g] for losses in ref[r]["losses"]]
    got = _identical(ranks, "grads")
    assert all(torch.equal(got[k], v) for k, v in ref[0]["grads"].items())
    state = _identical(ranks, "final")
    assert all(torch.equal(state[k], v) for k, v in ref[0]["final"].items())
    _, exact, _, _ = _plain_loop("powersgd", start, batches)  # the uncompressed mean: compression changed it
    assert max(float((got[k] - v).abs().max()) for k, v in exact.items()) > 1e-3
    # comm_bytes: the group's compressed all-reduce and torchft's fp32 average, against the ddp run's fp32 both
    assert ranks[(0, 0)]["steps"][0]["comm_bytes"] < launched["ddp"][(0, 0)]["steps"][0]["comm_bytes"]
