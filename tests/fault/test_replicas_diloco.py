"""DiLoCo with torchft replica groups (``parallel.sync = "diloco"``, ``fault.mode = "replicas"``): each of 2 groups of
2 ranks (``plait run --replicas 2 --nproc 2``; tests/fault/replica_diloco_script.py is the user's loop) is one DiLoCo
replica, ZeRO-1 over its 2 ranks inside, H = 2, 4 steps; one launch for every test here.

Checked: torchft's per-step gradient average is off and the outer all-reduce goes over torchft's live groups: the run
equals a single-process DiLoCo of 2 replicas in plain PyTorch (each its own AdamW on the 8 samples its group's ranks
read at each step, torch's Nesterov SGD (0.7, 0.9) on their mean every 2 steps), from the weights every group starts
from after the first quorum: the mean of the four ranks' losses within 1e-6 and every parameter after 4 steps within
1e-5 (float rounding: the group's ZeRO reduction of its two ranks' gradients against one backward over the 8 samples);
the four ranks' weights are bit-identical after each synchronisation (steps 2 and 4). The losses of steps 2 and 4 are
those of replicas that trained apart since the last synchronisation: a per-step average over the groups would have
given both groups one model (checked: their losses at those steps differ).

A heal carries DiLoCo's state: in a resumed run group 0 loads its checkpoint of step 2 (a synchronisation) and group 1
an older one (step 1, one step into the first period), into fresh weights of other seeds; at the load group 1 heals
from group 0: both hold the first synchronisation's weights at step 2, and after steps 3 and 4 the four ranks are
bit-identical (a heal without the outer momentum would leave group 1's outer step, and so its weights, different) and
equal the reference in which replica 1 takes replica 0's inner optimizer state at step 2 (what the heal gives it)
within 1e-5.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from helpers import jsonl_records, launch_replicas
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
pytest.importorskip("torchft", reason="fault.mode=replicas needs torchft (pip install 'plait[ft]')")

SCRIPT = Path(__file__).with_name("replica_diloco_script.py")
RANKS = [(g, r) for g in (0, 1) for r in (0, 1)]
STEPS = 4


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("replicas_diloco")
    return launch_replicas(out, "--replicas", "2", "--nproc", "2", str(SCRIPT), str(out), str(STEPS))


def _reference(start: dict[str, torch.Tensor], batches: list[list[list[int]]], heal_at: int = 0
               ) -> tuple[list[float], dict[int, dict[str, torch.Tensor]]]:
    """Single-process DiLoCo: replica g trains on ``batches[step][g]``; every H = 2 steps torch's Nesterov SGD on the
    replicas' mean. ``heal_at``: after that step's synchronisation replica 1 takes replica 0's inner optimizer state.
    Returns the mean loss per step and the outer weights after each synchronisation."""
    from replica_diloco_script import H, adamw, build, data

    x, y, _ = data().tensors
    base = build()
    base.load_state_dict(start)
    replicas = [copy.deepcopy(base) for _ in range(2)]
    inner = [adamw(m) for m in replicas]
    outer = torch.optim.SGD(base.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    losses, synced = [], {}
    for step, groups in enumerate(batches, start=1):
        total = 0.0
        for m, opt, ids in zip(replicas, inner, groups, strict=True):
            loss = nn.functional.mse_loss(m(x[ids]), y[ids])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() / 2
        losses.append(total)
        if step % H:
            continue
        with torch.no_grad():
            for n, q in base.named_parameters():
                q.grad = q - torch.stack([dict(m.named_parameters())[n] for m in replicas]).mean(0)
            outer.step()
        for m in replicas:
            m.load_state_dict(base.state_dict())
        if step == heal_at:
            inner[1].load_state_dict(copy.deepcopy(inner[0].state_dict()))  # its own tensors
        synced[step] = {k: v.clone() for k, v in base.state_dict().items()}
    return losses, synced


def _records(out: Path, run: str) -> dict[tuple[int, int], list[dict]]:
    return {gr: jsonl_records(out / f"{run}_g{gr[0]}r{gr[1]}.jsonl") for gr in RANKS}


def _batches(recs: dict[tuple[int, int], list[dict]]) -> list[list[list[int]]]:
    """Per step, per group: the sample ids its two ranks read."""
    return [[recs[(g, 0)][s]["ids"] + recs[(g, 1)][s]["ids"] for g in (0, 1)] for s in range(STEPS)]


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=0, atol=atol) for k in a)


def test_each_group_is_a_diloco_replica(launched: dict) -> None:
    out = launched["out"]
    assert launched["rc"] == 0, launched["log"][-3000:]
    starts = [torch.load(out / f"start_g{g}r{r}.pt") for g, r in RANKS]
    assert all(torch.equal(s[k], starts[0][k]) for s in starts for k in starts[0])  # one start after the quorum
    recs = _records(out, "run")
    assert all([r["step"] for r in rs] == [1, 2, 3, 4] for rs in recs.values())
    assert all(r["live"] == 2 for rs in recs.values() for r in rs)
    assert all([r["synced"] for r in rs] == [False, True, False, True] for rs in recs.values())
    batches = _batches(recs)
    assert all(len(set(b[0] + b[1])) == 16 for b in batches)
    losses, synced = _reference(starts[0], batches)
    mean = [sum(rs[s]["loss"] for rs in recs.values()) / 4 for s in range(STEPS)]
    assert mean == pytest.approx(losses, abs=1e-6)
    for s in (1, 3):  # inside a period each group trains alone: different weights, so its own loss of its own data
        assert abs(recs[(0, 0)][s]["loss"] - recs[(1, 0)][s]["loss"]) > 1e-4
    fulls = [torch.load(out / f"full_g{g}r{r}.pt") for g, r in RANKS]
    assert all(torch.equal(f[k], fulls[0][k]) for f in fulls for k in fulls[0])
    assert _close(fulls[0], synced[STEPS], 1e-5)
    assert not _close(synced[2], synced[4], 1e-3)  # it trained between the synchronisations


def test_a_group_behind_heals_the_start_weights_and_the_outer_momentum(launched: dict) -> None:
    out = launched["out"]
    assert launched["rc"] == 0, launched["log"][-3000:]
    start = torch.load(out / "start_g0r0.pt")
    run = _records(out, "run")
    resumed = _records(out, "resumed")
    assert all([r["step"] for r in rs] == [3, 4] for rs in resumed.values())
    assert all([r["ids"] for r in resumed[gr]] == [r["ids"] for r in run[gr][2:]] for gr in RANKS)  # group 0's place
    _, synced = _reference(start, _batches(run))
    _, healed = _reference(start, _batches(run), heal_at=2)
    got = [torch.load(out / f"resumed_g{g}r{r}.pt") for g, r in RANKS]
    assert [x["steps"] for x in got] == [2] * 4
    for x in got:
        assert all(torch.equal(x["loaded"][k], got[0]["loaded"][k]) for k in x["loaded"])
        assert all(torch.equal(x["final"][k], got[0]["final"][k]) for k in x["final"])
    assert _close(got[0]["loaded"], synced[2], 1e-5)
    assert _close(got[0]["final"], healed[STEPS], 1e-5)
