"""Hang detection: a rank that skips a collective makes the others raise a named error in time."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from helpers import run_ranks

from plait.comm.guard import CollectiveGuard, CollectiveTimeout

TIMEOUT_S = 2.0


def _skip_one(rank: int, n: int) -> dict:
    store = dist.distributed_c10d._get_default_store()
    guard = CollectiveGuard(store, TIMEOUT_S, rank)
    out: dict = {}
    # Step 1: rank 2 is late but within the timeout, so everyone completes.
    if rank == 2:
        time.sleep(0.5)
    t = torch.ones(3)
    guard.run("grad_allreduce", None, 1, lambda: dist.all_reduce(t, async_op=True))
    out["sum"] = t.tolist()
    # Step 2: rank 2 skips the collective.
    if rank == 2:
        time.sleep(TIMEOUT_S + 3)  # stay alive past the others' timeout, as a stuck rank would
        return out
    start = time.monotonic()
    try:
        guard.run("grad_allreduce", None, 2, lambda: dist.all_reduce(t, async_op=True))
    except CollectiveTimeout as e:
        out["error"] = str(e)
    out["elapsed"] = time.monotonic() - start
    return out


def test_skipped_collective_raises_named_timeout() -> None:
    results = run_ranks(_skip_one, 3)
    assert all(r["sum"] == [3.0, 3.0, 3.0] for r in results)
    for rank in (0, 1):
        msg = results[rank].get("error", "")
        assert "collective 'grad_allreduce'" in msg, results[rank]
        assert "ranks [0, 1, 2]" in msg and "at step 2" in msg
        assert "ranks [2] did not arrive" in msg
        assert results[rank]["elapsed"] <= TIMEOUT_S + 5
    assert "error" not in results[2]


def test_guard_rejects_blocking_calls_and_bad_timeouts() -> None:
    store = dist.HashStore()
    with pytest.raises(ValueError, match="positive seconds"):
        CollectiveGuard(store, 0, 0)
    guard = CollectiveGuard(store, 1.0, 0)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(None)
    assert guard._wait(fut) is True
    with pytest.raises(TypeError, match="async_op=True"):
        guard._wait(None)
