"""Context and expert parallelism inside torchft replica groups (``fault.mode = "replicas"``, ``plait run --replicas 2
--nproc 2``: 2 groups x 2 ranks; tests/fault/replica_sharded_script.py is the user's loop, plait's tiny GPT through
``p.forward_backward``).

One launch for every test here: cp=2 with ``ring`` and with ``alltoall`` (the two ranks of a group cut the same
sequences), and ep=2 (each block's MLP 4 experts, 2 per token, balanced by bias, with DeepSeek-V3's sequence-wise
balance loss; the two ranks of a group are its two data-parallel ranks, each holding 2 of the experts), then the ep
run with a failure.

Failure-free: every rank of every group starts from one model after the first quorum (its embedding and head tied;
under ep each rank's experts the global experts of its place, from whichever group healed it), and the run equals
the user's plain single-process loop from those weights: AdamW on the 16 samples the groups read at each step (under
cp the two ranks of a group read the same 8; under ep each of the four ranks its own 4); under cp the whole batch's
mean cross-entropy; under ep each rank's 4 samples as one accumulation micro-step of a quarter (the balance loss is
each micro-batch's, as the four ranks compute it, its gradient scaled so too), and each expert's bias moved after
the step by the loads of all 16 samples (the driver sums the groups' loads; the test checks that one group's own
loads would have moved some bias another way, so biases balanced per group fail it).

Bounds: the mean of the four ranks' losses (a cp rank's is its shard's share of its group's) within 5e-6, and every
parameter after 4 steps within 5e-5 beyond its AdamW slack: the bounds of the tp and pp groups in
test_replicas_sharded (float rounding: the group's reduction over its dp x cp ranks, the experts' all-to-all, then
torchft's average over the groups, against one backward; one AdamW step at lr 1e-2 moves weights ~1e-2). The slack
(``references.adam_slack``) is how far AdamW moves an element whose gradient is off by 1e-7, the bound the cp tests
hold gradients to: an attention key bias (softmax does not see it: its gradient is 0 up to rounding) or a hidden unit
of an expert that few tokens reach has gradients near 0, where AdamW's first update has slope lr / eps. Measured:
losses 4.8e-7 (cp) and 1.2e-7 (ep); parameters 1.5e-5 (cp: a key bias, slack 2.6e-2) and 5.0e-5 (ep: an expert
weight, slack 1.4e-2), 1.5e-7 and 6.6e-6 beyond the slack. The four ranks' full weights (the experts gathered over
ep) are bit-identical.
Checkpoints: a resumed run where group 1 loads an older checkpoint than group 0 heals group 1 at the load and ends
its next step where the uninterrupted run did.

A failure, ep=2 inside each group (cp_ring with PLAIT_TEST_REPLICA_INSIDE_KILL=cp_ring): rank 1 of group 1 SIGKILLed
mid-run; group 0 trains alone meanwhile, group 1's agent restarts both its ranks, each heals from the same rank of
group 0 (rank k's experts from rank k's), and at the end each rank's model entries and optimizer states are
bit-identical to its peer's in group 0; under ep the two ranks of a group hold different experts and the same dense
weights.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from helpers import jsonl_records, launch_replicas
from references import adam_slack, beyond_slack
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
pytest.importorskip("torchft", reason="fault.mode=replicas needs torchft (pip install 'plait[ft]')")

SCRIPT = Path(__file__).with_name("replica_sharded_script.py")
RANKS = [(g, r) for g in (0, 1) for r in (0, 1)]
STEPS, KILL_AT, MIN_STEPS = 4, 5, 12
CP, LAYOUTS = ["cp_ring", "cp_alltoall"], ["cp_ring", "cp_alltoall", "ep"]
KILL_LAYOUT = os.environ.get("PLAIT_TEST_REPLICA_INSIDE_KILL", "ep")
GRAD_ROUNDING = 1e-7  # the bound the cp tests hold gradients to (tests/parallel/context/test_context.py)


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    """One launch for every test here: the compared runs, then the run whose rank 1 of group 1 is killed."""
    out = tmp_path_factory.mktemp("replicas_inside")
    return launch_replicas(out, "--replicas", "2", "--nproc", "2", "--max-restarts", "1", str(SCRIPT), str(out),
                           ",".join(LAYOUTS), str(STEPS), KILL_LAYOUT, str(MIN_STEPS),
                           kill=("kill_g1r1.jsonl", KILL_AT))


def _reference(start: dict[str, torch.Tensor], batches: list[list[list[int]]], moe: bool
               ) -> tuple[list[float], dict, dict, bool]:
    """The user's plain loop: one process, AdamW; each step's micro-batches (``batches[s]``: lists of sample ids, in
    ``RANKS`` order under ep) as accumulation micro-steps of ``1 / len``, the MoE balance loss's gradients scaled
    alike, the experts' biases moved after each step by the loads of all of them. Returns the losses, the final
    state, each parameter's ``adam_slack`` for gradients off by ``GRAD_ROUNDING``, summed over the steps, and whether
    the loads of one group's micro-batches alone would have moved some bias another way (what the groups would do if
    each balanced by its own counts)."""
    from replica_sharded_script import build_gpt, gpt_data

    from plait.nn import moe_layers

    x, y, _ = gpt_data().tensors
    model = build_gpt(moe=moe)
    model.load_state_dict(start)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, slack, apart = [], {}, False
    layers = moe_layers(model)
    for step, micro in enumerate(batches, 1):
        for layer in layers:
            layer.grad_scale = 1.0 / len(micro)
        total, loads = 0.0, []
        for ids in micro:
            out = model(x[ids])  # (B, T, V)
            loss = nn.functional.cross_entropy(out.view(-1, out.size(-1)), y[ids].reshape(-1))
            (loss / len(micro)).backward()
            total += loss.item() / len(micro)
            if layers:  # this micro-batch's expert loads
                loads.append(torch.stack([layer.load.clone() for layer in layers]) - sum(loads))
        for i, layer in enumerate(layers):
            whole = layer.load
            for group in (loads[:2], loads[2:]):  # RANKS order: group 0's two ranks, then group 1's
                own = sum(group)[i]
                apart |= bool((torch.sign(own.mean() - own) != torch.sign(whole.mean() - whole)).any())
            layer.update_bias(whole)
            layer.load.zero_()
        with torch.no_grad():
            for n, q in model.named_parameters():
                slack[n] = slack.get(n, 0.0) + adam_slack(opt, q, step, GRAD_ROUNDING)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, model.state_dict(), slack, apart


def _check_start(start: dict[str, torch.Tensor], ep: bool) -> None:
    """The start every rank holds: the dense weights group rank 0's, which are group 0's (seed 0), along cp too; each
    ep rank's experts those of its place (ep rank 1: global experts 2 and 3) from the group that healed it (seed 0 or
    1), not a copy of its peer's."""
    from replica_sharded_script import build_gpt

    seeds = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        seeds.append(build_gpt(moe=ep).state_dict())
    assert start.keys() == seeds[0].keys()
    for k, v in start.items():
        if ".experts." not in k:
            assert torch.equal(v, seeds[0][k]), k
            continue
        for place in (slice(0, 2), slice(2, 4)):
            assert any(torch.equal(v[place], s[k][place]) for s in seeds), (k, place)
        assert not torch.equal(v[:2], v[2:]), k


def _records(out: Path, name: str) -> dict:
    return {gr: [r for r in jsonl_records(out / f"{name}_g{gr[0]}r{gr[1]}.jsonl") if "step" in r] for gr in RANKS}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cp_and_ep_groups_equal_the_plain_loop(launched: dict, layout: str) -> None:
    out, ep = launched["out"], layout == "ep"
    assert launched["rc"] == 0, launched["log"][-3000:]
    starts = [torch.load(out / f"{layout}_start_g{g}r{r}.pt") for g, r in RANKS]
    assert all(torch.equal(s[k], starts[0][k]) for s in starts for k in starts[0])  # one start everywhere
    assert torch.equal(starts[0]["head.weight"], starts[0]["tok_emb.weight"])  # the tie
    _check_start(starts[0], ep)
    # Plait.reduce within a group: over its data-parallel ranks (ep: both; cp: one, the two ranks cut one sequence)
    assert all(r["reduce"] == ([1.0, 2.0, 1.0] if ep else [1.0, 1.0, 1.0]) for gr in RANKS
               for r in jsonl_records(out / f"{layout}_g{gr[0]}r{gr[1]}.jsonl") if "joined_at" in r)
    recs = _records(out, layout)
    assert all([r["step"] for r in rs] == list(range(1, STEPS + 1)) for rs in recs.values())
    assert all(r["live"] == 2 for rs in recs.values() for r in rs)
    if ep:  # four data-parallel ranks, each its own micro-batch
        batches = [[recs[gr][s]["ids"] for gr in RANKS] for s in range(STEPS)]
    else:  # a group's two cp ranks read the same samples
        assert all([r["ids"] for r in recs[(g, 0)]] == [r["ids"] for r in recs[(g, 1)]] for g in (0, 1))
        batches = [[sorted(i for g in (0, 1) for i in recs[(g, 0)][s]["ids"])] for s in range(STEPS)]
    assert all(len({i for ids in b for i in ids}) == 16 for b in batches)
    assert len({i for b in batches for ids in b for i in ids}) == 16 * STEPS
    losses, final, slack, apart = _reference(starts[0], batches, moe=ep)
    assert apart == ep  # the biases' moves need every group's counts: the groups' own would have differed
    mean = [sum(recs[gr][s]["loss"] for gr in RANKS) / 4 for s in range(STEPS)]
    assert mean == pytest.approx(losses, abs=5e-6)
    fulls = [torch.load(out / f"{layout}_full_g{g}r{r}.pt") for g, r in RANKS]
    assert all(torch.equal(f[k], fulls[0][k]) for f in fulls for k in fulls[0])
    assert beyond_slack(fulls[0], final, slack) < 5e-5
    assert max((fulls[0][k] - starts[0][k]).abs().max() for k in final) > 1e-2  # it trained


@pytest.mark.parametrize("layout", LAYOUTS)
def test_resumed_groups_heal_to_the_newest_checkpoint(launched: dict, layout: str) -> None:
    """Each group loads its own checkpoint (group 1 an older one, into fresh weights of another seed): after the
    load every rank is at group 0's step and data position, and the last step taken again ends where the run that
    was not interrupted ended (within 1e-6)."""
    out = launched["out"]
    assert launched["rc"] == 0, launched["log"][-3000:]
    resumed = [torch.load(out / f"{layout}_resumed_g{g}r{r}.pt") for g, r in RANKS]
    assert [(x["loaded"], x["steps"], x["live"]) for x in resumed] == [(STEPS - 1, STEPS, 2)] * 4
    for (g, r), x in zip(RANKS, resumed, strict=True):  # the data position is group 0's too: the same shares
        last = [rec for rec in jsonl_records(out / f"{layout}_g{g}r{r}.jsonl") if rec.get("step") == STEPS]
        assert x["ids"] == last[0]["ids"]
    full = torch.load(out / f"{layout}_full_g0r0.pt")
    for k, v in full.items():
        assert all(torch.equal(x[k], resumed[0][k]) for x in resumed)
        torch.testing.assert_close(resumed[0][k], v, rtol=0, atol=1e-6, msg=f"{k} after the resumed step")


def test_killed_rank_heals_its_experts_from_its_peer(launched: dict) -> None:
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
    ranks = [torch.load(out / f"final_g0r{r}.pt") for r in (0, 1)]
    assert torch.equal(ranks[0]["model.tok_emb.weight"], ranks[1]["model.tok_emb.weight"])  # dense: the same
    experts = "model.blocks.0.mlp.experts.w1"
    if KILL_LAYOUT == "ep":  # each rank its own 2 of the 4 experts
        assert ranks[0][experts].shape[0] == 2 and not torch.equal(ranks[0][experts], ranks[1][experts])
    assert len(launched["log"].split("healed from a live replica: joins at step")) >= 3  # the start, the heal


def test_cp_and_ep_group_sizes_are_checked() -> None:
    """A group must hold whole cp groups and ep data-parallel ranks: one message naming the degrees; both compose
    in groups of 2 (validated as the launcher does, for every rank of the run)."""
    from plait.config import ConfigError, from_sections
    from plait.parallel.replicas.topology import replica_degrees
    from plait.validate import validate

    cp = from_sections({"train": {"global_batch_size": 8}, "parallel": {"cp": 2, "dp_replicate": 2},
                        "fault": {"mode": "replicas"}})
    assert replica_degrees(cp, 4) == {"pp": 1, "dp_replicate": 2, "dp_shard": 1, "ep": 1, "cp": 2, "tp": 1}
    assert validate(cp, 4).parallel.dp == 2  # the cp ranks of a group read the same samples
    ep = from_sections({"train": {"global_batch_size": 8}, "parallel": {"ep": 2, "dp_replicate": 2},
                        "moe": {"num_experts": 4}, "fault": {"mode": "replicas"}})
    assert replica_degrees(ep, 4) == {"pp": 1, "dp_replicate": 2, "dp_shard": 1, "ep": 2, "cp": 1, "tp": 1}
    assert validate(ep, 4).parallel.dp == 4  # expert-parallel ranks are data-parallel ranks
    with pytest.raises(ConfigError, match=r"a replica group of 3 ranks does not divide by parallel.tp=1 x "
                                          r"parallel.pp=1 x parallel.cp=1 x parallel.ep=2 = 2"):
        validate(ep, 6)
    ep.parallel.dp_replicate = 0  # by default one group per ep data-parallel ranks
    assert replica_degrees(ep, 8)["dp_replicate"] == 4
