"""DeepSpeed ZeRO 1-3 on the bench/zero.py model, run by an interpreter that has deepspeed installed.

DeepSpeed is not a plait dependency: bench/zero.py runs this file as a subprocess with the interpreter
given by ``--deepspeed-python`` (env ``DS_ACCELERATOR=cpu``) and merges the one JSON line it prints.
plait's GPT, data sampler, AdamW parameter groups and schedule come from the repository's ``src``;
the loop is DeepSpeed's own (engine forward, ``engine.backward``, ``engine.step`` with its gradient
clipping at the same norm).

Memory: DeepSpeed keeps flat fp32 master partitions and gradient partitions inside its optimizer
object, not as ``param.grad``. ``model_state`` counts, by storage and each storage once, the tensors
named in ``deepspeed_state_bytes`` (attributes of DeepSpeed 0.19's ZeRO optimizers, read with getattr:
a renamed attribute is missed, so the figure is a lower bound if DeepSpeed changes them), taken after
``engine.backward`` and before ``engine.step`` of the second step, like the other implementations.

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


def _flat(obj) -> list:
    """Tensors inside ``obj``: a tensor, or lists/tuples/dicts of them (one level of nesting)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, list | tuple):
        return [t for item in obj for t in _flat(item)]
    return []


def deepspeed_state_bytes(module: torch.nn.Module, ds_opt) -> dict[str, int]:
    """Per-rank bytes of parameters, gradients and optimizer states DeepSpeed holds, by storage, once each.

    params: the module's parameters, their stage-3 partitions and the flat bit16/fp16 buffers;
    grads: ``param.grad``, the stage-1/2 averaged gradient partitions and bucket, the stage-3 gradient
    partition buffer; optimizer: fp32 master partitions and the wrapped AdamW's states.
    """
    from plait.plan.memory import _count

    seen: dict[int, int] = {}
    params = list(module.parameters())
    p_bytes = _count(params + [p.ds_tensor for p in params if hasattr(p, "ds_tensor")]
                     + _flat(getattr(ds_opt, "bit16_groups_flat", []))
                     + _flat(getattr(ds_opt, "fp16_partitioned_groups_flat", [])), seen)
    g_bytes = _count([p.grad for p in params if p.grad is not None]
                     + _flat(getattr(ds_opt, "averaged_gradients", {}))
                     + _flat(getattr(ds_opt, "ipg_buffer", None))
                     + _flat(getattr(ds_opt, "grad_partitions_flat_buffer", None)), seen)
    o_bytes = _count(_flat(getattr(ds_opt, "single_partition_of_fp32_groups", []))
                     + _flat(getattr(ds_opt, "fp32_partitioned_groups_flat", []))
                     + [v for st in ds_opt.optimizer.state.values() for v in st.values()], seen)
    return {"params": p_bytes, "grads": g_bytes, "optimizer": o_bytes, "total": p_bytes + g_bytes + o_bytes}


def run_rank(rank: int, world: int, stage: int, overrides: list[str], warmup: int, steps: int) -> dict:
    import deepspeed

    from plait.config import load_config, validate
    from plait.data.corpus import load_splits
    from plait.data.sampler import WindowSampler
    from plait.models.gpt import GPT
    from plait.train.optim import lr_at, param_groups

    os.environ.update(LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    deepspeed.init_distributed(dist_backend="gloo")  # the gloo group _common started is reused
    baseline = _common.rss_bytes()
    reset = _common.reset_peak_rss()
    cfg = validate(load_config(overrides=_common.COMMON + overrides), world)
    t, o = cfg.train, cfg.optim
    splits = load_splits(cfg.data.path, cfg.model.vocab_size, cfg.data.val_fraction, cfg.model.seq_len)
    sampler = WindowSampler(splits.train, cfg.model.seq_len, t.global_batch_size, t.micro_batch_size, rank,
                            world, t.seed)
    torch.manual_seed(t.seed)
    model = GPT(cfg.model)
    opt = torch.optim.AdamW(param_groups(model.named_parameters(), o.weight_decay), lr=o.lr,
                            betas=(o.beta1, o.beta2), foreach=False)
    ds_cfg = {"train_micro_batch_size_per_gpu": t.micro_batch_size, "gradient_accumulation_steps": 1,
              "gradient_clipping": o.grad_clip, "zero_optimization": {"stage": stage},
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
    peak = _common.peak_rss_bytes()
    return {"step_s": times[warmup:], "final_loss": losses[-1], "model_state": memory, "peak_rss": peak,
            "peak_above_baseline": peak - baseline, "peak_reset": reset}


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
