"""DeepSpeed ZeRO 1-3 on the bench/zero.py model, run by an interpreter that has deepspeed installed.

DeepSpeed is not a plait dependency: bench/zero.py runs this file as a subprocess with the interpreter
given by ``--deepspeed-python`` (env ``DS_ACCELERATOR=cpu``) and merges the one JSON line it prints.
plait's GPT, data sampler, AdamW parameter groups and schedule come from the repository's ``src``;
the loop is DeepSpeed's own (engine forward, ``engine.backward``, ``engine.step`` with its gradient
clipping at the same norm).

Memory: DeepSpeed keeps flat fp32 master partitions, gradient partitions and IPG buckets inside its
optimizer object, not as ``param.grad``. ``deepspeed_state_tensors`` finds them by walking the ZeRO
optimizer's attributes (so a renamed buffer is still found) and counts, by storage and each storage
once, parameters, gradients and optimizer states. ``model_state_peak`` samples them in
``zero.MEASURE_STEPS`` untimed steps after the timed ones (after forward, from post-accumulate-grad
hooks, after ``engine.backward``, after ``engine.step``), like bench/zero.py does for the others;
``model_state`` is the step-boundary figure (after ``engine.backward`` of the second step).

    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python bench/_zero_deepspeed.py --stage 2 --dp 2 [overrides...]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import _common
import torch
import torch.distributed as dist


def _walk(obj, path: str, out: list, depth: int = 0) -> None:
    """(attribute path, tensor) for every tensor reachable from ``obj`` through lists, tuples, dicts and
    DeepSpeed's bucket records (``IPGBucket``, ``IPGBucketZ3``)."""
    if depth > 4:
        return
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, f"{path}.{k}", out, depth + 1)
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            _walk(v, f"{path}[{i}]", out, depth + 1)
    elif type(obj).__name__.startswith("IPGBucket"):
        _walk(vars(obj), path, out, depth + 1)


def _category(path: str) -> str:
    """DeepSpeed attribute path -> model-state category: fp32 partitions are optimizer state (master
    weights), low-precision/flat parameter buffers are parameters, everything else (averaged gradient
    partitions, IPG buckets, gradient partition buffers) is gradients."""
    name = path.lower()
    if "fp32" in name:
        return "optimizer"
    if any(k in name for k in ("bit16", "fp16", "lp_param", "param_buffer")) and "grad" not in name:
        return "params"
    return "grads"


def deepspeed_state_tensors(module: torch.nn.Module, ds_opt) -> dict[str, list]:
    """Tensors DeepSpeed holds for parameters, gradients and optimizer states on this rank.

    params: the module's parameters (full while gathered at stage 3), their stage-3 partitions
    (``ds_tensor``) and the flat bit16 buffers; grads: ``param.grad`` and every tensor reachable from
    the ZeRO optimizer's attributes that is not a parameter buffer or fp32 partition (averaged gradient
    partitions, IPG buckets, stage-3 gradient partitions); optimizer: fp32 master partitions and the
    wrapped optimizer's states. Reading attributes generically keeps this right if DeepSpeed renames
    a buffer; the category of a new attribute follows its name (see ``_category``).
    """
    params = list(module.parameters())
    found: list = []
    for name, value in vars(ds_opt).items():
        if name not in ("optimizer", "module"):
            _walk(value, name, found)
    out = {"params": params + [getattr(p, "ds_tensor", None) for p in params],
           "grads": [p.grad for p in params], "optimizer": []}
    for path, t in found:
        out[_category(path)].append(t)
    out["optimizer"] += [v for st in ds_opt.optimizer.state.values() for v in st.values()]
    return out


def deepspeed_state_bytes(module: torch.nn.Module, ds_opt) -> dict[str, int]:
    """Per-rank bytes of ``deepspeed_state_tensors``, each storage once (params, then grads, then optimizer)."""
    from plait.observe.memory import _count

    seen: dict[int, int] = {}
    tensors = deepspeed_state_tensors(module, ds_opt)
    out = {k: _count([t for t in tensors[k] if t is not None], seen) for k in ("params", "grads", "optimizer")}
    return out | {"total": sum(out.values())}


def _measure(engine, ds_opt, sampler, steps: int) -> dict:
    """``steps`` untimed steps sampling model state after forward, from post-accumulate-grad hooks,
    after backward and after ``engine.step`` (which also zeroes the gradients); the peak record."""
    peak = _common.StatePeak(lambda: deepspeed_state_tensors(engine.module, ds_opt))
    handles = peak.hook_backward(engine.module.parameters())
    for _ in range(steps):
        ((x, y),) = sampler.next_batch()
        loss = engine(x, y)
        peak.sample("after forward")
        engine.backward(loss)
        peak.sample("after backward")
        engine.step()
        peak.sample("after step")
    for h in handles:
        h.remove()
    return peak.result()


def run_rank(rank: int, world: int, stage: int, overrides: list[str], warmup: int, steps: int) -> dict:
    import deepspeed

    from plait.components.optim import lr_at, param_groups
    from plait.data.corpus import load_splits
    from plait.data.sampler import WindowSampler
    from plait.models.gpt import GPT
    from plait.recipes import load_recipe_config
    from plait.recipes import validate_config as validate

    os.environ.update(LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    deepspeed.init_distributed(dist_backend="gloo")  # the gloo group _common started is reused
    baseline = _common.rss_bytes()
    reset = _common.reset_peak_rss()
    cfg = validate(load_recipe_config(overrides=_common.COMMON + overrides), world)
    t, o = cfg.train, cfg.optim
    splits = load_splits(cfg.data.path, cfg.model.vocab_size, cfg.data.val_fraction, cfg.model.seq_len)
    sampler = WindowSampler(splits.train, cfg.model.seq_len, t.global_batch_size, t.micro_batch_size, rank,
                            world, t.seed)
    torch.manual_seed(t.seed)
    model = GPT(cfg.model)
    opt = torch.optim.AdamW(param_groups(model.named_parameters(), o.weight_decay), lr=o.lr,
                            betas=(o.beta1, o.beta2), foreach=False)
    # Buckets sized like plait's and DDP's (parallel.bucket_mb), not DeepSpeed's default 5e8 elements:
    # its IPG bucket is allocated at full size (2 GB in fp32) whatever the model's size.
    bucket = int(cfg.parallel.bucket_mb * 2**20 / 4)
    zero_cfg = {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    ds_cfg = {"train_micro_batch_size_per_gpu": t.micro_batch_size, "gradient_accumulation_steps": 1,
              "gradient_clipping": o.grad_clip, "zero_optimization": zero_cfg,
              "zero_allow_untested_optimizer": True}
    engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_cfg)
    times, losses, memory = [], [], None
    for step in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        ((x, y),) = sampler.next_batch()
        for g in ds_opt.param_groups:
            g["lr"] = lr_at(step, o, t.steps)
        loss = engine(x, y)  # (), mean cross-entropy
        engine.backward(loss)
        if step == 1:
            memory = deepspeed_state_bytes(engine.module, ds_opt)
        engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    dist.barrier()
    import zero  # bench/zero.py: the same number of measurement steps

    peak_state = _measure(engine, ds_opt, sampler, zero.MEASURE_STEPS)
    peak = _common.peak_rss_bytes()
    return {"step_s": times[warmup:], "final_loss": losses[-1], "model_state": memory,
            "model_state_peak": peak_state, "peak_rss": peak, "peak_above_baseline": peak - baseline,
            "peak_reset": reset}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--stage", type=int, choices=(1, 2, 3), required=True)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    args, overrides = ap.parse_known_args()
    import zero  # bench/zero.py: the rank-merging helper, so both scripts report alike

    per_rank = _common.spawn_group(run_rank, args.dp, args.stage, overrides, args.warmup, args.steps,
                                   name=f"deepspeed{args.stage} dp={args.dp}")
    print(json.dumps(zero.merge_ranks(per_rank) | {"deepspeed": __import__("deepspeed").__version__}))


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
