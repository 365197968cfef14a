"""The code-path part of ``plait calibrate``: per-event costs of plait's parallel layouts on this machine.

Tensor parallelism, ZeRO-3 (FSDP2) and pipelining each run host work that neither a kernel nor a
collective accounts for: DTensor's sharding propagation, redistribution and wrapping around every
operator; FSDP2's copy-in, copy-out, hooks and parameter swaps around every unit's all-gather and
reduce-scatter; the pipeline schedule's receive and send set-up and stage bookkeeping around every
action. On a GPU that work runs ahead of the device; on a CPU it is on the rank's only thread, and with
a small model it dominates (tensor parallelism at world 2 was 2.4x slower than one process here).

First, ``step``: plait's own host work once per optimizer step outside any operator (the engine's timing,
metrics, gradient bookkeeping), the residual of the tiny GPT at world 1 (no parallel code path).
What DTensor adds to one operator (``dtensor``) is timed next, on plait's optimizer step: AdamW over
sharded DTensor parameters against the same step over plain tensors, per operator it runs. The rest
is measured on the code path itself: spawned gloo ranks (world 2, one thread each, as
``plait train`` runs them) train a tiny GPT (``TINY``) with the real layout (tp=2; zero=3; pp=2 with
1F1B) for a few steps; the median step after a warm-up (the figure ``plait simulate --compare`` and the
validation bench compare with) is compared with the simulator's prediction of that same run on this
profile. The simulator is linear in each per-event constant
(every event it prices adds the constant once to the rank's time), so the constant is

    c = (measured - predicted(c=0)) / (predicted(c=h) - predicted(c=0)) x h,   h = 1 ms,

clamped at 0: the residual over the number of events on the step's critical path, as the simulator
itself counts them: ``tp_collective``, per tensor-parallel collective (recorded from the real plan by
``plait.plan.derive.tp_collectives``): the redistribution around it and the ranks meeting after compute
that a back-to-back collective benchmark does not see; ``fsdp_unit``, per FSDP2 unit all-gather or
reduce-scatter; ``pipeline_action``, per schedule action. Each run's DTensor operators are priced with
``dtensor`` already. The tiny model is not
one the validation bench predicts, and one set of constants serves every layout and model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import statistics
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from plait.models.tiny import model_flags, tiny_config

TINY = [*model_flags(tiny_config(seq_len=32)), "--parallel.nproc=2", "--train.global_batch_size=16",
        "--train.micro_batch_size=8", "--train.eval_every=0", "--checkpoint.every=0", "--observe.progress=false",
        "--observe.trackers=[]", "--train.log_every=1", "--optim.warmup_steps=1",
        "--optim.grad_clip=1.0"]  # clipped, as the gpt recipe trains
WORLD1 = ["--parallel.nproc=1"]  # after TINY's world 2: the later flag wins
PATHS = {  # constant -> the layout whose residual it carries, in the order they are derived
    "step": WORLD1,
    "tp_collective": ["--parallel.tp=2"],
    "fsdp_unit": ["--parallel.zero=3"],
    "pipeline_action": ["--parallel.pp=2", "--parallel.pp_schedule=1f1b", "--parallel.microbatches=4"],
}
WARMUP, STEPS = 4, 12
TENSORS = 32
PROBE_S = 1e-3


def _worker(rank: int, world: int, overrides: list[str], run_dir: str, build_trainer: Any) -> float:
    """The median step of the tiny run (the figure a run's step time is compared by), each rank building its
    trainer with ``build_trainer(cfg)``."""
    from plait.config import load_config
    from plait.validate import validate

    cfg = validate(load_config(overrides=TINY + overrides + [f"--run.dir={run_dir}", "--train.steps=100000"]), world)
    trainer = build_trainer(cfg)
    times = [trainer.train_step()["step_s"] for _ in range(WARMUP + STEPS)][WARMUP:]
    return statistics.median(times)


def _dtensor_worker(rank: int, world: int, _: list[str], __: str, ___: Any) -> float:
    """Seconds DTensor adds to one operator of plait's optimizer step: AdamW over ``TENSORS`` sharded
    DTensor parameters against the same step over their plain local shards, over the operators per tensor."""
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from plait.components.optim import adamw
    from plait.config import Config
    from plait.plan.record import optimizer_traffic

    cfg = Config()
    mesh = init_device_mesh("cpu", (world,))

    def step_time(dtensor: bool) -> float:
        params = []
        for i in range(TENSORS):
            full = torch.ones(16 * world, 16)
            t = distribute_tensor(full, mesh, [Shard(0)]) if dtensor else full[:16].clone()
            q = torch.nn.Parameter(t)
            q.grad = torch.ones_like(q)
            params.append((f"w{i}", q))
        opt = adamw(params, cfg.optim)
        for _ in range(3):
            opt.step()
        best = float("inf")
        for _ in range(5):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(10):
                opt.step()
            best = min(best, (time.perf_counter() - start) / 10)
        return best

    ops_per_tensor = optimizer_traffic(cfg)[0]
    return max((step_time(True) - step_time(False)) / (ops_per_tensor * TENSORS), 0.0)


def measure_step(overrides: list[str], world: int = 2, timeout_s: float = 300, target: Any = None,
                 build_trainer: Callable[[Any], Any] | None = None) -> float:
    """Median step seconds of the tiny GPT with ``overrides`` on ``world`` spawned gloo ranks (the last
    ``--parallel.nproc`` of the overrides when they set one), rank 0's figure, each rank building its
    ``Trainer`` with ``build_trainer(cfg)`` (``plait.recipes.build_trainer``: the caller passes it, the
    calibration does not know the recipes); ``target``: another worker of this module with the same signature,
    whose one number is returned. Each rank runs ``$OMP_NUM_THREADS`` threads (one unless set)."""
    from plait.runtime.spawn import spawn_ranks

    nproc = [o.split("=", 1)[1] for o in overrides if o.startswith("--parallel.nproc=")]
    world = int(nproc[-1]) if nproc else world
    with tempfile.TemporaryDirectory(prefix="plait-calibrate-") as tmp:
        return float(spawn_ranks(target or _worker, world, overrides, tmp, build_trainer, timeout_s=timeout_s,
                                 pg_timeout_s=120, threads=int(os.environ.get("OMP_NUM_THREADS", "1")),
                                 name=f"code-path calibration {overrides}")[0])


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """``OMP_NUM_THREADS=1`` for the ranks spawned inside (``_worker`` takes its thread count from it), then
    the variable as it was."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved


def with_overhead(profile: Any, key: str, seconds: float) -> Any:
    """``profile`` with its calibrated ``key`` overhead set to ``seconds`` (at one thread)."""
    cal = profile.calibration
    overhead = {**cal.overhead, key: {1: seconds}}
    return dataclasses.replace(profile, calibration=dataclasses.replace(cal, overhead=overhead))


def residual_constant(measured: float, predict: Callable[[float], float], probe: float = PROBE_S) -> float:
    """The per-event constant that makes the (linear in it) prediction match ``measured``; at least 0."""
    base = predict(0.0)
    slope = (predict(probe) - base) / probe
    if slope <= 0:
        return 0.0
    return max(0.0, (measured - base) / slope)


def calibrate_paths(profile: Any, log: Callable[[str], None] = print, measure: Callable[..., float] = measure_step,
                    build_trainer: Callable[[Any], Any] | None = None) -> dict[str, float]:
    """``{constant: seconds}`` for every entry of ``PATHS`` on the calibrated ``profile`` (see the module
    docstring). ``measure`` times a layout (the spawned tiny run, whose ranks build trainers with
    ``build_trainer``; a test may pass its own ``measure``)."""
    if measure is measure_step:
        measure = functools.partial(measure_step, build_trainer=build_trainer)
    from plait.config import load_config
    from plait.plan.configured import simulate_config

    found: dict[str, float] = {}
    with one_thread():  # the spawned ranks run one thread each
        found["dtensor"] = measure([], target=_dtensor_worker) if isinstance(measure, functools.partial) \
            else measure(["dtensor"])
        profile = with_overhead(profile, "dtensor", found["dtensor"])
        log(f"calibrate: dtensor {found['dtensor'] * 1e6:.1f} us per operator (optimizer step on DTensors)")
        for key, overrides in PATHS.items():
            cfg = load_config(None, TINY + overrides)
            measured = measure(overrides)

            def predict(c: float, cfg: Any = cfg, key: str = key, base: Any = profile) -> float:
                return simulate_config(cfg, with_overhead(base, key, c)).step_s

            found[key] = residual_constant(measured, predict)
            profile = with_overhead(profile, key, found[key])
            log(f"calibrate: {key} {found[key] * 1e6:.1f} us per event (tiny {' '.join(overrides)}: "
                f"measured {measured * 1e3:.1f} ms)")
    return found
