"""Pipeline stages that hold no layer: a first stage with the embedding alone and a last stage with the final norm,
head and loss alone (Llama 3 405B's first and last chunks; Megatron-LM's ``--account-for-embedding-in-pipeline-split``
and ``--account-for-loss-in-pipeline-split``), asked for with ``parallel.pp_split_embedding`` / ``pp_split_head``
(each counts as a layer of the split) or by naming the first layer / the final norm in ``parallel.pp_split``.

Trained through ``plait.Plait`` on 4 gloo ranks against one plain PyTorch process: the small Llama at pp=2 x tp=2
with sequence parallelism (an embedding-only first stage sends this rank's slice of the sequence) under GPipe and
1F1B (named split points), interleaved 1F1B and the zero-bubble V (two stages per rank, the embedding and the head
each alone); the Llama at pp=2 x dp=2 with ZeRO-3 (interleaved); plait's GPT, whose embedding and head share one
table, interleaved with both alone. Losses and parameters after 3 steps within ``references.MP_*`` (float32; the
reduction order differs from one process); each stage's parts are checked.
"""

from __future__ import annotations

import pytest
from helpers import run_ranks
from references import MP_LOSS_ATOL, MP_PARAM_ATOL, sharded_reference, sharded_train, state_diff

pytest.importorskip("transformers")

SP = {"tp": 2, "sequence_parallel": True, "pp": 2, "microbatches": 4, "pp_balance": "count"}
BOTH = {"pp_split_embedding": True, "pp_split_head": True}
CASES = {  # name: (model, parallel, what each of the stages holds: (layers, embedding, head))
    "llama-gpipe-embedding": ("llama", {**SP, "pp_schedule": "gpipe", "pp_split": ["model.layers.0"]},
                              [(0, True, False), (2, False, True)]),
    "llama-1f1b-head": ("llama", {**SP, "pp_schedule": "1f1b", "pp_split": ["model.norm"]},
                        [(2, True, False), (0, False, True)]),
    "llama-interleaved-both": ("llama", {**SP, **BOTH, "pp_schedule": "interleaved", "pp_virtual_stages": 2},
                               [(0, True, False), (1, False, False), (1, False, False), (0, False, True)]),
    "llama-zbv-both": ("llama", {**SP, **BOTH, "pp_schedule": "zbv"},
                       [(0, True, False), (1, False, False), (1, False, False), (0, False, True)]),
    "llama-interleaved-both-zero3": ("llama", {"pp": 2, "zero": 3, "microbatches": 2, "pp_balance": "count",
                                               **BOTH, "pp_schedule": "interleaved", "pp_virtual_stages": 2},
                                     [(0, True, False), (1, False, False), (1, False, False), (0, False, True)]),
    "gpt-interleaved-split": ("gpt", {"pp": 2, "dp": 2, "microbatches": 2, "pp_schedule": "interleaved",
                                      "pp_virtual_stages": 2, "pp_split": ["blocks.0", "blocks.2", "ln_f"]},
                              [(0, True, False), (2, False, False), (2, False, False), (0, False, True)]),
}


def _parts(p, model) -> dict[int, tuple[int, bool, bool]]:
    """This rank's stages: stage index -> (layers, holds the embedding, holds the head)."""
    runner = p.layout.stages.runner
    out = {}
    for s, m in zip(runner.stage_ids, runner.modules, strict=True):
        holder = getattr(m, getattr(m, "prefix", ""), m)
        layers = getattr(holder, "layers", getattr(m, "blocks", {}))
        embedding = hasattr(holder, "embed_tokens") or hasattr(m, "tok_emb")
        out[s] = (len(layers), embedding, hasattr(m, "lm_head") or hasattr(m, "head"))
    return out


def _worker(rank: int, world: int, root: str) -> dict:
    out = {}
    for name, (kind, parallel, _) in CASES.items():
        micro = 8 // (world // (parallel["pp"] * parallel.get("tp", 1)))
        out[name] = sharded_train(kind, {"nproc": world, **parallel}, f"{root}/{name}", micro=micro, inspect=_parts)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    ranks = run_ranks(_worker, 4, str(tmp_path_factory.mktemp("empty")), timeout=600)
    return {"ranks": ranks, "llama": sharded_reference("llama", 3), "gpt": sharded_reference("gpt", 3)}


@pytest.mark.parametrize("name", list(CASES))
def test_stages_without_layers_match_one_process(runs, name) -> None:
    kind, _, parts = CASES[name]
    ref_losses, ref_states = runs[kind]
    held: dict[int, tuple[int, bool, bool]] = {}
    for r in runs["ranks"]:
        assert r[name]["losses"] == pytest.approx(ref_losses, abs=MP_LOSS_ATOL), name
        assert state_diff(r[name]["state"], ref_states[-1]) < MP_PARAM_ATOL, name
        held.update(r[name]["inspect"])
    assert [held[s] for s in range(len(parts))] == parts


def test_a_split_that_leaves_a_middle_stage_empty_or_a_model_without_parts_is_refused() -> None:
    import torch

    from plait.parallel.pipeline.split import pipeline_adapter, split_by_names, stage_layer_ranges
    from plait.plan.schedule import PipelineConfigError

    names = ["model.layers.0", "model.layers.1"]
    with pytest.raises(PipelineConfigError, match="increasing order"):
        split_by_names(names, ["model.layers.1", "model.layers.1"], 3, head="model.norm")
    with pytest.raises(PipelineConfigError, match="after the first layer"):  # no parts: the first stage needs a layer
        split_by_names(names, ["model.layers.0"], 2)
    seq = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with pytest.raises(PipelineConfigError, match="pp_split_head give the embedding or the head a stage"):
        stage_layer_ranges(seq, pipeline_adapter(seq), 2, None, None, head_unit=True)
    with pytest.raises(PipelineConfigError, match="the embedding and the head count as one each"):
        from plait.plan.schedule import partition_units

        partition_units([1.0, 1.0], 5, embedding_unit=True, head_unit=True)
