"""Four and five dimensions at once, as the peers run them, against one process.

plait's GPT (4 layers, width 32, 4 heads, tied embedding and head; ``references.sharded_*``) at 16 ranks:
ZeRO-3 x tp2 x pp2 (1F1B) x cp2 (ring) x dp2, and the same with sequence parallelism and the interleaved
schedule (two virtual stages per rank) and all-to-all attention. Each trains 3 fp32 AdamW steps (clip 1.0) from one
rank's weights through ``plait.Plait.forward_backward`` on the global batches of ``references.sharded_batches``,
each data-parallel rank its slice, and is compared with the same loop in one plain PyTorch process: losses within
``MP_LOSS_ATOL``, every parameter within ``MP_PARAM_ATOL`` beyond its AdamW slack (``references.adam_slack`` for
gradients off by ``GRAD_RTOL`` of their tensor's largest element: the summation order of 16 ranks differs from one
process's), and the weights moved far more than that.
"""

from __future__ import annotations

import pytest
from helpers import run_ranks
from references import MP_LOSS_ATOL, MP_PARAM_ATOL, beyond_slack, sharded_moved, sharded_reference, sharded_train

SIXTEEN = {
    "zero3-tp2-pp2-cp2": {"zero": 3, "tp": 2, "pp": 2, "cp": 2, "microbatches": 2, "pp_balance": "count"},
    "zero3-sp-interleaved-cp2-alltoall": {"zero": 3, "tp": 2, "sequence_parallel": True, "pp": 2, "cp": 2,
                                          "cp_impl": "alltoall", "pp_schedule": "interleaved", "microbatches": 2,
                                          "pp_balance": "count"},
}


def _sixteen(rank: int, world: int, tmp: str) -> dict:
    return {name: sharded_train("gpt", parallel, f"{tmp}/{name}", micro=4) for name, parallel in SIXTEEN.items()}


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
