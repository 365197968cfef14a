"""Hybrid sharding (HSDP, ``parallel.dp_shard``) against one plain PyTorch process, and checkpoints that reshard
between HSDP, FSDP and one process.

One group of 4 gloo ranks runs dp=4 with ``dp_shard=2``: parameters sharded over shard groups of 2 ranks and
replicated across the 2 groups. plait's GPT and a Hugging Face Llama train 3 AdamW steps (tolerances in
``references.sharded_*``); every parameter is a DTensor on the 2-D ``(dp_replicate, dp_shard)`` mesh placed
``(Replicate(), Shard(0))``, each rank holds half of it, the two replicas of a shard hold the same values, and
each rank's measured model states are 16 bytes per parameter it holds (fp32 AdamW), half the model's.

Checkpoints, each a continuation of the reference's own training, so that optimizer states are checked too:
one process trains 3 steps and saves; HSDP loads it and trains step 4 (= the reference's 4th step) and saves;
FSDP (dp=4, dp_shard=0) loads that, trains step 5 and saves; HSDP loads the FSDP checkpoint (same weights);
one process loads the FSDP checkpoint and trains step 6, and loads the HSDP one (same weights).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import run_ranks
from references import MP_LOSS_ATOL, MP_PARAM_ATOL, sharded_moved, sharded_reference, sharded_train, state_diff

HSDP = {"zero": 3, "dp_shard": 2}
HAS_HF = importlib.util.find_spec("transformers") is not None


def _placement(pl) -> str:
    return "replicate" if pl.is_replicate() else f"shard{pl.dim}" if pl.is_shard() else repr(pl)


def _layout(p, model) -> dict:
    """What this rank holds (collective: the memory report all-gathers)."""
    from torch.distributed.tensor import DTensor

    shards = {}
    for name, q in p.strategy.named_parameters():
        assert isinstance(q, DTensor), name
        shards[name] = {"placements": tuple(_placement(pl) for pl in q.placements), "shape": tuple(q.shape),
                        "local": q.to_local().detach().clone(), "mesh": (q.device_mesh.mesh_dim_names,
                                                                          tuple(q.device_mesh.shape))}
    return {"strategy": p.layout.composition, "describe": p.strategy.describe(), "shards": shards,
            "coords": (p.topology.coord("dp_replicate"), p.topology.coord("dp_shard")),
            "memory": p.report()["memory"], "measured": dict(p.memory)}


def _worker(rank: int, world: int, tmp: str, ckpt_one: str, hf: bool) -> dict:
    out = {"gpt": sharded_train("gpt", HSDP, f"{tmp}/gpt", micro=2, inspect=_layout)}
    if hf:
        out["llama"] = sharded_train("llama", HSDP, f"{tmp}/llama", micro=2, inspect=_layout)
    out["hsdp<-one"] = sharded_train("gpt", HSDP, f"{tmp}/c1", micro=2, start=3, steps=1, load=ckpt_one,
                                     save=f"{tmp}/ckpt-hsdp")
    out["fsdp<-hsdp"] = sharded_train("gpt", {"zero": 3}, f"{tmp}/c2", micro=2, start=4, steps=1,
                                      load=f"{tmp}/ckpt-hsdp", save=f"{tmp}/ckpt-fsdp")
    out["hsdp<-fsdp"] = sharded_train("gpt", HSDP, f"{tmp}/c3", micro=2, start=5, steps=0, load=f"{tmp}/ckpt-fsdp")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("hsdp")
    one = sharded_train("gpt", {}, str(tmp / "one"), micro=8, save=str(tmp / "ckpt-one"))  # one process, 3 steps
    ranks = run_ranks(_worker, 4, str(tmp), str(tmp / "ckpt-one"), HAS_HF, timeout=400)
    one_from_fsdp = sharded_train("gpt", {}, str(tmp / "c4"), micro=8, start=5, steps=1, load=str(tmp / "ckpt-fsdp"))
    one_from_hsdp = sharded_train("gpt", {}, str(tmp / "c5"), micro=8, start=4, steps=0, load=str(tmp / "ckpt-hsdp"))
    return {"ranks": ranks, "one": one, "one<-fsdp": one_from_fsdp, "one<-hsdp": one_from_hsdp,
            "gpt": sharded_reference("gpt", 6), "llama": sharded_reference("llama", 3) if HAS_HF else None}


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_hsdp_matches_single_process(runs, kind) -> None:
    if runs[kind] is None:
        pytest.skip("the hf extra (transformers) is not installed")
    ref_losses, ref_states = runs[kind]
    for r in runs["ranks"]:
        assert r[kind]["losses"] == pytest.approx(ref_losses[:3], abs=MP_LOSS_ATOL)
        assert state_diff(r[kind]["state"], ref_states[2]) < MP_PARAM_ATOL
    assert sharded_moved(kind, ref_states[2]) > 50 * MP_PARAM_ATOL


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_hsdp_shards_every_parameter_over_two_ranks_and_replicates_twice(runs, kind) -> None:
    if runs[kind] is None:
        pytest.skip("the hf extra (transformers) is not installed")
    views = [r[kind]["inspect"] for r in runs["ranks"]]
    assert [v["coords"] for v in views] == [(0, 0), (0, 1), (1, 0), (1, 1)]  # rank = replica x 2 + shard
    for v in views:
        assert v["strategy"] == "WholeModel/Fsdp" and v["describe"] == "HSDP"
    for name, first in views[0]["shards"].items():
        assert first["mesh"] == (("dp_replicate", "dp_shard"), (2, 2)), name
        assert first["placements"] == ("replicate", "shard0"), name
        locals_ = [v["shards"][name]["local"] for v in views]
        halves = torch.empty(first["shape"], device="meta").chunk(2, dim=0)
        for v, t in zip(views, locals_, strict=True):
            assert t.shape == halves[v["coords"][1]].shape, name  # half of dim 0: its shard group's half
        assert torch.equal(locals_[0], locals_[2]) and torch.equal(locals_[1], locals_[3]), name  # replicas agree
        assert locals_[0].numel() + locals_[1].numel() == torch.Size(first["shape"]).numel(), name
    # memory: 16 bytes (fp32 parameter, gradient, two AdamW states) per element held (and a step counter per
    # parameter), about 16 psi / 2
    psi = sum(torch.Size(s["shape"]).numel() for s in views[0]["shards"].values())
    for rank, v in enumerate(views):
        held = sum(s["local"].numel() for s in v["shards"].values())
        steps = 8 * len(v["shards"])  # AdamW's per-parameter step counter, a scalar tensor
        assert 16 * held <= v["measured"]["total"] <= 16 * held + steps
        assert v["memory"]["measured_model_state_bytes"][rank] == v["measured"]["total"]
        assert v["memory"]["predicted_model_state_bytes"][rank] == pytest.approx(16 * psi / 2, rel=0.01)
        assert 16 * held == pytest.approx(16 * psi / 2, rel=0.05)
        # setup: the whole model given and broadcast, then shards over the shard group of 2
        setup = v["memory"]["setup"]["ranks"][rank]
        assert setup["predicted"]["layout"] == pytest.approx(4 * psi / 2, abs=64)
        assert setup["predicted"]["broadcast"] >= 4 * psi and setup["measured"]["host_increase_bytes"] >= 0


def test_checkpoints_reshard_between_hsdp_fsdp_and_one_process(runs) -> None:
    ref_losses, ref_states = runs["gpt"]
    assert runs["one"]["losses"] == pytest.approx(ref_losses[:3], abs=MP_LOSS_ATOL)
    for r in runs["ranks"]:
        assert state_diff(r["hsdp<-one"]["loaded"], runs["one"]["state"]) == 0.0  # the saved weights, exactly
        assert r["hsdp<-one"]["losses"] == pytest.approx(ref_losses[3:4], abs=MP_LOSS_ATOL)
        assert state_diff(r["hsdp<-one"]["state"], ref_states[3]) < MP_PARAM_ATOL  # optimizer states came along
        assert state_diff(r["fsdp<-hsdp"]["loaded"], r["hsdp<-one"]["state"]) == 0.0
        assert r["fsdp<-hsdp"]["losses"] == pytest.approx(ref_losses[4:5], abs=MP_LOSS_ATOL)
        assert state_diff(r["fsdp<-hsdp"]["state"], ref_states[4]) < MP_PARAM_ATOL
        assert state_diff(r["hsdp<-fsdp"]["loaded"], r["fsdp<-hsdp"]["state"]) == 0.0
    rank0 = runs["ranks"][0]
    assert state_diff(runs["one<-fsdp"]["loaded"], rank0["fsdp<-hsdp"]["state"]) == 0.0
    assert runs["one<-fsdp"]["losses"] == pytest.approx(ref_losses[5:6], abs=MP_LOSS_ATOL)
    assert state_diff(runs["one<-fsdp"]["state"], ref_states[5]) < MP_PARAM_ATOL
    assert state_diff(runs["one<-hsdp"]["loaded"], rank0["hsdp<-one"]["state"]) == 0.0
