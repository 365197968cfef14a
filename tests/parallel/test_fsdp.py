"""ZeRO-3 (FSDP2 via apply_fsdp) against a single-process reference from the same weights and data.

Tolerance as in test_zero.py: reduction order differs from the single-process reference (float32
rounding), 2e-5 absolute on parameters after 5 AdamW steps at lr=1e-3, 1e-5 relative on losses.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from helpers import run_ranks
from references import distributed_run, dp_model, dp_reference, param_groups

from plait.parallel import fsdp
from plait.parallel.zero import ZeroConfigError

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


def _both(rank, world):
    """The equivalence runs, then the refusals, in one spawn of 2 ranks."""
    return {"runs": _fsdp_worker(rank, world, CASES), "errors": _rejects_worker(rank, world)}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_both, 2)


def test_fsdp_matches_single_process(two_ranks):
    cases = CASES
    per_rank = [r["runs"] for r in two_ranks]
    for ci, (_, clip, _) in enumerate(cases):
        ref_losses, ref_params = dp_reference(_adamw, clip)
        for r in per_rank:
            losses, params, tied = r[ci]
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
    errors = two_ranks[0]["errors"]
    assert len(errors) == 3
    assert "needs an accelerator" in errors[0] and "parallel.offload=none" in errors[0]
    assert "'none' or 'params'" in errors[1]
    assert "has 1 rank" in errors[2]
