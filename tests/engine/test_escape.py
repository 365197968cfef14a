"""A user's own model through the generic paths and the escape hatches, against one process.

* pipeline: an ``nn.Sequential`` split at a named child (``pp_split=["2"]``), and the same model cut
  by a user's ``stage_fn``; a hand-written language model whose head is its embedding's weight, cut by a
  ``stage_fn`` (the tie spans the two stages: it must stay one weight), and the same model's stages built from
  a copy of the head, refused;
* tensor parallel: a plain two-Linear MLP with an explicit plan (``colwise`` then ``rowwise``), and the
  same through a user's ``parallelize_fn``; the tied language model through a ``parallelize_fn`` that shards the
  embedding and head alike (the tie kept), and one that shards the head only (refused);
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


V, C, T = 16, 8, 6


class TiedLM(nn.Module):
    """A user's own language model: the head is the embedding's weight (tied), two blocks between them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, C)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(C, C), nn.GELU()) for _ in range(2)])
        self.lm_head = nn.Linear(C, V, bias=False)
        self.lm_head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.emb(x)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(x)  # (B, T, V)


class TiedStage(nn.Module):
    """The user's stage, under the model's names: the embedding (first stage), some blocks, the head (last)."""

    def __init__(self, model: TiedLM, blocks: list[int], emb: nn.Module | None, lm_head: nn.Module | None) -> None:
        super().__init__()
        self.emb, self.lm_head = emb, lm_head
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.emb is not None:
            x = self.emb(x)  # token ids (B, T) -> (B, T, C)
        for block in self.blocks.values():
            x = block(x)
        return x if self.lm_head is None else self.lm_head(x)  # (B, T, V)


def _tied_stage_fn(model: TiedLM, stage: int, num_stages: int) -> nn.Module:
    if stage == 0:
        return TiedStage(model, [0], model.emb, None)
    return TiedStage(model, [1], None, model.lm_head)


def tied_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V, (GLOBAL * STEPS * 2, T + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def tied_reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    return reference_training(TiedLM(), tied_data(), GLOBAL, STEPS, LR, 0,
                              lambda model, batch: nn.functional.cross_entropy(model(batch[0]).reshape(-1, V),
                                                                               batch[1].reshape(-1)))


def _parallelize_tied(model: TiedLM, mesh) -> TiedLM:
    """The user's tensor-parallel cut of the tied model: vocabulary-parallel embedding and head (both shard the one
    table's rows), the logits gathered."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(model, mesh, {"emb": RowwiseParallel(input_layouts=Replicate()),
                                            "lm_head": ColwiseParallel(output_layouts=Replicate())})


def _parallelize_head_only(model: TiedLM, mesh) -> TiedLM:
    """A user's cut that shards the head but not the embedding it is tied to: the tie cannot hold."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    return parallelize_module(model, mesh, {"lm_head": ColwiseParallel()})


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
    "pp-stage-fn-tied": ({"pp": 2, "microbatches": 2, "pp_schedule": "gpipe"}, 8, {"stage_fn": _tied_stage_fn}),
    "tp-parallelize-fn-tied": ({"tp": 2}, 8, {"parallelize_fn": _parallelize_tied}),
}
TIED = {"pp-stage-fn-tied", "tp-parallelize-fn-tied"}


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
        tied = name in TIED
        model, _ = p.setup(TiedLM() if tied else build(),
                           optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=LR),
                           loss_fn="causal_lm" if tied else "classification", **kwargs)
        losses = []
        for batch in p.setup_dataloader(tied_data() if tied else data()):
            p.forward_backward(model, batch)
            info = p.step()
            if info is not None:
                losses.append(p.reduce(info.loss))
            if p.steps == STEPS:
                break
        out[name] = {"losses": losses, "state": p.full_state_dict(model)}
        p.close()
    p = plait.Plait(parallel={"tp": 2}, train={"global_batch_size": GLOBAL, "micro_batch_size": 8},
                    run={"dir": f"{root}/tp-tie-broken"}, observe={"progress": False, "trackers": []})
    try:
        p.setup(TiedLM(), parallelize_fn=_parallelize_head_only)
        out["tp-tie-broken"] = "accepted"
    except Exception as e:  # the test checks which error, and its words
        out["tp-tie-broken"] = f"{type(e).__name__}: {e}"
    p.close()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(_worker, 2, str(tmp_path_factory.mktemp("escape")), timeout=300)


@pytest.mark.parametrize("name", sorted(CASES))
def test_user_model_layout_matches_one_process(results, name) -> None:
    ref_losses, ref_state = tied_reference() if name in TIED else reference()
    for r in results:
        assert r[name]["losses"] == pytest.approx(ref_losses, abs=LOSS_ATOL)
        assert r[name]["state"].keys() == ref_state.keys()
        assert max((r[name]["state"][k] - v).abs().max().item() for k, v in ref_state.items()) < PARAM_ATOL


@pytest.mark.parametrize("name", sorted(TIED))
def test_tied_weights_stay_one_weight_under_a_users_split(results, name) -> None:
    for r in results:
        state = r[name]["state"]
        assert torch.equal(state["emb.weight"], state["lm_head.weight"])


def test_a_users_tensor_parallel_cut_that_unties_is_refused(results) -> None:
    for r in results:
        assert r["tp-tie-broken"].startswith("TensorParallelError: emb.weight is tied to lm_head.weight, but the plan "
                                             "shards them differently"), r["tp-tie-broken"]


def test_stages_built_from_a_copy_of_a_tied_module_are_refused() -> None:
    import copy

    from plait.parallel.pipeline.split import FunctionPipeline, check_tied_copies
    from plait.plan.schedule import PipelineConfigError

    def copying_stage_fn(model: TiedLM, stage: int, num_stages: int) -> nn.Module:
        if stage == 0:
            return TiedStage(model, [0], model.emb, None)
        return TiedStage(model, [1], None, copy.deepcopy(model.lm_head))

    model = TiedLM()
    for fn, refused in ((copying_stage_fn, True), (_tied_stage_fn, False)):
        adapter = FunctionPipeline(fn, 2)
        stages = [adapter.build_stage(model, [str(s)], is_first=s == 0, is_last=s == 1) for s in range(2)]
        if refused:
            with pytest.raises(PipelineConfigError, match="ties emb.weight and lm_head.weight .* lm_head.weight"):
                check_tied_copies(model, stages)
        else:
            check_tied_copies(model, stages)
