"""Spawn gloo ranks from a test and collect what each returns.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` spawned processes, initializes a gloo
process group in each (one thread per rank), calls ``fn(rank, world_size, *args)`` and returns the
list of results, indexed by rank. A rank that raises makes the call raise with that rank's
traceback; a rank that hangs makes it fail after ``timeout`` seconds instead of hanging the suite.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results: Any,
            pg_timeout_s: float) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        out = fn(rank, world_size, *args)
        # Plain pickle sends tensors by value; the queue's own pickler would pass shared-memory handles
        # that die with this process.
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # report every failure to the parent, whatever it is
        results.put((rank, "error", traceback.format_exc()))
    finally:
        # Flush the result to the parent before tearing the group down: a group with a collective
        # still pending (a test that leaves a peer stuck on purpose) can abort the process in
        # ``destroy_process_group``, which would otherwise lose the queued result.
        results.close()
        results.join_thread()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0,
              pg_timeout_s: float = 60.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results, pg_timeout_s))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, status, value = results.get(timeout=timeout)
            if status == "ok":
                out[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
    except queue.Empty:
        errors.append(f"ranks {sorted(set(range(world_size)) - set(out))} did not finish in {timeout}s")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [out[r] for r in range(world_size)]


def logged_losses(run_dir: str) -> list[float]:
    """The training losses a run logged in metrics.jsonl, in step order."""
    import json
    from pathlib import Path

    lines = [json.loads(x) for x in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines if "loss" in r]


def run_weights(run_dir: Any) -> dict:
    """The weights a run exported at its end (``RUN_DIR/model/``, a Hugging Face directory), whole."""
    from plait.components.hf_checkpoint import read_weights

    return read_weights(run_dir)


def assert_same_training(ref_dir: str, got_dir: str, *, atol: float, loss_tol: float, steps: int) -> None:
    """Two runs ended with the same exported weights (within ``atol``) after logging the same
    ``steps`` losses (within ``loss_tol``), and training did move the weights."""
    import torch
    ref, got = run_weights(ref_dir), run_weights(got_dir)
    assert ref.keys() == got.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=atol, rtol=0, msg=f"{got_dir}: {k}")
    a, b = logged_losses(ref_dir), logged_losses(got_dir)
    assert len(a) == len(b) == steps
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < loss_tol
    assert a[-1] < a[0]
