"""Four and five dimensions at once, as the peers run them, against one process.

plait's GPT (4 layers, width 32, 4 heads, tied embedding and head; ``references.sharded_*``) at 16 ranks:
ZeRO-3 x tp2 x pp2 (1F1B) x cp2 (ring) x dp2, and the same with sequence parallelism and the interleaved
schedule (two virtual stages per rank) and all-to-all attention. Each trains 3 fp32 AdamW steps (clip 1.0) from one
rank's weights through ``plait.Plait.forward_backward`` on the global batches of ``references.sharded_batches``,
each data-parallel rank its slice, and is compared with the same loop in one plain PyTorch process: losses within
``MP_LOSS_ATOL``, every parameter within ``MP_PARAM_ATOL`` beyond its AdamW slack (``references.adam_slack`` for
gradients off by ``GRAD_RTOL`` of their tensor's largest element: the summation order of 16 ranks differs from one
process's), and the weights moved far more than that.

Five dimensions in the same spawned group: plait's MoE GPT (an MoE block of 4 experts in each of its 2 blocks, every
balancing term on) at ZeRO-3 x tp2 x pp2 (1F1B) x cp2 (ring) x ep2, the experts sharded over ep inside dp x cp
(``tests/parallel/expert/test_expert_compose.py``'s model, loop and reference, whose docstring states the
tolerances: losses, gradient norms, every gradient at step 1 and every parameter after 3 steps).
"""

from __future__ import annotations

import pytest
from helpers import run_ranks
from references import MP_LOSS_ATOL, MP_PARAM_ATOL, beyond_slack, sharded_moved, sharded_reference, sharded_train

from tests.parallel.expert import test_expert_compose as moe

SIXTEEN = {
    "zero3-tp2-pp2-cp2": {"zero": 3, "tp": 2, "pp": 2, "cp": 2, "microbatches": 2, "pp_balance": "count"},
    "zero3-sp-interleaved-cp2-alltoall": {"zero": 3, "tp": 2, "sequence_parallel": True, "pp": 2, "cp": 2,
                                          "cp_impl": "alltoall", "pp_schedule": "interleaved", "microbatches": 2,
                                          "pp_balance": "count"},
}


# the MoE GPT's 5-D layout: (name, parallel settings, micro-steps per optimizer step), as test_expert_compose's LAYOUTS
FIVE = ("zero3-tp2-pp2-cp2-ep2", {"dp": 2, "zero": 3, "tp": 2, "pp": 2, "pp_schedule": "1f1b", "microbatches": 2,
                                  "cp": 2, "cp_impl": "ring", "ep": 2}, 1)


def _sixteen(rank: int, world: int, tmp: str) -> dict:
    out = {name: sharded_train("gpt", parallel, f"{tmp}/{name}", micro=4) for name, parallel in SIXTEEN.items()}
    out[FIVE[0]] = moe._train(tmp, *FIVE)
    return out


@pytest.fixture(scope="module")
def sixteen(tmp_path_factory) -> list[dict]:
    return run_ranks(_sixteen, 16, str(tmp_path_factory.mktemp("nd16")), timeout=900)


@pytest.fixture(scope="module")
def ref() -> tuple[list[float], dict, dict]:
    slack: dict = {}
    losses, states = sharded_reference("gpt", 3, slack=slack)
    return losses, states[-1], slack


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SIXTEEN))
def test_four_dimensions_equal_one_process(sixteen, ref, name) -> None:
    losses, state, slack = ref
    for r in sixteen:
        assert r[name]["losses"] == pytest.approx(losses, abs=MP_LOSS_ATOL), (name, r[name]["losses"], losses)
        assert beyond_slack(r[name]["state"], state, slack) < MP_PARAM_ATOL, name
    assert sharded_moved("gpt", state) > 30 * MP_PARAM_ATOL


@pytest.mark.slow
def test_five_dimensions_with_experts_equal_one_process(sixteen) -> None:
    name, parallel, accum = FIVE
    slack: dict = {}
    ref = moe.reference(moe._chunks(parallel, accum), slack)
    held = set().union(*(r[name]["grads"] for r in sixteen))  # a pipeline rank holds its stage's gradients
    assert held == ref["grads"].keys(), sorted(held ^ set(ref["grads"]))
    for run in (r[name] for r in sixteen):
        assert max(abs(a - b) for a, b in zip(run["losses"], ref["losses"], strict=True)) < MP_LOSS_ATOL, run["losses"]
        assert run["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        assert moe._max_diff(run["grads"], ref["grads"]) < moe.GRAD_ATOL
        assert beyond_slack(run["state"], ref["state"], slack) < MP_PARAM_ATOL
        assert run["report"]["expert_sharding"] in ("fsdp", "none"), run["report"]
    assert {r[name]["report"]["expert_sharding"] for r in sixteen} != {"none"}
