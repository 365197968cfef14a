"""What the tests share: ``run_ranks`` (spawned gloo ranks, ``plait.runtime.spawn``) and checks on runs.

``run_ranks(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks
(one thread each) and returns the results by rank; a rank that raises or dies makes it raise
``SpawnError`` with that rank's traceback; a group that hangs fails after ``timeout`` seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from plait.runtime.spawn import spawn_ranks


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0,
              pg_timeout_s: float = 60.0) -> list[Any]:
    """``spawn_ranks`` under the name and keywords the tests use; the group is named after ``fn``."""
    return spawn_ranks(fn, world_size, *args, timeout_s=timeout, pg_timeout_s=pg_timeout_s, name=fn.__name__)


def logged_losses(run_dir: str) -> list[float]:
    """The training losses a run logged in metrics.jsonl, in step order."""
    import json
    from pathlib import Path

    lines = [json.loads(x) for x in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines if "loss" in r]


def assert_same_training(ref_dir: str, got_dir: str, *, atol: float, loss_tol: float, steps: int) -> None:
    """Two runs ended with the same exported weights (within ``atol``) after logging the same
    ``steps`` losses (within ``loss_tol``), and training did move the weights."""
    import torch
    from safetensors.torch import load_file

    ref, got = load_file(f"{ref_dir}/model.safetensors"), load_file(f"{got_dir}/model.safetensors")
    assert ref.keys() == got.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=atol, rtol=0, msg=f"{got_dir}: {k}")
    a, b = logged_losses(ref_dir), logged_losses(got_dir)
    assert len(a) == len(b) == steps
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < loss_tol
    assert a[-1] < a[0]
