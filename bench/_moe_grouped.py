"""bench/moe.py's ``grouped`` section: experts as one grouped GEMM per weight against the loop over experts.

Two models, each at ep=1 (one process) and ep=2 (two gloo ranks, one thread each), eager and with
``train.compile``, with ``moe.experts=grouped`` and ``moe.experts=loop`` (``plait.nn.experts``):

* ``gpt``: plait's GPT (2 blocks, d_model 128, 4 heads, sequence 64), every block MoE: 8 experts of width 256,
  top-2, Switch aux loss (bench/moe.py's speed shape);
* ``deepseek_v3_toy``: the same GPT with DeepSeek-V3's routing in plait's layer: 16 fine-grained experts of width
  64, top-4, sigmoid scores over 4 groups choosing 2, route scale 2.5, one shared expert, aux-loss-free bias
  balancing and the sequence-wise loss.

Per configuration: the MoE layer alone (the first block's, forward and backward of 1024 tokens per rank, tokens/s
summed over the ranks: the throughput the GPU target is stated for) and the training step through ``plait.Plait``
(batch 8 x 64 tokens per rank, AdamW; the slowest rank's step time, median of the timed steps after warm-up
steps that include compilation). Verdicts: grouped over loop per configuration; the target (>= 1.5x the loop's
MoE-layer throughput) is a GPU target: on a CPU the grouped kernel is torch's CPU fallback, one matmul per
group, so the figures here are CPU figures, reported as they are.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import _common
import torch

GPT = ["--model.n_layer=2", "--model.d_model=128", "--model.n_head=4", "--model.seq_len=64",
       "--model.vocab_size=256", "--model.dropout=0.0", "--moe.every=1"]
MODELS = {
    "gpt": ["--moe.num_experts=8", "--moe.top_k=2", "--moe.d_hidden=256"],
    "deepseek_v3_toy": ["--moe.num_experts=16", "--moe.top_k=4", "--moe.d_hidden=64", "--moe.score=sigmoid",
                        "--moe.num_groups=4", "--moe.topk_groups=2", "--moe.route_scale=2.5",
                        "--moe.shared_experts=1", "--moe.balance=bias", "--moe.seq_aux_loss_coef=0.0001"],
}
BATCH, LAYER_TOKENS = 8, 1024


def _config(model: str, impl: str, ep: int, compiled: bool, root: str) -> Any:
    from plait.config import load_config

    return load_config(overrides=GPT + MODELS[model] + [
        f"--moe.experts={impl}", f"--parallel.nproc={ep}", f"--parallel.ep={ep}", f"--train.compile={compiled}".lower(),
        f"--train.global_batch_size={BATCH * ep}", f"--train.micro_batch_size={BATCH}", "--optim.grad_clip=0",
        "--observe.progress=false", "--observe.trackers=[]", f"--run.dir={root}"])


def _worker(rank: int, world: int, model: str, impl: str, compiled: bool, warmup: int, steps: int,
            root: str) -> dict:
    import torch.distributed as dist

    import plait
    from plait.models.tiny import seeded_gpt
    from plait.nn import moe_layers

    cfg = _config(model, impl, world, compiled, f"{root}/{model}-{impl}-{world}-{compiled}")
    p = plait.Plait(cfg)
    net, _ = p.setup(seeded_gpt(cfg.model, 0, cfg.moe), loss_fn="causal_lm",
                     optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 256, (BATCH, 64), generator=g) for _ in range(4)]
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        p.forward_backward(net, batches[i % len(batches)])
        p.step()
        times.append(time.perf_counter() - t0)
    layer = moe_layers(net)[0]
    run = torch.compile(layer) if compiled else layer
    x = torch.randn(LAYER_TOKENS // 64, 64, cfg.model.d_model, generator=g, requires_grad=True)
    layer_times = []
    for _ in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        run(x).sum().backward()
        layer_times.append(time.perf_counter() - t0)
    p.close()
    return {"step_s": times[warmup:], "layer_s": layer_times[warmup:]}


def _one(model: str, impl: str, ep: int, compiled: bool, warmup: int, steps: int, root: str) -> dict:
    ranks = _common.spawn_group(_worker, ep, model, impl, compiled, warmup, steps, root,
                                name=f"moe {model} {impl} ep{ep}{' compiled' if compiled else ''}")
    step = [max(s) for s in zip(*(r["step_s"] for r in ranks), strict=True)]
    layer = [max(s) for s in zip(*(r["layer_s"] for r in ranks), strict=True)]
    return {"step_s_median": statistics.median(step),
            "moe_layer_tokens_per_s": ep * LAYER_TOKENS / statistics.median(layer)}


def grouped(quick: bool, root: str) -> dict:
    """Every configuration of the module docstring, and grouped / loop ratios with the GPU target's verdict."""
    warmup, steps = (2, 3) if quick else (3, 10)
    out: dict = {"device": "cpu (gloo, one thread per rank)" if not torch.cuda.is_available() else "cuda",
                 "warmup_steps": warmup, "timed_steps": steps, "runs": {}, "grouped_over_loop": {}}
    for model in MODELS:
        for ep in (1, 2):
            for compiled in (False, True):
                key = f"{model} ep{ep} {'compiled' if compiled else 'eager'}"
                runs = {impl: _one(model, impl, ep, compiled, warmup, steps, root) for impl in ("grouped", "loop")}
                out["runs"][key] = runs
                g, lo = runs["grouped"], runs["loop"]
                out["grouped_over_loop"][key] = {
                    "moe_layer_throughput": round(g["moe_layer_tokens_per_s"] / lo["moe_layer_tokens_per_s"], 3),
                    "step_speed": round(lo["step_s_median"] / g["step_s_median"], 3)}
    ratios = [r["moe_layer_throughput"] for r in out["grouped_over_loop"].values()]
    out["target (GPU): grouped >= 1.5x loop MoE-layer throughput"] = {
        "met_here": all(r >= 1.5 for r in ratios), "min_ratio": min(ratios),
        "note": "a GPU target; these are CPU figures (torch's CPU grouped kernel runs one matmul per group)"}
    return out
