"""plait's ZeRO stages 0-3 against PyTorch's peers (and DeepSpeed's ZeRO if given), for dp=2 and dp=4.

Implementations (all from the same GPT weights, data order and AdamW hyperparameters, clipping at 1.0):
  plait0..plait3      plait's Trainer with parallel.zero=0..3 (0: plait's bucketed reducer)
  ddp                 DistributedDataParallel                                   (stage 0 peer)
  zero_redundancy     DDP + torch's ZeroRedundancyOptimizer over AdamW          (stage 1 peer)
  fsdp_no_reshard     fully_shard per block + root, reshard_after_forward=False (stage 2 peer)
  fsdp                fully_shard per block + root, defaults                    (stage 3 peer)
  deepspeed1..3       DeepSpeed ZeRO 1-3 on CPU/gloo (only with --deepspeed-python; bench/_zero_deepspeed.py)

Each implementation runs in its own freshly spawned group of gloo ranks (one CPU thread each), so the
process peak memory of one cannot leak into another's. Per rank it records:
* ``model_state_peak`` (the memory target): the largest model-state bytes at any sampled instant of
  ``MEASURE_STEPS`` untimed steps run after the timed ones. Model state is the unique storages of
  parameters (incl. flat buffers, shards and FSDP2's unsharded parameters and all-gather outputs),
  gradients (incl. plait's bucket buffers and shards, DDP's buckets, FSDP2's unsharded gradients and
  reduce-scatter inputs, DeepSpeed's partitions and IPG buckets) and optimizer states (incl. fp32
  masters), each storage once. Sampled after forward, from a post-accumulate-grad hook on every
  parameter during backward (registered after the implementation's own hooks), after backward, before
  and after the optimizer step and after zero_grad; ``by_point`` keeps each point's largest value.
  Transient buffers that live only inside one collective call are not seen by any implementation.
* ``model_state_boundary``: the same count at one instant, right before the second optimizer step
  (``plait.plan.memory.measure_model_state_bytes``; DDP's buckets are not included there).
* ``peak_rss``: the process's peak resident set size during build + steps (VmHWM, reset after imports
  and process-group start-up), and ``peak_above_baseline`` = peak - RSS before the model was built.
  On CPU this is coarse (allocator caching, page granularity) but it is per process and per implementation.
* step times: ``--warmup`` untimed steps, then ``--steps`` timed ones, each after a barrier; a step's time is
  the slowest rank's; the median over steps (pooled over ``--rounds`` repetitions of the whole sweep, in
  rotated order so that machine noise is spread) is reported.
Ratios: plait stage k over its peer (model-state peak and step time); targets are memory <= 1 and
step time <= 1.05. ``final_loss`` (rank 0, last step) is a sanity check that all loops trained alike.

    python bench/zero.py [--dp 2 4] [--steps 16] [--rounds 2] [--quick] [--deepspeed-python /tmp/dsvenv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common
import torch
import torch.distributed as dist

from plait.runtime.spawn import SpawnError

PLAIT = ("plait0", "plait1", "plait2", "plait3")
PEERS = ("ddp", "zero_redundancy", "fsdp_no_reshard", "fsdp")
BUCKET_MB = 1.0  # see NOTES["buckets"]
STAGE0_BUCKET_MB = 25.0  # DDP's default, for plait0 and ddp
MEASURE_STEPS = 2  # untimed steps after the timed ones that sample model state (DDP's buckets: see below)
MODEL = ["--model.n_layer=4", "--model.d_model=256", "--model.n_head=4", "--model.seq_len=64",
         "--train.micro_batch_size=2"]

NOTES = {
    "model_state_peak": "largest model-state bytes per rank at any sampled instant of an untimed step (see the "
                        "docstring); *_max is the largest rank; the memory target. psi = fp32 parameter bytes, "
                        "N = dp, b = one gradient bucket (bucket_mb)",
    "model_state_boundary": "the same count right before the 2nd optimizer step (one instant, without DDP's buckets)",
    "expected_peak": {
        "plait0": "4 psi: params + gradients (views of the reducer's buckets) + 2 AdamW states, at every point",
        "ddp": "5 psi in backward: params + param.grad + DDP's bucket copies + 2 states (4 psi after zero_grad)",
        "plait1": "2 psi + 2 psi/N: params + the kept full gradient buffer (the shard is its slice) + states",
        "zero_redundancy": "3 psi + 2 psi/N: DDP's param.grad and bucket copies + sharded states",
        "deepspeed1": "2 psi + 3 psi/N + b in backward: params, param.grad held until the end-of-backward "
                      "reduction, one IPG bucket, fp32 master and 2 states of 1/N",
        "plait2": "psi + 3 psi/N + ~2 b in backward: full params, gradient shard, states, a bucket reducing "
                  "while the next fills (full buffers freed once reduce-scattered); psi + 3 psi/N at the boundary",
        "fsdp_no_reshard": "<= psi + 4 psi/N + unit gradients, early in backward: unsharded params of every unit "
                           "(kept from forward), sharded params, sharded grads, states, a unit's unsharded "
                           "gradients and reduce-scatter input; 4 psi/N at the boundary",
        "deepspeed2": "psi + 4 psi/N + b in backward: params, gradient partition, IPG bucket, fp32 master, states",
        "deepspeed3": "psi + 5 psi/N + b: with its defaults (max live parameters 1e9) the gathered params of this "
                      "small model stay live (psi), plus fp32-flat partition, gradient partition, master, states",
        "plait3 / fsdp": "4 psi/N + root unit (never resharded after forward) + one block's unsharded params and "
                         "gradients in backward; 4 psi/N at the boundary",
    },
    "buckets": "stages 1-3 use bucket_mb (default 1 MiB, ~1/13 of this 13 MB model, as 25 MB buckets are for a "
               "~300 MB model) for plait, ZeroRedundancyOptimizer's DDP and DeepSpeed's reduce/all-gather buckets: "
               "DeepSpeed allocates its IPG bucket at the full configured size (its default 5e8 elements is 2 GB) "
               "and plait ZeRO-2's backward holds ~2 buckets, so a bucket as large as the model measures a regime "
               "no real model is in. Stage 0 (plait0, ddp) keeps DDP's default 25 MB: there the bucket size does "
               "not change model state (DDP's buckets are a full gradient copy, plait's gradients are bucket views)",
    "peak": "process peak RSS minus RSS before the model was built, per rank; CPU RSS is coarse (allocator "
            "caching, pages), compare it between implementations only",
    "step_s": "median over timed steps of the slowest rank's step; noisy on a shared machine",
}


def overrides(dp: int, bucket_mb: float = BUCKET_MB) -> list[str]:
    """The benchmark config at data-parallel size ``dp``: one micro-batch of 2 sequences per rank per step,
    gradient buckets of ``bucket_mb`` (plait's reducer and ZeRO, DDP, DeepSpeed's reduce/all-gather buckets)."""
    return MODEL + [f"--train.global_batch_size={2 * dp}", f"--parallel.bucket_mb={bucket_mb}"]


def _build_peer(impl: str, cfg, world: int):
    """(module to run, optimizer to step, optimizer whose ``state`` holds the states) for a PyTorch peer."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from plait.components.optim import param_groups
    from plait.models.gpt import GPT

    torch.manual_seed(cfg.train.seed)  # the Trainer's initial weights
    model = GPT(cfg.model)
    o = cfg.optim
    hyper = {"lr": o.lr, "betas": (o.beta1, o.beta2), "foreach": False}
    groups = param_groups(model.named_parameters(), o.weight_decay)
    if impl in ("ddp", "zero_redundancy"):
        module = DDP(model, bucket_cap_mb=cfg.parallel.bucket_mb)
        if impl == "ddp":
            opt = torch.optim.AdamW(groups, **hyper)
            return module, model, opt, opt
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **hyper)
        return module, model, opt, opt.optim
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    reshard = impl == "fsdp"
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(param_groups(model.named_parameters(), o.weight_decay), **hyper)
    return model, model, opt, opt


def _peer_step(impl: str, parts, sampler, cfg, step: int, measure: bool,
               probe=None) -> tuple[float, dict | None]:
    """One optimizer step of a peer's minimal loop (same phases as the Trainer); returns (loss, memory).

    ``probe(point)``, when given, samples model state after forward, after backward, before and after the
    optimizer step and after zero_grad (the measurement step only)."""
    from torch.distributed.tensor import DTensor

    from plait.components.optim import lr_at
    from plait.observe.memory import measure_model_state_bytes

    probe = probe or (lambda point: None)
    module, model, opt, state_opt = parts
    ((x, y),) = sampler.next_batch()
    loss = module(x, y)  # (), mean cross-entropy
    probe("after forward")
    loss.backward()
    probe("after backward")
    for g in opt.param_groups:
        g["lr"] = lr_at(step, cfg.optim, cfg.train.steps)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip, foreach=False)
    norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    memory = measure_model_state_bytes(model, state_opt) if measure else None
    probe("before step")
    opt.step()
    probe("after step")
    opt.zero_grad(set_to_none=True)
    probe("after zero_grad")
    return float(loss), memory


def _measure_peer(impl: str, parts, sampler, cfg, step: int) -> dict:
    """``MEASURE_STEPS`` untimed steps of a peer sampling model state; the peak record."""
    module, model, opt, state_opt = parts
    extra = _common.ddp_bucket_buffers(module) if impl in ("ddp", "zero_redundancy") else []
    peak = _common.StatePeak(_common.state_sources(model, state_opt, extra))
    handles = peak.hook_backward(_common.backward_leaves(model))
    for i in range(MEASURE_STEPS):
        _peer_step(impl, parts, sampler, cfg, step + i, measure=False, probe=peak.sample)
    for h in handles:
        h.remove()
    return peak.result()


def _measure_trainer(trainer) -> dict:
    """``MEASURE_STEPS`` untimed ``train_step`` calls sampling model state at the same points as the
    peers: a forward hook on the model, post-accumulate-grad hooks, and wrappers around the layout's
    ``finish``/``zero_grad`` and the optimizer's ``step`` (instance attributes, removed afterwards)."""
    layout, opt = trainer.layout, trainer.optimizer
    peak = _common.StatePeak(_common.state_sources(layout.model, opt))
    handles = [layout.model.register_forward_hook(lambda *_: peak.sample("after forward"))]
    handles += peak.hook_backward(_common.backward_leaves(layout.model))
    wrapped = [(layout, "finish", None, "after backward"), (opt, "step", "before step", "after step"),
               (layout, "zero_grad", None, "after zero_grad")]
    for obj, name, before, after in wrapped:
        setattr(obj, name, _common.sampled(getattr(obj, name), peak, before, after))
    try:
        for _ in range(MEASURE_STEPS):
            trainer.train_step()
    finally:
        for obj, name, *_ in wrapped:
            delattr(obj, name)
        for h in handles:
            h.remove()
    return peak.result()


def run_impl(rank: int, world: int, impl: str, dp_overrides: list[str], root: str, warmup: int,
             steps: int) -> dict:
    """Build one implementation in this rank, run ``warmup + steps`` steps; the per-rank record."""
    baseline = _common.rss_bytes()
    reset = _common.reset_peak_rss()
    times, losses, memory = [], [], None
    if impl in PLAIT:
        trainer = _common.make_trainer(dp_overrides + [f"--parallel.zero={impl[-1]}"], Path(root, impl), world)
    else:
        from plait.data.corpus import load_splits
        from plait.data.sampler import WindowSampler
        from plait.recipes import load_recipe_config
        from plait.recipes import validate_config as validate

        cfg = validate(load_recipe_config(overrides=_common.COMMON + dp_overrides), world)
        t = cfg.train
        splits = load_splits(cfg.data.path, cfg.model.vocab_size, cfg.data.val_fraction, cfg.model.seq_len)
        sampler = WindowSampler(splits.train, cfg.model.seq_len, t.global_batch_size, t.micro_batch_size,
                                rank, world, t.seed)
        parts = _build_peer(impl, cfg, world)
    for step in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        if impl in PLAIT:
            loss = trainer.train_step()["loss"]
        else:
            loss, mem = _peer_step(impl, parts, sampler, cfg, step, measure=step == 1)
            memory = mem or memory
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    dist.barrier()
    if impl in PLAIT:
        memory = trainer.memory
        peak_state = _measure_trainer(trainer)
    else:
        peak_state = _measure_peer(impl, parts, sampler, cfg, warmup + steps)
    peak = _common.peak_rss_bytes()
    return {"step_s": times[warmup:], "final_loss": losses[-1], "model_state": memory,
            "model_state_peak": peak_state, "peak_rss": peak, "peak_above_baseline": peak - baseline,
            "peak_reset": reset}


def merge_ranks(per_rank: list[dict]) -> dict:
    """Per-rank records of one run -> one record: the slowest rank's time per step, per-rank memory."""
    boundary = [r["model_state"] for r in per_rank]
    return {
        "step_s": [max(s) for s in zip(*(r["step_s"] for r in per_rank), strict=True)],
        "final_loss": per_rank[0]["final_loss"],
        "model_state_peak_bytes": [r["model_state_peak"]["total"] for r in per_rank],
        "model_state_peak_rank0": per_rank[0]["model_state_peak"],
        "model_state_boundary_bytes": [m["total"] if m else None for m in boundary],
        "model_state_boundary_rank0": boundary[0],
        "peak_rss_bytes": [r["peak_rss"] for r in per_rank],
        "peak_above_baseline_bytes": [r["peak_above_baseline"] for r in per_rank],
    }


MEMORY_KEYS = ("model_state_peak_bytes", "model_state_boundary_bytes", "peak_rss_bytes", "peak_above_baseline_bytes")


def summarize(runs: list[dict]) -> dict:
    """Records of one implementation over rounds -> median step time (pooled) and max memory over ranks."""
    out = dict(runs[-1])
    samples = [s for r in runs for s in r["step_s"]]
    out["step_s"] = statistics.median(samples)
    out["step_samples"] = len(samples)
    for key in MEMORY_KEYS:
        vals = [v for r in runs for v in r[key] if v is not None]
        out[key + "_max"] = max(vals) if vals else None
    return out


def ratios(results: dict) -> dict:
    """plait stage k over its PyTorch peer (and DeepSpeed's stage k where it ran): memory and time.

    The memory target is on ``model_state_peak`` (what limits a device is the peak inside a step); the
    step-boundary ratio is reported beside it."""
    out = {}
    for k, peer in enumerate(PEERS):
        mine = results.get(f"plait{k}")
        for other in (peer, f"deepspeed{k}"):
            theirs = results.get(other)
            if not isinstance(mine, dict) or not isinstance(theirs, dict) or k == 0 and other == "deepspeed0":
                continue
            mem = _ratio(mine["model_state_peak_bytes_max"], theirs["model_state_peak_bytes_max"])
            step = mine["step_s"] / theirs["step_s"]
            out[f"stage{k}_vs_{other}"] = {
                "model_state_peak_ratio": mem, "step_time_ratio": round(step, 3),
                "model_state_boundary_ratio": _ratio(mine["model_state_boundary_bytes_max"],
                                                     theirs["model_state_boundary_bytes_max"]),
                "peak_above_baseline_ratio": _ratio(mine["peak_above_baseline_bytes_max"],
                                                    theirs["peak_above_baseline_bytes_max"]),
                "meets_memory_target": mem is not None and mem <= 1.0, "meets_time_target": step <= 1.05,
            }
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _deepspeed(python: str, stage: int, dp: int, args: argparse.Namespace) -> dict | str:
    """DeepSpeed ZeRO ``stage`` in a subprocess with DeepSpeed's interpreter; its merged record or why not."""
    return _common.run_deepspeed_script(python, "_zero_deepspeed.py", [
        "--stage", str(stage), "--dp", str(dp), "--warmup", str(args.warmup), "--steps", str(args.steps),
        *overrides(dp, args.bucket_mb)])


def sweep(dp: int, args: argparse.Namespace, root: str) -> dict:
    impls = [i for i in PLAIT + PEERS if not args.only or i in args.only]
    runs: dict[str, list[dict]] = {i: [] for i in impls}
    results: dict[str, dict | str] = {}
    for r in range(args.rounds):
        for impl in impls[r % max(len(impls), 1):] + impls[:r % max(len(impls), 1)]:
            try:
                bucket_mb = STAGE0_BUCKET_MB if impl in ("plait0", "ddp") else args.bucket_mb
                per_rank = _common.spawn_group(run_impl, dp, impl, overrides(dp, bucket_mb), root, args.warmup,
                                               args.steps, name=f"{impl} dp={dp}")
                runs[impl].append(merge_ranks(per_rank))
            except SpawnError as e:
                results[impl] = f"failed: {e}"
            print(f"[zero bench] dp={dp} round {r + 1}/{args.rounds} {impl} done", file=sys.stderr)
    for impl, rs in runs.items():
        if rs and impl not in results:
            results[impl] = summarize(rs)
    if args.deepspeed_python:
        for stage in [s for s in (1, 2, 3) if not args.only or f"deepspeed{s}" in args.only]:
            rec = _deepspeed(args.deepspeed_python, stage, dp, args)
            results[f"deepspeed{stage}"] = summarize([rec]) if isinstance(rec, dict) else rec
            print(f"[zero bench] dp={dp} deepspeed{stage} done", file=sys.stderr)
    else:
        results["deepspeed"] = "not run: pass --deepspeed-python PYTHON (an interpreter with deepspeed installed)"
    return {"results": results, "ratios": ratios(results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps (>= 2: optimizer states exist)")
    ap.add_argument("--steps", type=int, default=16, help="timed steps per run")
    ap.add_argument("--rounds", type=int, default=2, help="repetitions of the whole sweep, rotated order")
    ap.add_argument("--quick", action="store_true", help="2 warm-up + 2 timed steps, 1 round")
    ap.add_argument("--bucket-mb", type=float, default=BUCKET_MB, help="gradient bucket size (MiB) for all")
    ap.add_argument("--only", nargs="+", default=[], choices=PLAIT + PEERS + ("deepspeed1", "deepspeed2", "deepspeed3"),
                    help="run only these implementations")
    ap.add_argument("--deepspeed-python", default="", help="interpreter with deepspeed (run as a subprocess)")
    args = ap.parse_args()
    if args.quick:
        args.warmup, args.steps, args.rounds = 2, 2, 1
    if args.warmup < 2:
        ap.error("--warmup must be at least 2: memory is measured before the second optimizer step")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        by_dp = {f"dp{dp}": sweep(dp, args, root) for dp in args.dp}
    print(json.dumps({
        "bench": "zero", "notes": NOTES, **_common.machine_info(), "config": " ".join(MODEL) + " (global batch 2 x dp)",
        "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds,
        "wall_s": round(time.perf_counter() - started, 1), **by_dp,
    }, indent=1))


if __name__ == "__main__":
    main()
