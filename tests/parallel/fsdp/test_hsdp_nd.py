"""Hybrid sharding composed with tensor and pipeline parallelism, at 8 gloo ranks (the fewest where HSDP keeps
both a shard group and a replica beside tp or pp): tp=2 x dp=4 with dp_shard=2 (3-D: every parameter a
DTensor on the (dp_replicate, dp_shard, tp) mesh), pp=2 x dp=4 with dp_shard=2 (FSDP2 per stage on the 2-D
data-parallel mesh), and pp=2 x tp=2 x dp=2 at ZeRO-3, and at ZeRO-2 with sequence parallelism (plait's sharded
optimizer over each stage's tensor-parallel shards; the tied embedding and head summed over the pipeline as
DTensors); plait's GPT against one plain PyTorch process (the tolerances of ``references.sharded_*``)."""

from __future__ import annotations

import pytest
from helpers import run_ranks
from references import MP_LOSS_ATOL, MP_PARAM_ATOL, sharded_reference, sharded_train, state_diff

CASES = {  # name: (parallel, micro-batch per rank)
    "tp2-hsdp": ({"tp": 2, "zero": 3, "dp_shard": 2}, 2),
    "pp2-hsdp": ({"pp": 2, "zero": 3, "dp_shard": 2, "microbatches": 2, "pp_balance": "count"}, 2),
    "pp2-tp2-zero3": ({"pp": 2, "tp": 2, "zero": 3, "microbatches": 2, "pp_balance": "count"}, 4),
    "pp2-tp2-zero2-sp": ({"pp": 2, "tp": 2, "zero": 2, "sequence_parallel": True, "microbatches": 2,
                          "pp_balance": "count"}, 4),
}


def _mesh(p, model) -> dict:
    from torch.distributed.tensor import DTensor

    s = p.strategy
    meshes = {(q.device_mesh.mesh_dim_names, tuple(q.device_mesh.shape)) for _, q in s.named_parameters()
              if isinstance(q, DTensor)}
    return {"strategy": s.composition, "describe": s.describe(), "meshes": meshes}


def _worker(rank: int, world: int, tmp: str) -> dict:
    return {name: sharded_train("gpt", parallel, f"{tmp}/{name}", micro=micro, inspect=_mesh)
            for name, (parallel, micro) in CASES.items()}


@pytest.mark.slow
def test_hsdp_with_tensor_and_pipeline_parallelism_matches_single_process(tmp_path) -> None:
    ranks = run_ranks(_worker, 8, str(tmp_path), timeout=600)
    ref_losses, ref_states = sharded_reference("gpt", 3)
    for name in CASES:
        for r in ranks:
            assert r[name]["losses"] == pytest.approx(ref_losses, abs=MP_LOSS_ATOL), name
            assert state_diff(r[name]["state"], ref_states[2]) < MP_PARAM_ATOL, name
    tp = ranks[0]["tp2-hsdp"]["inspect"]
    assert tp["strategy"] == "WholeModel/Fsdp" and tp["describe"] == "tensor-parallel/HSDP"
    assert (("dp_replicate", "dp_shard", "tp"), (2, 2, 2)) in tp["meshes"]  # the 3-D mesh of tp weights
    pp = ranks[0]["pp2-hsdp"]["inspect"]
    assert pp["strategy"] == "PipelineStages/Fsdp" and pp["describe"] == "pipeline/HSDP"
    assert pp["meshes"] == {(("dp_replicate", "dp_shard"), (2, 2))}
    ptf = ranks[0]["pp2-tp2-zero3"]["inspect"]
    assert ptf["strategy"] == "PipelineStages/Fsdp" and ptf["describe"] == "tensor-parallel/pipeline/FSDP"
    ptz = ranks[0]["pp2-tp2-zero2-sp"]["inspect"]
    assert ptz["strategy"] == "PipelineStages/Zero" and ptz["describe"] == "tensor-parallel/pipeline/ZeRO"
    assert ptz["meshes"] == {(("tp",), (2,))}  # the tp plan's DTensors (ZeRO shards their local tensors)
