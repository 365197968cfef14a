"""plait.runtime.spawn: results by rank, failures with their tracebacks, a hung group ended, and the two
ordering rules (the store outlives every rank; no rank tears down while a peer still runs); and
plait.runtime.group's leaving together."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from plait.runtime.group import leave_process_group
from plait.runtime.spawn import RankGroup, SpawnError, spawn_ranks


def _sum_and_late_store_use(rank: int, world: int, late_s: float) -> dict:
    """Rank 0 returns at once; the last rank uses the store ``late_s`` later and sees whether rank 0's
    process is still there (it must be: it waits for every rank before it exits)."""
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    store = dist.distributed_c10d._get_default_store()
    store.set(f"pid{rank}", str(os.getpid()))
    out = {"sum": t.item(), "threads": torch.get_num_threads(), "env": (os.environ["RANK"], os.environ["WORLD_SIZE"])}
    if rank == world - 1:
        time.sleep(late_s)
        store.set("late", "written after rank 0 returned")  # the store is still served
        out["late"] = store.get("late").decode()
        try:
            os.kill(int(store.get("pid0")), 0)
            out["rank0_alive"] = True
        except ProcessLookupError:
            out["rank0_alive"] = False
    start = time.monotonic()
    leave_process_group()  # the first ranks wait here for the last one
    out["left_after_s"], out["initialized"] = time.monotonic() - start, dist.is_initialized()
    return out


def test_results_by_rank_and_no_rank_leaves_before_the_others() -> None:
    out = spawn_ranks(_sum_and_late_store_use, 3, 1.5)
    assert [r["sum"] for r in out] == [6.0, 6.0, 6.0]
    assert [r["env"] for r in out] == [("0", "3"), ("1", "3"), ("2", "3")]
    assert all(r["threads"] == 1 for r in out)
    assert out[2]["late"] == "written after rank 0 returned" and out[2]["rank0_alive"] is True
    # plait.runtime.group: every rank left together, then the group was gone
    assert out[0]["left_after_s"] >= 1.0 and not any(r["initialized"] for r in out), out


def _fail_in_three_ways(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 broke on purpose")
    if rank == 2:
        time.sleep(0.5)
        os._exit(3)
    time.sleep(600)  # rank 0 hangs: the group is ended after the failures, not after the timeout
    return rank


def test_failures_are_reported_first_one_first_and_a_hung_rank_is_killed() -> None:
    start = time.monotonic()
    with pytest.raises(SpawnError) as e:
        spawn_ranks(_fail_in_three_ways, 3, timeout_s=300, name="three-ways")
    elapsed = time.monotonic() - start
    msg = str(e.value)
    assert msg.index("three-ways: rank 1 failed:") < msg.index("three-ways: rank 2 failed:"), msg
    assert "ValueError: rank 1 broke on purpose" in msg and "_fail_in_three_ways" in msg
    assert "rank 2 failed:\nits process exited with code 3 without a result" in msg
    assert "rank 0 failed:\ngave no result before the group was ended" in msg
    by_rank = {o.rank: o for o in e.value.outcomes}
    assert by_rank[2].exitcode == 3 and by_rank[0].exitcode == -9  # rank 0 was killed
    assert elapsed < 60, elapsed  # start-up and the failure grace, not the 300 s timeout


def _sleep(rank: int, world: int, seconds: float) -> None:
    time.sleep(seconds)


def test_a_group_past_its_timeout_is_killed_and_named() -> None:
    with RankGroup(_sleep, 2, (600.0,), name="sleepers") as group:
        outcomes = group.wait(timeout_s=8)
    assert [o.error for o in outcomes] == ["did not finish in 8 s"] * 2
    assert all(o.exitcode == -9 for o in outcomes)
    assert all(not p.is_alive() for p in group.procs)


def _exit_handler_and_start_method(rank: int, world: int, marker: str) -> str:
    """Registers an exit handler that writes ``marker``-rank; returns the default start method a rank has."""
    import atexit
    import multiprocessing
    from pathlib import Path

    atexit.register(lambda: Path(f"{marker}-{rank}").write_text("ran"))
    return multiprocessing.get_start_method()


def test_a_forked_rank_behaves_as_a_fresh_interpreter(tmp_path) -> None:
    """Forked from the fork server, a rank still runs its exit handlers (trackers flush there) and starts its own
    processes (a data loader's workers) with the platform's default method, as a fresh interpreter would:
    ``plait.runtime.forked``."""
    import multiprocessing

    marker = str(tmp_path / "atexit")
    methods = spawn_ranks(_exit_handler_and_start_method, 2, marker)
    assert methods == [multiprocessing.get_all_start_methods()[0]] * 2
    assert [(tmp_path / f"atexit-{r}").read_text() for r in range(2)] == ["ran", "ran"]
