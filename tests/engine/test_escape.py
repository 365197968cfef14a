"""A user's own model through the generic paths and the escape hatches, against one process.

* pipeline: an ``nn.Sequential`` split at a named child (``pp_split=["2"]``), and the same model cut
  by a user's ``stage_fn``;
* tensor parallel: a plain two-Linear MLP with an explicit plan (``colwise`` then ``rowwise``), and the
  same through a user's ``parallelize_fn``;
* activation checkpointing and ZeRO-3 on the Sequential's layers (found without a ``blocks`` attribute).

Tolerance: float32 rounding of the reordered sums: losses 1e-5, parameters 3e-5 after 4 AdamW steps.
"""

from __future__ import annotations

import pytest
import torch
from helpers import run_ranks
from references import reference_training
from torch import nn

STEPS, GLOBAL, LR = 4, 8, 1e-2
LOSS_ATOL, PARAM_ATOL = 1e-5, 3e-5


def build() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(2)
    return torch.utils.data.TensorDataset(torch.randn(GLOBAL * STEPS * 2, 6, generator=g),
                                          torch.randint(0, 4, (GLOBAL * STEPS * 2,), generator=g))


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    return reference_training(build(), data(), GLOBAL, STEPS, LR, 0,
                              lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1]))


def _stage_fn(model: nn.Sequential, stage: int, num_stages: int) -> nn.Module:
    """The user's own cut: the first two Linears on stage 0, the rest on stage 1 (names kept)."""
    from plait.parallel.pipeline.split import SequentialStage

    names = ["0", "1", "2"] if stage == 0 else ["3", "4"]
    return SequentialStage({n: model.get_submodule(n) for n in names})


def _parallelize(model: nn.Sequential, mesh) -> nn.Sequential:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


CASES = {
    "pp-split": ({"pp": 2, "microbatches": 2, "pp_split": ["2"]}, 8, {}),
    "pp-stage-fn": ({"pp": 2, "microbatches": 2, "pp_schedule": "gpipe"}, 8, {"stage_fn": _stage_fn}),
    "tp-plan": ({"tp": 2, "tp_plan": {"0": "colwise", "2": "rowwise"}}, 8, {}),
    "tp-parallelize-fn": ({"tp": 2}, 8, {"parallelize_fn": _parallelize}),
    "tp-style-objects": ({"tp": 2}, 8, {"tp_plan": "objects"}),  # torch ParallelStyle objects in the plan
    "zero3-checkpointed": ({"zero": 3}, 4, {}),
}


def _worker(rank: int, world: int, root: str) -> dict:
    import plait

    out = {}
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    for name, (parallel, micro, kwargs) in CASES.items():
        if kwargs.get("tp_plan") == "objects":
            kwargs = {"tp_plan": {"0": ColwiseParallel(), "2": RowwiseParallel()}}
        train = {"global_batch_size": GLOBAL, "micro_batch_size": micro, "seed": 0}
        if name == "zero3-checkpointed":
            train["activation_checkpointing"] = "full"
        p = plait.Plait(parallel=parallel, train=train, run={"dir": f"{root}/{name}"}, optim={"grad_clip": 1.0},
                        observe={"progress": False, "trackers": []})
        model, _ = p.setup(build(), optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=LR),
                           loss_fn="classification", **kwargs)
        losses = []
        for batch in p.setup_dataloader(data()):
            p.forward_backward(model, batch)
            info = p.step()
            if info is not None:
                losses.append(p.reduce(info.loss))
            if p.steps == STEPS:
                break
        out[name] = {"losses": losses, "state": p.full_state_dict(model)}
        p.close()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(_worker, 2, str(tmp_path_factory.mktemp("escape")), timeout=300)


@pytest.mark.parametrize("name", sorted(CASES))
def test_user_model_layout_matches_one_process(results, name) -> None:
    ref_losses, ref_state = reference()
    for r in results:
        assert r[name]["losses"] == pytest.approx(ref_losses, abs=LOSS_ATOL)
        assert r[name]["state"].keys() == ref_state.keys()
        assert max((r[name]["state"][k] - v).abs().max().item() for k, v in ref_state.items()) < PARAM_ATOL
