"""Tensor parallelism (tp=2) against data parallelism (dp=2) and one process: step time and memory.

One run, two spawned gloo ranks (one thread each). Four trainers are built from the same weights and
train on the same global batch of ``--batch`` sequences per step:

* ``single``: one process (rank 0; rank 1 waits at the barrier), the whole batch;
* ``dp2``: plait's ``GradReducer`` (bucketed gradient all-reduce overlapped with backward), half the
  batch per rank;
* ``tp2``: plait's Megatron layout (``apply_tensor_parallel``), the whole batch on both ranks, loss
  computed over vocabulary-sharded logits;
* ``tp2_sp``: the same with sequence parallelism (norms and residual stream sharded on the sequence).

Steps (forward, backward, gradient communication, AdamW update) are interleaved in rounds so that
machine noise hits every trainer alike; the step time of a distributed trainer is the slower rank's,
and the median over all timed steps is reported. Memory per rank: parameter + gradient + optimizer
state bytes counted by storage (``measure_model_state_bytes``: DTensors count their local shard, a
bucket's flat gradient buffer once) and the peak activation bytes saved for backward during one step
(``SavedTensorMeter``, leaving out the weights layers save, which are parameters). The first step's
loss of every trainer is reported to show they compute the same thing. Prints JSON; ``ratios``
divide tp2 by dp2 and by single.

    PYTHONPATH=src python bench/tensor.py [--rounds 5] [--steps-per-round 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

IMPLS = ("single", "dp2", "tp2", "tp2_sp")
FULL = {"n_layer": 4, "d_model": 512, "n_head": 8, "seq_len": 128, "vocab_size": 4096, "batch": 4}
QUICK = {"n_layer": 2, "d_model": 128, "n_head": 4, "seq_len": 64, "vocab_size": 512, "batch": 4}


@dataclass
class Trainer:
    """One implementation: ``forward_backward`` (with its gradient communication) returns the loss;
    ``step`` also applies the AdamW update and clears gradients the way that implementation must."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    forward_backward: Callable[[], float]
    zero_grad: Callable[[], None]
    active: bool

    def step(self) -> float:
        if not self.active:
            return float("nan")
        loss = self.forward_backward()
        self.optimizer.step()
        self.zero_grad()
        return loss


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=False)


def _build(impl: str, cfg, batch: tuple[torch.Tensor, torch.Tensor], rank: int) -> Trainer:
    """A trainer for ``impl`` from seed-0 weights; every rank builds every trainer (collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    from plait.comm.collectives import Comm
    from plait.models.gpt import GPT
    from plait.models.gpt.parallelize import apply_tensor_parallel
    from plait.parallel.data.reducer import GradReducer
    from plait.parallel.tensor.plan import local_value, loss_context

    torch.manual_seed(0)
    model = GPT(cfg)
    idx, tgt = batch  # (B, T) each, the same on every rank
    if impl == "single":
        opt = _optimizer(model)

        def fwd_bwd() -> float:
            loss = model(idx, tgt)
            loss.backward()
            return loss.item()

        return Trainer(model, opt, fwd_bwd, lambda: opt.zero_grad(set_to_none=True), active=rank == 0)
    if impl == "dp2":
        reducer = GradReducer(model, None, Comm(), bucket_mb=25.0)
        opt = _optimizer(model)
        half = idx.size(0) // 2
        mine = slice(rank * half, (rank + 1) * half)

        def fwd_bwd_dp() -> float:
            loss = model(idx[mine], tgt[mine])  # (B/2, T) per rank
            loss.backward()
            reducer.finish()
            mean = loss.detach().clone()
            dist.all_reduce(mean)  # for the report only: 4 bytes
            return mean.item() / 2

        # The reducer zeroes its buckets in place: the gradients stay views of the flat buffers.
        return Trainer(model, opt, fwd_bwd_dp, reducer.zero_grad, active=True)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = apply_tensor_parallel(model, mesh, sequence_parallel=impl == "tp2_sp")
    opt = _optimizer(model)

    def fwd_bwd_tp() -> float:
        with loss_context(model):
            loss = model(idx, tgt)
            loss.backward()
        return local_value(loss.detach()).item()

    return Trainer(model, opt, fwd_bwd_tp, lambda: opt.zero_grad(set_to_none=True), active=True)


def _storage_ptr(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr()


def _activation_meter(model: torch.nn.Module):
    """A ``SavedTensorMeter`` that leaves out the weights layers save for backward (they are
    parameters, counted once in the model states), so its peak is activations only."""
    from plait.parallel.memory import SavedTensorMeter

    params = {_storage_ptr(p) for p in model.parameters()}

    class ActivationMeter(SavedTensorMeter):
        def _pack(self, t: torch.Tensor):
            return t if _storage_ptr(t) in params else super()._pack(t)

        @staticmethod
        def _unpack(saved):
            return saved if isinstance(saved, torch.Tensor) else SavedTensorMeter._unpack(saved)

    return ActivationMeter()


def _measure_memory(t: Trainer) -> dict[str, int]:
    """One step: peak activation bytes saved for backward, and model-state bytes after the update
    (before the gradients are cleared, so parameters, gradients and AdamW states are all present)."""
    from plait.observe.memory import measure_model_state_bytes

    if not t.active:
        return {}
    with _activation_meter(t.model) as meter:
        t.forward_backward()
    t.optimizer.step()
    states = measure_model_state_bytes(t.model, t.optimizer)
    t.zero_grad()
    return {**{f"{k}_bytes": v for k, v in states.items()}, "activation_peak_bytes": meter.peak}


def _timed(t: Trainer) -> float:
    dist.barrier()
    start = time.perf_counter()
    t.step()
    return time.perf_counter() - start if t.active else 0.0


def _bench(args: argparse.Namespace, rank: int) -> dict:
    from plait.config import ModelConfig
    from plait.models.tiny import token_batches

    shape = QUICK if args.quick else FULL
    cfg = ModelConfig(**{k: v for k, v in shape.items() if k != "batch"}, dropout=0.0)
    batch = token_batches(1, shape["batch"], cfg.seq_len, cfg.vocab_size, seed=1)[0]
    trainers = {impl: _build(impl, cfg, batch, rank) for impl in IMPLS}
    first_loss = {impl: trainers[impl].step() for impl in IMPLS}  # also the warm-up step
    memory = {impl: _measure_memory(trainers[impl]) for impl in IMPLS}
    times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    for _ in range(args.rounds):
        for impl, t in trainers.items():
            for _ in range(args.steps_per_round):
                times[impl].append(_timed(t))
    dist.barrier()
    # The slower rank sets a distributed step's time; rank 1's zeros leave single's rank-0 times.
    slowest = {}
    for impl, values in times.items():
        v = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        slowest[impl] = statistics.median(v.tolist())
    gathered: list = [None, None]
    dist.all_gather_object(gathered, memory)
    per_rank = {impl: [m[impl] for m in gathered if m[impl]] for impl in IMPLS}
    num_params = sum(p.numel() for p in trainers["single"].model.parameters())
    tokens = shape["batch"] * cfg.seq_len
    return {"model": {**shape, "num_params": num_params}, "first_loss": first_loss,
            "step_s": slowest, "tokens_per_s": {k: tokens / v for k, v in slowest.items()},
            "memory_per_rank": per_rank, "samples_per_impl": len(times["single"])}


def _ratios(r: dict) -> dict:
    def mem(impl: str, key: str) -> int:
        return max(m[key] for m in r["memory_per_rank"][impl])

    out = {}
    for base in ("dp2", "single"):
        out[f"tp2_over_{base}"] = {
            "step_time": r["step_s"]["tp2"] / r["step_s"][base],
            "model_state_bytes": mem("tp2", "total_bytes") / mem(base, "total_bytes"),
            "activation_peak_bytes": mem("tp2", "activation_peak_bytes") / mem(base, "activation_peak_bytes"),
        }
    out["tp2_sp_over_tp2_activation_peak_bytes"] = (mem("tp2_sp", "activation_peak_bytes")
                                                    / mem("tp2", "activation_peak_bytes"))
    return out


def _worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    return _bench(args, rank)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps-per-round", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a small model, 2 rounds of 1 step: checks that it runs")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps_per_round = 2, 1
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from plait.runtime.spawn import spawn_ranks

    result = spawn_ranks(_worker, 2, args, timeout_s=3600, pg_timeout_s=600, name="tensor bench")[0]
    print(json.dumps({
        "bench": "tensor", "world_size": 2, "backend": "gloo", "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "note": "CPU, one thread per rank; single runs on one core while the other rank waits",
        **result, "ratios": _ratios(result),
    }, indent=1))


if __name__ == "__main__":
    main()
