"""Hang detection: a rank that skips a collective makes the others raise a named error in time."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from helpers import run_ranks

from plait.comm.guard import CollectiveGuard, CollectiveTimeout

TIMEOUT_S = 2.0


def _skip_one(rank: int, n: int, async_marks: bool) -> dict:
    store = dist.distributed_c10d._get_default_store()
    guard = CollectiveGuard(store, TIMEOUT_S, rank, async_marks=async_marks)
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
        guard.close()
        return out
    start = time.monotonic()
    try:
        guard.run("grad_allreduce", None, 2, lambda: dist.all_reduce(t, async_op=True))
    except CollectiveTimeout as e:
        out["error"] = str(e)
    out["elapsed"] = time.monotonic() - start
    guard.close()
    return out


def test_skipped_collective_raises_named_timeout() -> None:
    results = run_ranks(_skip_one, 3, True)  # the default, background-thread marks
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


@pytest.mark.parametrize("async_marks", [True, False])
def test_missing_ranks_read_from_the_store(async_marks: bool) -> None:
    store = dist.HashStore()
    guards = [CollectiveGuard(store, 1.0, r, async_marks=async_marks) for r in range(3)]
    guards[0]._mark("g", 2)
    guards[1]._mark("g", 1)  # rank 1 is one collective behind; rank 2 never issued any
    for g in guards:
        g.close()
    assert guards[0]._missing("g", [0, 1, 2], 2) == [1, 2]
    assert guards[0]._missing("g", [0, 1, 2], 1) == [2]
