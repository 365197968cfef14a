"""DeepSpeed-MoE on bench/moe.py's step model, run by an interpreter that has deepspeed installed.

DeepSpeed is not a plait dependency: bench/moe.py runs this file as a subprocess with the interpreter given
by ``--deepspeed-python`` (env ``DS_ACCELERATOR=cpu``) and merges the one JSON line it prints. The model is
``deepspeed.moe.layer.MoE`` with plait's expert MLP as a module (``Linear(C, H, bias=False)``,
``GELU(tanh)``, ``Linear(H, C, bias=False)``), ``moe.SHAPE`` experts and top-k, ``ep_size`` = ranks,
dropless (``drop_tokens=False``: each forward's capacity is the largest expert's count, all-reduced over
the ep group, and every expert's buffer is padded to it), no Gumbel sampling of the second expert and no
random token selection, so routing is the deterministic top-2 plait uses. Its router and experts are
copied from ``moe.initial_moe()`` (rank r holds global experts ``[r E/ep, (r+1) E/ep)`` in both), so both
implementations start from the same weights and route the first batch alike (``first_mse`` checks it).
The loop is DeepSpeed's own: engine forward, ``engine.backward`` (which all-reduces dense gradients over
the data-parallel group and expert gradients over the expert-data-parallel group, divided by the
data-parallel size), ``engine.step``; ZeRO stage 0, fp32, the same torch AdamW as plait's side.

Memory: ``model_state_peak`` samples parameters, ``param.grad`` and the optimizer's states (each storage
once, ``_common.StatePeak``) after forward, from post-accumulate-grad hooks, after ``engine.backward`` and
after ``engine.step`` in ``moe.MEASURE_STEPS`` untimed steps after the timed ones; buffers that live only
inside one collective call (DeepSpeed's flattened all-reduce buckets) are not seen, as on plait's side.

    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python bench/_moe_deepspeed.py [--warmup 3] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os

import _common
import moe  # bench/moe.py: the shape, data, initial weights, loop and rank merging both sides share
import torch
from torch import nn


class DeepSpeedNet(nn.Module):
    """One ``deepspeed.moe.layer.MoE``; forward returns (output, DeepSpeed's load-balancing loss)."""

    def __init__(self, ep: int) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        c, h, e, k = moe.SHAPE
        expert = nn.Sequential(nn.Linear(c, h, bias=False), nn.GELU(approximate="tanh"), nn.Linear(h, c, bias=False))
        self.moe = MoE(hidden_size=c, expert=expert, num_experts=e, ep_size=ep, k=k, min_capacity=0,
                       drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, l_aux, _ = self.moe(x)
        return y, l_aux

    @torch.no_grad()
    def load_plait(self, ep_rank: int) -> None:
        """Router and this rank's experts from ``moe.initial_moe()`` (``w1[e] (C, H)`` is ``fc1.weight.T``)."""
        ref = moe.initial_moe()
        layer = self.moe.deepspeed_moe
        layer.gate.wg.weight.copy_(ref.router.weight)
        local = layer.experts.deepspeed_experts
        for i, mlp in enumerate(local):
            g = ep_rank * len(local) + i
            mlp[0].weight.copy_(ref.experts.w1[g].T)
            mlp[2].weight.copy_(ref.experts.w2[g].T)


def run_rank(rank: int, world: int, warmup: int, steps: int) -> dict:
    import deepspeed
    from deepspeed.utils import groups

    os.environ.update(LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    deepspeed.init_distributed(dist_backend="gloo")  # the gloo group _common started is reused
    batches = moe.step_batches(rank)
    baseline = _common.rss_bytes()
    reset = _common.reset_peak_rss()
    net = DeepSpeedNet(world)
    ds_cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 0}, "steps_per_print": 2**31 - 1}
    engine, ds_opt, _, _ = deepspeed.initialize(model=net, optimizer=moe.adamw(net.parameters()), config=ds_cfg)
    net.load_plait(groups._get_expert_parallel_rank(net.moe.expert_group_name))
    setup = moe.setup_done()

    def step(x: torch.Tensor, t: torch.Tensor) -> float:
        y, l_aux = engine(x)
        mse = (y - t).pow(2).mean()
        engine.backward(mse + moe.STEP_AUX * l_aux)
        engine.step()
        return float(mse.detach())

    timed = moe.timed_loop(step, batches, warmup, steps)
    opt = getattr(ds_opt, "optimizer", ds_opt) if not hasattr(ds_opt, "state") else ds_opt
    peak = _common.StatePeak(_common.state_sources(engine.module, opt))
    handles = [engine.module.register_forward_hook(lambda *_: peak.sample("after forward"))]
    handles += peak.hook_backward(engine.module.parameters())
    for i in range(moe.MEASURE_STEPS):
        x, t = batches[i % len(batches)]
        y, l_aux = engine(x)
        engine.backward((y - t).pow(2).mean() + moe.STEP_AUX * l_aux)
        peak.sample("after backward")
        engine.step()
        peak.sample("after step")
    for h in handles:
        h.remove()
    return {**timed, "model_state_peak": peak.result(), **moe.memory_record(baseline, setup, reset),
            "optimizer": type(ds_opt).__name__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    per_rank = _common.spawn_group(run_rank, moe.STEP_EP, args.warmup, args.steps, name="deepspeed-moe")
    print(json.dumps(moe.merge_step_ranks(per_rank) | {"deepspeed": __import__("deepspeed").__version__,
                                                        "optimizer": per_rank[0]["optimizer"]}))


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
