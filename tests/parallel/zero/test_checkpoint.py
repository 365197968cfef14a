"""Resharding round trip through torch.distributed.checkpoint: zero=2 dp=2 -> plain AdamW dp=1, and
the reverse. Loaded optimizer states are identical (exact); continuing training matches the run
that never stopped within 2e-5 on parameters (reduction order differs, as in test_zero.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import run_ranks
from references import distributed_run, dp_model, dp_reference_steps, param_groups
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from plait.parallel.zero.optimizer import ZeroOptimizer

LR, FIRST, MORE = 1e-3, 3, 2


def _adamw(model):
    return torch.optim.AdamW(param_groups(model), lr=LR, betas=(0.9, 0.95))


def _zero2(model):
    return ZeroOptimizer(model, param_groups(model), torch.optim.AdamW, stage=2, bucket_mb=0.02,
                         lr=LR, betas=(0.9, 0.95))


def _np_state(osd):
    return {fqn: {k: v.detach().numpy().copy() for k, v in st.items()} for fqn, st in osd["state"].items()}


def _params(model):
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _ranks_worker(rank, world, save_dir, load_dir):
    # zero=2 dp=2 trains, saves, and goes on (the run that never stopped)
    model = dp_model()
    opt = _zero2(model)
    distributed_run(model, opt, rank, world, 1, 0.0, steps=FIRST)
    saved = opt.state_dict()
    dcp.save({"model": model.state_dict(), "optim": saved}, checkpoint_id=save_dir)
    cont = distributed_run(model, opt, rank, world, 1, 0.0, steps=MORE, first=FIRST)
    out = {"saved": _np_state(saved), "cont": cont, "params": _params(model)}
    # zero=2 dp=2 resumes a plain dp=1 checkpoint
    model = dp_model(seed=123)  # different weights: everything must come from the checkpoint
    opt = _zero2(model)
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(sd, checkpoint_id=load_dir)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    out["loaded"] = _np_state(opt.state_dict())
    out["resumed"] = distributed_run(model, opt, rank, world, 1, 0.0, steps=MORE, first=FIRST)
    out["resumed_params"] = _params(model)
    return out


def _assert_states_equal(a, b):
    assert a.keys() == b.keys()
    for fqn in a:
        assert a[fqn].keys() == b[fqn].keys()
        for k in a[fqn]:
            np.testing.assert_array_equal(np.asarray(a[fqn][k]), np.asarray(b[fqn][k]), err_msg=f"{fqn}.{k}")


def _assert_params_close(a, b):
    for k in b:
        np.testing.assert_allclose(a[k], b[k], atol=2e-5, rtol=0, err_msg=k)


def test_reshard_zero2_dp2_and_plain_dp1(tmp_path):
    # plain AdamW dp=1 trains, saves, and goes on
    model = dp_model()
    opt = _adamw(model)
    dp_reference_steps(model, opt, 0.0, FIRST)
    plain_osd = get_optimizer_state_dict(model, opt)
    dcp.save({"model": model.state_dict(), "optim": plain_osd}, checkpoint_id=str(tmp_path / "plain"))
    plain_saved = _np_state(plain_osd)  # a copy: the optimizer's own tensors change as training goes on
    plain_cont = dp_reference_steps(model, opt, 0.0, MORE, first=FIRST)
    plain_params = _params(model)

    res = run_ranks(_ranks_worker, 2, str(tmp_path / "zero2"), str(tmp_path / "plain"))

    # zero=2 dp=2 -> plain dp=1
    model = dp_model(seed=123)
    opt = _adamw(model)
    sd = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=str(tmp_path / "zero2"))
    model.load_state_dict(sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    _assert_states_equal(_np_state(get_optimizer_state_dict(model, opt)), res[0]["saved"])
    resumed = dp_reference_steps(model, opt, 0.0, MORE, first=FIRST)
    assert resumed == pytest.approx(res[0]["cont"], rel=1e-5)
    _assert_params_close(_params(model), res[0]["params"])

    # plain dp=1 -> zero=2 dp=2
    for r in res:
        _assert_states_equal(r["loaded"], plain_saved)
        assert r["resumed"] == pytest.approx(plain_cont, rel=1e-5)
        _assert_params_close(r["resumed_params"], plain_params)
