"""The collective part of ``plait calibrate``: latency and bandwidth of the backend's collectives.

Ranks are spawned processes (one CPU thread each) on a gloo process group, as ``plait train`` runs them
on CPU. For each collective and message size: a barrier, then enough back-to-back calls to last
``min_time`` (10 ms), timed on every rank; the slowest rank's mean call time is one sample, the fastest
of five samples the measurement (other processes only ever slow a sample down). Send/recv is a
ping-pong between two ranks (one way = half the round trip). Sizes are the bytes of the buffer the cost
model counts (``plait.plan.network``: the reduced buffer, the gathered output, the scattered input, the
message). ``fit`` returns ``alpha + beta x bytes`` by least squares on
relative error, so small and large messages weigh alike.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from plait.comm.collectives import all_gather_flat
from plait.runtime.spawn import spawn_ranks

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
# torch 2.13 renamed the flat-tensor collectives; older releases lack the new names (all_gather_flat likewise)
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def fit(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """(alpha, beta) minimising sum(((alpha + beta s - t) / t)^2) over (bytes s, seconds t) samples."""
    sw = swx = swxx = swy = swxy = 0.0
    for s, t in samples:
        w = 1.0 / (t * t)
        sw, swx, swxx, swy, swxy = sw + w, swx + w * s, swxx + w * s * s, swy + w * t, swxy + w * s * t
    det = sw * swxx - swx * swx
    if det <= 0:
        return samples[0][1], 0.0
    beta = (sw * swxy - swx * swy) / det
    alpha = (swy - beta * swx) / sw
    return max(alpha, 0.0), max(beta, 0.0)


def _call(op: str, nbytes: int, world: int) -> Any:
    n = max(world, nbytes // 4 // world * world)
    if op == "all_reduce":
        buf = torch.zeros(n)
        return lambda: dist.all_reduce(buf)
    if op == "all_gather":
        out, part = torch.zeros(n), torch.zeros(n // world)
        return lambda: all_gather_flat(out, part)
    if op == "reduce_scatter":
        inp, out = torch.zeros(n), torch.zeros(n // world)
        return lambda: reduce_scatter_flat(out, inp)
    if op == "all_to_all":  # the expert dispatcher's collective: equal splits of the input
        inp, out = torch.zeros(n), torch.zeros(n)
        return lambda: dist.all_to_all_single(out, inp)
    buf = torch.zeros(n)
    return lambda: dist.broadcast(buf, src=0)


def _time_collective(fn: Any, min_time: float) -> float:
    fn()
    dist.barrier()
    start = time.perf_counter()
    fn()
    probe = torch.tensor([time.perf_counter() - start])
    dist.broadcast(probe, src=0)
    calls = max(1, int(min_time / max(float(probe), 1e-6)))
    samples = []
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = torch.tensor([(time.perf_counter() - start) / calls])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        samples.append(float(elapsed))
    return min(samples)


def _ping_pong(nbytes: int) -> float:
    buf = torch.zeros(max(1, nbytes // 4))
    rank = dist.get_rank()
    samples = []
    for i in range(6):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        if i:  # the first round trip warms the connection
            samples.append((time.perf_counter() - start) / 2)
    value = torch.tensor([min(samples) if rank == 0 else 0.0])
    dist.broadcast(value, src=0)
    return float(value)


def dtensor_overhead(world: int, min_time: float) -> float:
    """Seconds DTensor adds to one operator (its sharding propagation and unwrapping): a replicated DTensor
    add against a plain add of the same one-element tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from plait.runtime.timing import timed

    mesh = init_device_mesh("cpu", (world,))
    x, y = torch.ones(1), torch.ones(1)
    a, b = (distribute_tensor(t, mesh, [Replicate()]) for t in (x, y))
    return max(timed(lambda: a + b, min_time) - timed(lambda: x + y, min_time), 0.0)


def _worker(rank: int, world: int, sizes: tuple[int, ...], min_time: float) -> list[Any] | None:
    """One calibration rank: every collective at every size; rank 0 returns the rows."""
    rows: list[Any] = []
    for op in OPS:
        samples = [(float(s), _time_collective(_call(op, s, world), min_time)) for s in sizes]
        rows.append((op, samples))
    if world == 2:
        rows.append(("send", [(float(s), _ping_pong(s)) for s in sizes]))
        rows.append(("dtensor_overhead", dtensor_overhead(world, min_time)))
    return rows if rank == 0 else None


def measure_collectives(worlds: tuple[int, ...], sizes: tuple[int, ...], min_time: float = 0.01,
                        timeout_s: float = 600) -> tuple[list[dict], float]:
    """Fitted rows ``{op, world, alpha_s, beta_s_per_byte, samples}`` for every collective and world size, and
    the DTensor per-operator overhead (measured at world 2; 0 when world 2 is not measured)."""
    table, dtensor = [], 0.0
    for world in worlds:
        rows = spawn_ranks(_worker, world, sizes, min_time, timeout_s=timeout_s, pg_timeout_s=120,
                           name=f"calibration ranks at world {world}")[0]
        for op, samples in rows:
            if op == "dtensor_overhead":
                dtensor = float(samples)
                continue
            alpha, beta = fit(samples)
            table.append({"op": op, "world": world, "alpha_s": alpha, "beta_s_per_byte": beta,
                          "samples": [[int(s), t] for s, t in samples]})
    return table, dtensor

