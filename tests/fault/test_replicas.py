"""Per-step fault tolerance on torchft (``fault.mode = "replicas"``): 2 replica groups of 1 rank under ``plait run
--replicas 2``, one SIGKILLed mid-run (tests/fault/replica_script.py is the user's loop).

Checked: the surviving group's process is the same one throughout (one pid in its records), its step count only goes
up and it keeps training while the other is away (steps with 1 live group); the killed group's agent starts a
replacement, which heals from the survivor (its first step continues the survivor's count) and both end with
bit-identical weights; ``num_items_in_batch`` divides by the group's own token count. Against the failure-free run
(the same loop as one process over the whole global batch, plait at world 1: data parallelism over the two halves is
the same update): until the kill the mean of the two groups' losses equals its loss within 1e-5 (float rounding of
the averaged gradient); at the end the loss over the whole data set is within 2% of the initial loss of the
failure-free run's at the same step (both fall ~100x from the initial loss; while one group is away the survivor
trains on its half of each global batch only, a documented difference, not a rounding error: measured 0.0113 against
0.0076, from 1.0). A Lighthouse that does not answer is one clear error.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import cli_argv, cli_env, jsonl_records, launch_replicas
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
pytest.importorskip("torchft", reason="fault.mode=replicas needs torchft (pip install 'plait[ft]')")

SCRIPT = Path(__file__).with_name("replica_script.py")
KILL_AT, MIN_STEPS = 8, 30
TRAIN_STEPS = 100  # test_plait_train_replica_group_killed_and_healed's run (see its docstring)


def _whole_data_loss(model: nn.Module) -> float:
    from replica_script import data

    x, y = data().tensors
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


def _reference(steps: int, run_dir: Path) -> tuple[list[float], float, float]:
    """The failure-free run: the same loop as one process over the whole global batch (plait at world 1); its
    per-step losses, and the loss over the whole data set before training and after ``steps`` steps."""
    from replica_script import data

    import plait

    p = plait.Plait(run={"dir": str(run_dir)}, train={"global_batch_size": 16, "micro_batch_size": 16, "steps": steps},
                    observe={"progress": False, "trackers": []})
    torch.manual_seed(100)  # group 0's weights, which the first quorum gives every group
    model, _ = p.setup(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)),
                       optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
    start = _whole_data_loss(model)
    loader, losses = p.setup_dataloader(data()), []
    while p.steps < steps:
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb), yb)
            p.backward(loss)
            p.step(log=False)
            losses.append(loss.item())
            if p.steps == steps:
                break
    final = _whole_data_loss(model)
    p.close()
    return losses, start, final


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("replicas")
    return launch_replicas(out, "--replicas", "2", "--max-restarts", "1", str(SCRIPT), str(out), str(MIN_STEPS),
                           kill=("group1.jsonl", KILL_AT))


def test_survivor_keeps_training_and_the_replacement_heals(killed_run: dict) -> None:
    out = killed_run["out"]
    assert killed_run["rc"] == 0, killed_run["log"][-3000:]
    assert killed_run["killed"] is not None
    survivor = [r for r in jsonl_records(out / "group0.jsonl") if "step" in r]
    assert len({r["pid"] for r in survivor}) == 1  # never restarted
    steps = [r["step"] for r in survivor]
    assert steps == list(range(1, len(steps) + 1))  # one record per step, never going back
    assert any(r["live"] == 1 for r in survivor if r["step"] > killed_run["killed"][1])  # trained on alone
    group1 = jsonl_records(out / "group1.jsonl")
    pids = list(dict.fromkeys(r["pid"] for r in group1))
    assert len(pids) == 2 and pids[0] == killed_run["killed"][0]
    joined = next(r["joined_at"] for r in group1 if r.get("pid") == pids[1] and "joined_at" in r)
    assert joined > killed_run["killed"][1]  # healed to the survivor's step, not restarted from 0
    after = [r for r in group1 if r.get("pid") == pids[1] and "step" in r]
    assert after[0]["step"] == joined + 1 and after[-1]["step"] == steps[-1]
    a, b = torch.load(out / "final0.pt"), torch.load(out / "final1.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # num_items_in_batch: each group divides by its own 24 labels (torchft averages the groups' gradients), not by
    # half of them as if the count were summed over both groups (which made every gradient twice the mean's)
    assert [r["items"] for r in _starts(out)] == [24.0, 24.0, 24.0]


def test_each_group_reports_the_failure_and_the_heal(killed_run: dict) -> None:
    """Each group's ``replicas`` block (summary.json under plait train; Plait.report in a loop of one's own) counts
    what its quorums said, and the run's (``combine``) counts each event once. The survivor: group 1 left the quorum
    at the boundary before its first step alone (at or after the step group 1 was killed in), the replacement joined
    healed at its first step's boundary, and the steps between are exactly those its records show with one live
    group. The replacement: its own heal at the same step, no failure seen (it was not there), its agent's restart."""
    from plait.fault.replica_events import combine

    out = killed_run["out"]
    assert killed_run["rc"] == 0, killed_run["log"][-3000:]
    alone = [r["step"] for r in jsonl_records(out / "group0.jsonl") if "step" in r and r["live"] == 1]
    joined = _starts(out)[-1]["joined_at"]  # the replacement's
    assert alone == list(range(alone[0], joined + 1)) and alone[0] - 1 >= killed_run["killed"][1]
    heal = {"step": joined, "count": 1, "groups": [1]}
    s0, s1 = (json.loads((out / f"replicas{g}.json").read_text()) for g in (0, 1))
    assert s0 == {"group": 0, "restarts": 0, "groups": 2, "failures": 1, "left": [{"group": 1, "step": alone[0] - 1}],
                  "heals": 1, "healed": [heal], "fewer_groups_steps": len(alone), "fewer_groups": [[alone[0], joined]]}
    assert s1 == {"group": 1, "restarts": 1, "groups": 2, "failures": 0, "left": [], "heals": 1, "healed": [heal],
                  "fewer_groups_steps": 0, "fewer_groups": []}
    run = combine([s0, s1])
    assert {k: run[k] for k in ("restarts", "failures", "heals", "fewer_groups_steps")} == {
        "restarts": 1, "failures": 1, "heals": 1, "fewer_groups_steps": len(alone)}
    assert run["left"] == s0["left"] and run["healed"] == [heal]


def _starts(out: Path) -> list[dict]:
    return [r for g in (0, 1) for r in jsonl_records(out / f"group{g}.jsonl") if "joined_at" in r]


def test_loss_curve_stays_near_the_failure_free_run(killed_run: dict, tmp_path: Path) -> None:
    out = killed_run["out"]
    g0 = {r["step"]: r["loss"] for r in jsonl_records(out / "group0.jsonl") if "step" in r}
    g1 = {r["step"]: r["loss"] for r in jsonl_records(out / "group1.jsonl") if "step" in r}
    steps = max(g0)
    ref, ref_start, ref_final = _reference(steps, tmp_path / "ref")
    before = range(1, killed_run["killed"][1])  # every step both groups took before the kill
    assert [(g0[s] + g1[s]) / 2 for s in before] == pytest.approx([ref[s - 1] for s in before], abs=1e-5)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    model.load_state_dict(torch.load(out / "final0.pt"))
    final = _whole_data_loss(model)
    assert final < 0.05 * ref_start  # it trained through the failure
    assert abs(final - ref_final) <= 0.02 * ref_start, (final, ref_final, ref_start)


def test_unreachable_lighthouse_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import plait
    from plait.runtime.spawn import free_port

    monkeypatch.setenv("PLAIT_REPLICA_GROUP", "0")
    monkeypatch.setenv("PLAIT_REPLICA_GROUPS", "2")
    address = f"http://127.0.0.1:{free_port()}"
    p = plait.Plait(fault={"mode": "replicas", "lighthouse": address}, comm={"timeout_s": 3},
                    run={"dir": str(tmp_path)}, observe={"progress": False, "trackers": []},
                    train={"global_batch_size": 4})
    from plait.parallel.errors import PlaitError

    expected = f"no quorum through the torchft Lighthouse at {address} \\(it did not answer within 3 s"
    with pytest.raises(PlaitError, match=expected):
        p.setup(nn.Linear(2, 1))
    p.close()


@pytest.mark.slow
def test_plait_train_replica_group_killed_and_healed(tmp_path: Path) -> None:
    """``plait train`` with fault.mode=replicas: its own launcher (one agent per group, a loopback Lighthouse),
    group 1's worker SIGKILLed at step 5 (steps slowed to ~0.3 s by fault.slow_factor, so that the survivor is
    still training when the replacement has started), the replacement healed through the trainer; both export the
    same model, and the groups' summaries and the run's (RUN_DIR/summary.json, printed) count the failure, the heal
    and the steps the survivor trained alone.

    TRAIN_STEPS: the replacement healed 12 and 23 steps after the kill (runs at loads 20 and 13 on 2 cores: a fresh
    interpreter's start stretches with the load as the slowed steps do), so 100 steps leave it over 70 to spare;
    every step after the heal is slow too (the groups step together): 200 steps cost minutes under load."""
    from helpers import TINY_CLI
    from safetensors.torch import load_file

    run = tmp_path / "run"
    args = [a for a in TINY_CLI if not a.startswith("--parallel.nproc")] + [
        "--parallel.nproc=2", "--fault.mode=replicas", "--fault.max_restarts=1", f"--train.steps={TRAIN_STEPS}",
        "--checkpoint.every=50", "--fault.slow_rank=0", "--fault.slow_factor=40", f"--run.dir={run}"]
    log = open(tmp_path / "train.log", "w")
    proc = subprocess.Popen(cli_argv("train", *args), env=cli_env(), stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                            start_new_session=True)
    survivor_pid = killed = None
    try:
        deadline = time.monotonic() + 500
        while proc.poll() is None and time.monotonic() < deadline:
            progress = run / "replica1" / "progress.json"
            if killed is None and progress.is_file() and json.loads(progress.read_text() or "{}").get("steps", 0) >= 5:
                survivor_pid = (run / "replica0" / "workers" / "rank0.pid").read_text().split()[0]
                killed = int((run / "replica1" / "workers" / "rank0.pid").read_text().split()[0])
                os.kill(killed, signal.SIGKILL)
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    text = (tmp_path / "train.log").read_text()
    assert proc.returncode == 0 and killed is not None, text[-3000:]
    assert (run / "replica0" / "workers" / "rank0.pid").read_text().split()[0] == survivor_pid
    assert int((run / "replica1" / "workers" / "rank0.pid").read_text().split()[0]) != killed
    steps = [json.loads(line)["step"] for line in (run / "replica0" / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in line and '"lr"' in line]
    assert steps == list(range(1, TRAIN_STEPS + 1))
    joins = [int(n) for n in re.findall(r"replica group 1 healed from a live replica: joins at step (\d+)", text)]
    assert len(joins) == 2 and joins[0] == 0 and joins[1] > 5  # the first quorum, then the replacement's heal
    ones = [json.loads(line)["step"] for line in (run / "replica1" / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line and '"lr"' in line]
    assert ones[-1] == TRAIN_STEPS and joins[1] + 1 in ones and ones == sorted(ones)  # went on from the survivor's step
    a, b = (load_file(run / f"replica{g}" / "model" / "model.safetensors") for g in (0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the summaries: group 1 left the survivor's quorum at or after the step it was killed at (5 or later) and
    # healed at joins[1]; the survivor trained the steps between alone (at least one: the replacement takes seconds
    # to start, the survivor's steps ~0.3 s). The run's summary counts each once, and plait train prints it.
    s0, s1 = (json.loads((run / f"replica{g}" / "summary.json").read_text())["replicas"] for g in (0, 1))
    (left,) = s0["left"]
    heal = {"step": joins[1], "count": 1, "groups": [1]}
    assert left["group"] == 1 and 5 <= left["step"] < joins[1] and s0["failures"] == 1
    assert s0["healed"] == s1["healed"] == [heal] and s0["heals"] == s1["heals"] == 1
    assert s0["fewer_groups"] == [[left["step"] + 1, joins[1]]] and s1["fewer_groups_steps"] == s1["failures"] == 0
    assert (s0["restarts"], s1["restarts"]) == (0, 1)
    top = json.loads((run / "summary.json").read_text())
    assert {k: top["replicas"][k] for k in ("restarts", "failures", "heals", "fewer_groups_steps")} == {
        "restarts": 1, "failures": 1, "heals": 1, "fewer_groups_steps": joins[1] - left["step"]}
    assert [g["steps"] for g in top["groups"]] == [TRAIN_STEPS, TRAIN_STEPS]
    assert (f"1 replica failure(s) (group 1 at step {left['step']}), 1 heal(s) (step {joins[1]}), "
            f"{joins[1] - left['step']} step(s) with fewer than 2 groups") in text


@pytest.mark.parametrize("sections, message", [
    # 2 groups of 1 rank: nothing to shard inside a group
    ({"parallel": {"zero": 2}}, r"with parallel.zero=2 shards each replica group's state over its ranks, and a group "
                                r"here is one rank \(2 groups\): set parallel.dp_replicate"),
    ({"parallel": {"zero": 3}}, "with parallel.zero=3 shards each replica group's state over its ranks"),
    # tensor, pipeline, context and expert parallelism run inside a group: its ranks must hold whole model replicas
    ({"parallel": {"tp": 2, "dp_replicate": 2}}, r"a replica group of 1 ranks does not divide by parallel.tp=2 x "
                                                  r"parallel.pp=1 x parallel.cp=1 x parallel.ep=1 = 2"),
    ({"parallel": {"cp": 2, "dp_replicate": 2}}, r"a replica group of 1 ranks does not divide by .* x "
                                                  r"parallel.cp=2 x parallel.ep=1 = 2"),
    ({"parallel": {"ep": 2, "dp_replicate": 2}, "moe": {"num_experts": 4}},
     r"does not divide by .* x parallel.ep=2 = 2 \(tensor, pipeline, context and expert parallelism run inside each "
     r"group; expert-parallel ranks are data-parallel ranks\)"),
    ({"parallel": {"pp": 2, "zero": 3}}, r"with parallel.zero=3 shards each replica group's state over its "
                                         r"data-parallel ranks, and a group here has one \(its 2 ranks are tp=1 x "
                                         r"pp=2\)"),
    # settings of the group's own gradient synchronisation: a group of one rank has none
    ({"comm": {"compress": "int8"}}, r"comm.compress=int8 acts on each replica group's own gradient synchronisation, "
                                     r"and a group here has one data-parallel rank, so there is none"),
    ({"parallel": {"sync_batchnorm": True}, "comm": {"allreduce": "ring"}},
     r"comm.allreduce=ring, parallel.sync_batchnorm acts on each replica group's own gradient synchronisation"),
    ({"parallel": {"impl": "torch"}}, r"parallel.impl=torch acts on each replica group's own"),
    ({"parallel": {"strategy": "zero"}},
     r"with parallel.strategy=zero shards each replica group's state over its ranks, and a group here is one rank .* "
     r"or parallel.strategy=auto"),
    # for a reason of meaning
    ({"fault": {"rebalance": True}}, r"fault.rebalance moves shares of every global batch between data-parallel ranks"),
    ({"parallel": {"mode": "ps"}}, r"a parameter server \(parallel.mode=ps\) is data parallelism with its own"),
    ({"fault": {"min_replicas": 3}}, r"fault.min_replicas must lie in 1..2"),
    ({"parallel": {"dp_replicate": 3}}, r"parallel.dp_replicate=3 replica groups must divide the 2 ranks"),
])
def test_layouts_it_cannot_train_are_refused(sections: dict, message: str) -> None:
    from plait.config import ConfigError, from_sections
    from plait.validate import validate

    cfg = from_sections({"train": {"global_batch_size": 8}, **sections})
    cfg.fault.mode = "replicas"
    with pytest.raises(ConfigError, match=message):
        validate(cfg, 2)


def test_replica_groups_of_several_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """parallel.dp_replicate splits the ranks into groups (a launcher's check); in a worker its group's world and the
    launcher's environment say it; dp_replicate outside fault.mode=replicas and a dp_shard that does not divide a
    group are refused."""
    from plait.config import ConfigError, from_sections
    from plait.parallel.replicas.topology import replica_degrees
    from plait.validate import validate

    cfg = from_sections({"train": {"global_batch_size": 8}, "parallel": {"dp_replicate": 2, "zero": 2}})
    cfg.fault.mode = "replicas"
    assert replica_degrees(cfg, 4)["dp_replicate"] == 2 and replica_degrees(cfg, 4)["dp_shard"] == 2
    assert validate(cfg, 4).parallel.dp == 4  # every data-parallel rank of every group reads its own share
    monkeypatch.setenv("PLAIT_REPLICA_GROUP", "1")
    monkeypatch.setenv("PLAIT_REPLICA_GROUPS", "3")
    with pytest.raises(ConfigError, match="parallel.dp_replicate=2 but the launcher started 3 replica groups"):
        replica_degrees(cfg, 2)
    cfg.parallel.dp_replicate = 0
    assert replica_degrees(cfg, 2) == {"pp": 1, "dp_replicate": 3, "dp_shard": 2, "ep": 1, "cp": 1, "tp": 1}
    tp = from_sections({"train": {"global_batch_size": 8}, "parallel": {"tp": 2}})  # groups of 2: one replica each
    tp.fault.mode = "replicas"
    assert replica_degrees(tp, 2) == {"pp": 1, "dp_replicate": 3, "dp_shard": 1, "ep": 1, "cp": 1, "tp": 2}
    monkeypatch.delenv("PLAIT_REPLICA_GROUP")
    tp.parallel.dp_replicate = 2  # 2 groups of 4 ranks: tp=2 x 2 data-parallel ranks each; 4 of them in all
    assert replica_degrees(tp, 8) == {"pp": 1, "dp_replicate": 2, "dp_shard": 2, "ep": 1, "cp": 1, "tp": 2}
    assert validate(tp, 8).parallel.dp == 4
    hsdp = from_sections({"train": {"global_batch_size": 12}, "parallel": {"dp_replicate": 2, "zero": 3,
                                                                            "dp_shard": 2}})
    hsdp.fault.mode = "replicas"
    with pytest.raises(ConfigError, match=r"parallel.dp_shard=2 must divide the 3 ranks of a replica group"):
        validate(hsdp, 6)
    plain = from_sections({"train": {"global_batch_size": 8}, "parallel": {"dp_replicate": 2}})
    with pytest.raises(ConfigError, match="parallel.dp_replicate=2 sets the torchft replica groups of fault.mode"):
        validate(plain, 4)


def test_without_the_launcher_it_says_how_to_start(tmp_path: Path) -> None:
    import plait
    from plait.config import ConfigError

    with pytest.raises(ConfigError, match="plait run --replicas N SCRIPT"):
        plait.Plait(fault={"mode": "replicas"}, run={"dir": str(tmp_path)}, observe={"progress": False})


def test_flattened_mesh_names_split_into_the_group_axes() -> None:
    """The ranks holding the same tensor are found from its DTensor mesh's axis names: torch joins a flattened mesh's
    names with ``_``, which the names themselves contain (``dp_replicate_dp_shard``: FSDP2 over both)."""
    from plait.config import ConfigError
    from plait.parallel.replicas.heal import mesh_axes as _mesh_axes

    assert _mesh_axes("tp") == ["tp"]
    assert _mesh_axes("dp_replicate_dp_shard") == ["dp_replicate", "dp_shard"]
    assert _mesh_axes("dp_shard_ep_tp") == ["dp_shard", "ep", "tp"]
    with pytest.raises(ConfigError, match="device mesh dimension 'dp_x' that is not one of the group topology's axes"):
        _mesh_axes("dp_x")
