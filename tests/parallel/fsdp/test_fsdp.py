"""ZeRO-3 (FSDP2 via apply_fsdp) against a single-process reference from the same weights and data.

Tolerance as in test_zero.py: reduction order differs from the single-process reference (float32
rounding), 2e-5 absolute on parameters after 5 AdamW steps at lr=1e-3, 1e-5 relative on losses.
"""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager

import pytest
import torch
from helpers import run_ranks
from references import distributed_run, dp_model, dp_reference, param_groups

from plait.parallel.fsdp import shard as fsdp
from plait.parallel.zero.optimizer import ZeroConfigError

LR = 1e-3


def _adamw(model):
    return torch.optim.AdamW(param_groups(model), lr=LR, betas=(0.9, 0.95))


class _FsdpStep:
    """The three calls the minimal loop makes, for an FSDP2 model and a plain torch optimizer."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def clip_grad_norm_(self, max_norm):
        return fsdp.clip_grad_norm_(self.model, max_norm)

    def step(self):
        self.opt.step()

    def zero_grad(self, set_to_none=True):
        self.opt.zero_grad(set_to_none=set_to_none)


def _fsdp_worker(rank, world, cases):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out = []
    for accum, clip, reshard in cases:
        model = fsdp.apply_fsdp(dp_model(), mesh, reshard_after_forward=reshard)
        opt = _FsdpStep(model, _adamw(model))

        @contextmanager
        def no_sync(model=model):
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)

        losses = distributed_run(model, opt, rank, world, accum, clip, no_sync=no_sync)
        full = {k: v.full_tensor().detach().numpy().copy() for k, v in model.state_dict().items()}
        out.append((losses, full, model.head.weight is model.tok_emb.weight))
    return out


CASES = [(2, 0.05, True), (1, 0.0, False)]  # accumulation + active clipping; then ZeRO-2-like reshard


def _two_ranks_worker(rank: int, world: int, root: str) -> dict:
    """Every 2-rank check of this file in one spawned group (the suite's time goes mostly to starting ranks)."""
    return {"fsdp": _fsdp_worker(rank, world, CASES), "rejects": _rejects_worker(rank, world),
            "t5": _t5_zero3(rank, world, root) if importlib.util.find_spec("transformers") else None}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(_two_ranks_worker, 2, str(tmp_path_factory.mktemp("fsdp2")), timeout=600)


def test_fsdp_matches_single_process(two_ranks):
    for ci, (_, clip, _) in enumerate(CASES):
        ref_losses, ref_params = dp_reference(_adamw, clip)
        for r in two_ranks:
            losses, params, tied = r["fsdp"][ci]
            assert tied
            assert losses == pytest.approx(ref_losses, rel=1e-5)
            for k, v in ref_params.items():
                torch.testing.assert_close(torch.from_numpy(params[k]), v, atol=2e-5, rtol=0, msg=k)


def _rejects_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    errors = []
    for kwargs in ({"offload": "params"}, {"offload": "optimizer"}):
        try:
            fsdp.apply_fsdp(dp_model(), mesh, **kwargs)
        except ZeroConfigError as e:
            errors.append(str(e))
    # a one-rank data-parallel mesh: nothing to shard
    one = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)) if world == 1 else None
    if one is None:
        # every rank must create every group, in the same order; each keeps its own
        sub = [torch.distributed.new_group([r]) for r in range(world)][rank]
        from torch.distributed.device_mesh import DeviceMesh

        one = DeviceMesh.from_group(sub, "cpu")
    try:
        fsdp.apply_fsdp(dp_model(), one)
    except ZeroConfigError as e:
        errors.append(str(e))
    return errors


def test_fsdp_rejects_impossible_combinations(two_ranks):
    errors = two_ranks[0]["rejects"]
    assert len(errors) == 3
    assert "needs an accelerator" in errors[0] and "parallel.offload=none" in errors[0]
    assert "'none' or 'params'" in errors[1]
    assert "has 1 rank" in errors[2]


# -- T5 at ZeRO-3: every T5Block returns the relative position bias, a view, beside its hidden states ---------
T5_STEPS, T5_LR = 3, 1e-2


def _t5() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0))


def _t5_batches() -> torch.Tensor:
    return torch.randint(1, 64, (T5_STEPS, 4, 6), generator=torch.Generator().manual_seed(3))  # (steps, B, T)


def _t5_zero3(rank: int, world: int, root: str) -> dict:
    """plait's ZeRO-3 through the keep-your-loop API (each rank its half of every global batch of 4); the
    warnings raised in the loop are returned."""
    import warnings

    import plait

    p = plait.Plait(parallel={"zero": 3}, run={"dir": root}, train={"global_batch_size": 4},
                    observe={"progress": False, "trackers": []})
    model, _ = p.setup(_t5(), optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=T5_LR))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in _t5_batches():
            mine = x[2 * rank:2 * rank + 2]
            p.backward(model(input_ids=mine, labels=mine).loss)
            p.step()
    state = p.full_state_dict(model)
    p.close()
    return {"state": state, "warnings": [str(w.message) for w in caught]}


def test_t5_at_zero3_matches_one_process_without_view_warnings(two_ranks) -> None:
    """The same loop in one process (the whole batch of 4); parameters after 3 AdamW steps within 2e-5 (the
    file's tolerance: the mean over 2 ranks' halves is rounded differently), and no FSDP2 view warning."""
    pytest.importorskip("transformers", reason="the hf extra (pip install 'plait[hf]') is not installed")
    got = [r["t5"] for r in two_ranks]
    model = _t5()
    opt = torch.optim.AdamW(model.parameters(), lr=T5_LR)
    for x in _t5_batches():
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    ref = model.state_dict()
    for rank in (0, 1):
        assert not [w for w in got[rank]["warnings"] if "view tensor" in w], got[rank]["warnings"]
        assert got[rank]["state"].keys() == ref.keys()
        for k, v in ref.items():
            torch.testing.assert_close(got[rank]["state"][k], v, atol=2e-5, rtol=0, msg=k)
    assert not torch.equal(ref["shared.weight"], _t5().state_dict()["shared.weight"])  # training moved it


def test_view_outputs_of_a_unit_are_copied() -> None:
    """The hook alone: a view that requires grad is copied (same values, its own storage, gradients flow);
    other outputs, and everything under no_grad, are left as they are."""
    w = torch.randn(3, 4, requires_grad=True)
    plain = torch.randn(2)
    out = fsdp._copy_view_outputs(torch.nn.Identity(), (), (w.t(), plain, {"b": w[0]}))
    assert out[1] is plain and out[0]._base is None and out[2]["b"]._base is None
    assert torch.equal(out[0], w.t()) and torch.equal(out[2]["b"], w[0])
    (out[0].sum() + out[2]["b"].sum()).backward()
    assert torch.equal(w.grad, torch.ones(3, 4) + torch.cat([torch.ones(1, 4), torch.zeros(2, 4)]))
    assert fsdp._copy_view_outputs(torch.nn.Identity(), (), (plain, w * 2)) is None
    with torch.no_grad():
        assert fsdp._copy_view_outputs(torch.nn.Identity(), (), (w.t(),)) is None


def test_a_weight_tied_across_fsdp_units_is_refused() -> None:
    """A weight shared by a module inside a block and one outside it: fully_shard of the block would give the
    block's module a sharded tensor and leave the outside one on the old tensor, untied."""
    from plait.parallel.zero.optimizer import ZeroConfigError

    class Shared(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(8, 4)
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 8, bias=False), torch.nn.Linear(8, 4)])
            self.head = torch.nn.Linear(4, 8, bias=False)
            self.head.weight = self.emb.weight  # a tie within the root unit: allowed

    model = Shared()
    fsdp.check_ties_within_units(model, list(model.blocks))
    model.blocks[0].weight = model.emb.weight  # now a block uses it too
    with pytest.raises(ZeroConfigError, match=r"ties one weight across units: emb.weight \(root\), blocks.0.weight "
                                              r"\(block 0\), head.weight \(root\)"):
        fsdp.check_ties_within_units(model, list(model.blocks))
