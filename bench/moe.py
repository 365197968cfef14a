"""Mixture of experts: quality against a dense GPT of equal active FLOPs, balancing, capacity, and the
expert-parallel layer's speed and all-to-all bytes. One run prints JSON.

Quality (``plait train`` on the embedded corpus, one process, equal steps and data): plait's GPT with
every block's MLP an MoE of 8 experts, top-2, each expert ``4 d / 2`` wide (so a token's active MLP FLOPs
equal the dense ``4 d`` MLP's), against the dense GPT; 3 seeds each, final validation loss median and
spread. The MoE runs use bias balancing: measured at 2000 steps (seed 1), the Switch aux loss at
coefficient 0.01 ended 0.12 above bias balancing (1.477 vs 1.353; dense 1.372), and at 150-500 steps
every MoE variant was still behind the dense model, so the comparison needs the longer run (default
1500 steps). Then aux-loss against bias balancing (loss, MaxVio over training) and capacity factor 1.0 /
1.25 / 2.0 / dropless (drop rate, loss), first seed.

Speed (gloo, one thread per rank): the MoE layer's forward+backward tokens/s at ep=1 (one process, all
experts) and ep=2 (two processes, each with its own tokens and half the experts), and the bytes the
all-to-alls put on the wire, read from the collectives' own inputs and split sizes by a dispatch-mode counter,
against the formula: the static all-to-all (the default) sends each other rank a buffer of
``S = N x min(k, E/ep)`` rows of ``C x 4`` bytes for dispatch and again for combine, whatever the routing, and a
count header of ``E/ep + 1`` int64; backward moves the two token buffers again (not the counts). The variable
split dispatcher (``moe.dispatcher=alltoall_split``) is measured too, against its own formula: every assignment
routed to a remote expert, once each way, twice with backward, and ``8 x E/ep x (ep-1)`` bytes of counts.

Grouped experts (``--only grouped``, bench/_moe_grouped.py): step time and MoE-layer throughput of
``moe.experts=grouped`` against ``loop`` at ep=1 and ep=2, eager and compiled, on the small MoE GPT and a
DeepSeek-V3 toy (plait's layer with DeepSeek-V3's routing); the GPU target, grouped >= 1.5x the loop's MoE-layer
throughput, computed from CPU figures here and labelled so.

Step against DeepSpeed-MoE (``--deepspeed-python``, an interpreter with deepspeed installed; DeepSpeed is
not a plait dependency, so it runs bench/_moe_deepspeed.py as a subprocess, as bench/zero.py does): the
same model, one MoE layer of that shape (8 experts ``C -> H`` GELU(tanh) ``-> C`` without biases, top-2,
dropless: DeepSpeed's ``drop_tokens=False``, no second-expert sampling, no random token selection; its
padded capacity is the largest expert's count over the ep group), from the same initial weights, at ep=2
on 2 gloo ranks (one thread each), each rank its own 1024 tokens, loss ``mean((y - t)^2)`` plus the
load-balancing loss at coefficient 0.01 (plait counts f_e over the top-k assignments, DeepSpeed over top-1),
AdamW (lr 1e-3, ``foreach=False``), no clipping. One step is forward, backward, gradient reduction
(dense over both ranks, experts divided by the data-parallel size in both) and the optimizer step: plait
through ``plait.Plait`` (``backward``, ``step``), DeepSpeed through its engine (``engine.backward``,
``engine.step``, ZeRO stage 0, fp32). Per rank: step time (each step the slowest rank's, median over
the timed steps, each after a barrier; ``--rounds`` alternating plait / DeepSpeed runs pooled), CPU time
per step (each process's, all threads, summed over the ranks: less sensitive than wall time to other load
on a shared machine), model-state peak (parameters + gradients + optimizer states,
each storage once, sampled after forward, from post-accumulate-grad hooks, after backward and after the
step in untimed steps after the timed ones; bench/_common.StatePeak), peak RSS above the RSS before the
model was built, and the timed and measured steps' own peak RSS above the RSS after setup (what setup
imports or builds once left out). Ratios are plait over DeepSpeed; the target is step time <= 1.0 at model-state
memory <= 1.0.

    python bench/moe.py [--steps 200] [--quick] [--only quality speed grouped deepspeed] [--rounds 3]
                        [--deepspeed-python /tmp/dsvenv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common  # puts src/ on the path
import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["--model.n_layer=2", "--model.d_model=64", "--model.n_head=4", "--model.seq_len=64",
         "--train.global_batch_size=16", "--train.micro_batch_size=16", "--optim.lr=3e-3",
         "--optim.warmup_steps=20", "--train.eval_sequences=128", "--parallel.nproc=1",
         "--observe.progress=false", "--observe.trackers=[]", "--checkpoint.every=0"]
MOE = ["--moe.num_experts=8", "--moe.top_k=2"]
SHAPE = (128, 256, 8, 2)  # speed and the DeepSpeed step: d_model C, expert width H, experts E, top-k K
TOKENS = 1024  # tokens per rank per forward


def train(extra: list[str], steps: int, seed: int, root: Path, name: str) -> dict:
    run = root / name
    cmd = [sys.executable, "-m", "plait.cli", "train", *MODEL, *extra, f"--train.steps={steps}",
           f"--train.seed={seed}", f"--train.eval_every={steps}", f"--run.dir={run}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
    summary = json.loads((run / "summary.json").read_text())
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    moe = [r["moe"] for r in recs if "moe" in r]
    out = {"val_loss": summary["final_val_loss"], "tokens_per_s": summary["tokens_per_s"]}
    if moe:
        out["max_violation_mean"] = statistics.mean(statistics.mean(layer["max_violation"] for layer in m) for m in moe)
        out["max_violation_last"] = statistics.mean(layer["max_violation"] for layer in moe[-1])
        out["dropped_fraction"] = statistics.mean(statistics.mean(layer["dropped_fraction"] for layer in m)
                                                  for m in moe)
    return out


def quality(steps: int, seeds: list[int], root: Path) -> dict:
    """Dense against MoE with each balancing (bias: all seeds; aux: the first seed), then the capacity
    sweep with bias balancing (first seed; dropless is the bias run). A verdict is true only when the
    MoE median is below the dense median by more than half the larger seed spread."""
    res: dict = {"dense": [], "moe_bias": []}
    for s in seeds:
        res["dense"].append(train([], steps, s, root, f"dense{s}"))
        res["moe_bias"].append(train(MOE + ["--moe.balance=bias"], steps, s, root, f"moe-bias{s}"))
    summary = {}
    for k, runs in res.items():
        losses = [r["val_loss"] for r in runs]
        summary[k] = {"val_loss_median": statistics.median(losses), "val_loss_min": min(losses),
                      "val_loss_max": max(losses), "tokens_per_s_median": statistics.median(r["tokens_per_s"]
                                                                                             for r in runs)}
    spread = max(v["val_loss_max"] - v["val_loss_min"] for v in summary.values())
    verdict = summary["moe_bias"]["val_loss_median"] < summary["dense"]["val_loss_median"] - spread / 2
    aux = train(MOE + ["--moe.balance=aux"], steps, seeds[0], root, "moe-aux")
    balance = {"aux": aux, "bias": res["moe_bias"][0],
               "dense_same_seed": res["dense"][0]}
    capacity = {str(c): train(MOE + ["--moe.balance=bias", f"--moe.capacity_factor={c}"], steps, seeds[0], root,
                              f"cap{c}") for c in (1.0, 1.25, 2.0)}
    capacity["0.0 (dropless)"] = res["moe_bias"][0]
    return {"seeds": seeds, "steps": steps, "dense_vs_moe_bias": summary, "runs": res,
            "target_moe_below_dense": bool(verdict), "balance (first seed)": balance,
            "capacity (first seed, bias balancing)": capacity}


# -- speed -----------------------------------------------------------------------------------------
def _speed_worker(rank: int, world: int, tokens: int, reps: int, dispatcher: str) -> dict:
    from torch.utils._python_dispatch import TorchDispatchMode

    from plait.nn import MoE
    from plait.parallel.expert.dispatch import shard_experts

    C, H, E, K = SHAPE
    torch.manual_seed(0)
    layer = MoE(C, H, E, top_k=K)
    if world > 1:
        shard_experts(layer, world, rank, dist.group.WORLD, dispatcher)

    class Bytes(TorchDispatchMode):
        """Bytes sent to other ranks by every c10d all-to-all, from the call's own input and split sizes."""

        def __init__(self) -> None:
            super().__init__()
            self.sent = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            name = func._overloadpacket.__name__
            if name in ("alltoall_base_", "all_to_all_single"):
                # c10d: (output, input, group, out_splits, in_splits, ...); functional: (input, out_splits,
                # in_splits, group_name)
                inp, send_splits = (args[1], args[4]) if name == "alltoall_base_" else (args[0], args[2])
                row = inp[0].numel() * inp.element_size() if inp.size(0) else 0
                splits = list(send_splits or []) or [inp.size(0) // world] * world
                self.sent += (sum(splits) - splits[rank]) * (row if inp.dim() > 1 else inp.element_size())
            return func(*args, **(kwargs or {}))

    x = torch.randn(tokens, C, requires_grad=True)
    for _ in range(2):  # warm-up
        layer(x).sum().backward()
    counter = Bytes()
    remote = 0
    t0 = time.perf_counter()
    for _ in range(reps):
        with counter:
            y = layer(x)
            y.sum().backward()
        if world > 1:
            routed, _ = layer.route(x.detach())
            remote += int((routed.experts // (E // world) != rank).sum())
    elapsed = time.perf_counter() - t0
    formula, local = 0, E // world
    if world > 1 and dispatcher == "alltoall":  # static buffers of S rows; counts + S once per forward
        slots = tokens * min(K, local)
        formula = reps * (4 * (world - 1) * slots * C * 4 + 8 * (local + 1) * (world - 1))
    elif world > 1:  # dispatch + combine payloads, twice (backward); per-expert counts once per forward
        formula = remote * 4 * C * 4 + reps * 8 * local * (world - 1)
    return {"tokens_per_s": tokens * reps / elapsed, "a2a_bytes_measured": counter.sent, "a2a_bytes_formula": formula}


def speed(tokens: int, reps: int) -> dict:
    out: dict = {}
    for world, dispatcher in ((1, "alltoall"), (2, "alltoall"), (2, "alltoall_split")):
        key = f"ep{world}" + ("-split" if dispatcher == "alltoall_split" else "")
        ranks = _common.spawn_group(_speed_worker, world, tokens, reps, dispatcher, name=f"moe speed {key}")
        out[key] = {"tokens_per_s_total": sum(r["tokens_per_s"] for r in ranks),
                    "a2a_bytes_measured": sum(r["a2a_bytes_measured"] for r in ranks),
                    "a2a_bytes_formula": sum(r["a2a_bytes_formula"] for r in ranks)}
    for key in ("ep2", "ep2-split"):
        m, f = out[key]["a2a_bytes_measured"], out[key]["a2a_bytes_formula"]
        out[key]["a2a_bytes_ratio"] = m / f if f else None
        out[key]["target_a2a_within_1pct"] = bool(f and abs(m / f - 1) <= 0.01)
    out["ep2_over_ep1_throughput"] = out["ep2"]["tokens_per_s_total"] / out["ep1"]["tokens_per_s_total"]
    out["static_over_split_bytes"] = out["ep2"]["a2a_bytes_measured"] / max(out["ep2-split"]["a2a_bytes_measured"], 1)
    return out


# -- step time and memory against DeepSpeed-MoE -----------------------------------------------------
STEP_EP = 2  # expert-parallel degree = ranks
STEP_LR, STEP_AUX = 1e-3, 0.01  # AdamW learning rate; load-balancing loss coefficient
STEP_BATCHES = 4  # distinct (x, t) batches per rank, cycled (generated before timing)
MEASURE_STEPS = 2  # untimed steps after the timed ones that sample model state


def initial_moe() -> nn.Module:
    """The layer both implementations start from: ``plait.nn.MoE`` of ``SHAPE`` from seed 0, dropless."""
    from plait.nn import MoE

    c, h, e, k = SHAPE
    torch.manual_seed(0)
    return MoE(c, h, e, top_k=k, aux_loss_coef=STEP_AUX)


def step_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's ``STEP_BATCHES`` (input, target) pairs, each ``(TOKENS, C)``."""
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(TOKENS, SHAPE[0], generator=g), torch.randn(TOKENS, SHAPE[0], generator=g))
            for _ in range(STEP_BATCHES)]


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=STEP_LR, foreach=False)


class StepNet(nn.Module):
    """The benchmark model on plait: one MoE layer (its balancing loss reaches the router by itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.moe = initial_moe()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)


def setup_done() -> tuple[int, int]:
    """(peak RSS of build + setup, RSS now); then the peak is reset so that the steps' own peak reads apart."""
    peak, now = _common.peak_rss_bytes(), _common.rss_bytes()
    _common.reset_peak_rss()
    return peak, now


def memory_record(baseline: int, setup: tuple[int, int], reset: bool) -> dict:
    """Peak RSS above the RSS before the model was built (setup and steps), and the steps' peak above the
    RSS after setup (leaves out what setup imported or built once)."""
    steps_peak = _common.peak_rss_bytes()
    return {"peak_above_baseline": max(setup[0], steps_peak) - baseline,
            "steps_peak_above_setup": steps_peak - setup[1], "peak_reset": reset}


def timed_loop(step: Any, batches: list, warmup: int, steps: int) -> dict:
    """``warmup`` untimed then ``steps`` timed calls of ``step(x, t) -> mse``, each after a barrier: wall
    time and this process's CPU time (all its threads, gloo's included) per timed step, and the losses."""
    times, cpu, losses = [], [], []
    for i in range(warmup + steps):
        x, t = batches[i % len(batches)]
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(step(x, t))
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    dist.barrier()
    return {"step_s": times[warmup:], "step_cpu_s": cpu[warmup:], "first_mse": losses[0], "final_mse": losses[-1]}


def _plait_step_rank(rank: int, world: int, root: str, warmup: int, steps: int) -> dict:
    import plait

    p = plait.Plait(parallel={"nproc": world, "ep": world}, run={"dir": f"{root}/plait-step"},
                    train={"global_batch_size": world, "micro_batch_size": 1, "seed": 0},
                    optim={"grad_clip": 0.0}, observe={"progress": False, "trackers": []})
    batches = step_batches(rank)
    baseline = _common.rss_bytes()
    reset = _common.reset_peak_rss()
    model, opt = p.setup(StepNet(), optimizer=lambda m: adamw(m.parameters()))
    setup = setup_done()

    def step(x: torch.Tensor, t: torch.Tensor) -> float:
        mse = (model(x) - t).pow(2).mean()
        p.backward(mse)
        p.step()
        return float(mse.detach())

    timed = timed_loop(step, batches, warmup, steps)
    peak = _common.StatePeak(_common.state_sources(model, opt))
    handles = [model.register_forward_hook(lambda *_: peak.sample("after forward"))]
    handles += peak.hook_backward(model.parameters())
    for i in range(MEASURE_STEPS):
        x, t = batches[i % len(batches)]
        p.backward((model(x) - t).pow(2).mean())
        peak.sample("after backward")
        p.step()
        peak.sample("after step")
    for h in handles:
        h.remove()
    memory = memory_record(baseline, setup, reset)
    p.close()
    return {**timed, "model_state_peak": peak.result(), **memory}


STEP_MEMORY = ("model_state_peak_bytes", "peak_above_baseline_bytes", "steps_peak_above_setup_bytes")


def merge_step_ranks(per_rank: list[dict]) -> dict:
    """Per-rank records of one run -> each step's slowest rank, per-rank memory."""
    return {"step_s": [max(s) for s in zip(*(r["step_s"] for r in per_rank), strict=True)],
            "step_cpu_s": [sum(s) for s in zip(*(r["step_cpu_s"] for r in per_rank), strict=True)],
            "first_mse_rank0": per_rank[0]["first_mse"], "final_mse_rank0": per_rank[0]["final_mse"],
            "model_state_peak_bytes": [r["model_state_peak"]["total"] for r in per_rank],
            "model_state_peak_rank0": per_rank[0]["model_state_peak"],
            "peak_above_baseline_bytes": [r["peak_above_baseline"] for r in per_rank],
            "steps_peak_above_setup_bytes": [r["steps_peak_above_setup"] for r in per_rank],
            "peak_rss_reset": all(r["peak_reset"] for r in per_rank)}


def pool_rounds(runs: list[dict]) -> dict:
    """Runs of one implementation over rounds -> the median step time (the slowest rank's wall time) and
    step CPU time (summed over ranks) over every timed step of every round, and each memory figure's
    largest rank and round (``*_max``)."""
    out = dict(runs[-1])
    samples = [t for r in runs for t in r["step_s"]]
    out.update(step_s_median=statistics.median(samples), step_samples=len(samples),
               step_s_median_by_round=[statistics.median(r["step_s"]) for r in runs],
               step_cpu_s_median=statistics.median(t for r in runs for t in r["step_cpu_s"]))
    del out["step_s"], out["step_cpu_s"]
    for key in STEP_MEMORY:
        out[key + "_max"] = max(v for r in runs for v in r[key])
    return out


def _deepspeed_step(python: str, warmup: int, steps: int) -> dict | str:
    """DeepSpeed-MoE's record from bench/_moe_deepspeed.py under ``python``, or why it did not run."""
    return _common.run_deepspeed_script(python, "_moe_deepspeed.py", ["--warmup", str(warmup), "--steps", str(steps)])


def versus_deepspeed(python: str, warmup: int, steps: int, rounds: int) -> dict:
    """plait's and DeepSpeed-MoE's step on the same model (see the module docstring), alternating over
    ``rounds`` (plait then DeepSpeed in each, so that load on a shared machine falls on both); ratios
    plait / DeepSpeed of the pooled median step time and of each memory figure's largest rank."""
    c, h, e, k = SHAPE
    out: dict = {"model": f"one MoE layer: d_model {c}, expert width {h}, {e} experts, top-{k}, dropless, "
                          f"{TOKENS} tokens per rank, AdamW, fp32",
                 "ep": STEP_EP, "ranks": STEP_EP, "warmup": warmup, "steps": steps, "rounds": rounds}
    plait_runs, ds_runs, ds_error = [], [], None
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as root:
            plait_runs.append(merge_step_ranks(_common.spawn_group(_plait_step_rank, STEP_EP, root, warmup, steps,
                                                                   name="plait MoE step")))
        if python and ds_error is None:
            ds = _deepspeed_step(python, warmup, steps)
            if isinstance(ds, dict):
                ds_runs.append(ds)
            else:
                ds_error = ds
    out["plait"] = pool_rounds(plait_runs)
    if not python:
        out["deepspeed"] = ("not run: pass --deepspeed-python PYTHON (an interpreter with deepspeed installed, "
                            "e.g. python3 -m venv /tmp/dsvenv && /tmp/dsvenv/bin/pip install torch deepspeed)")
        return out
    if ds_error is not None:
        out["deepspeed"] = ds_error
        return out
    out["deepspeed"] = ds = pool_rounds(ds_runs)
    plait_rec = out["plait"]
    step = plait_rec["step_s_median"] / ds["step_s_median"]
    mem = plait_rec["model_state_peak_bytes_max"] / ds["model_state_peak_bytes_max"]
    out["ratios (plait / deepspeed)"] = {
        "step_time": round(step, 3),
        "step_cpu_time": round(plait_rec["step_cpu_s_median"] / ds["step_cpu_s_median"], 3),
        "model_state_peak": round(mem, 3),
        "peak_rss_above_baseline": round(plait_rec["peak_above_baseline_bytes_max"]
                                         / max(ds["peak_above_baseline_bytes_max"], 1), 3),
        "steps_peak_rss_above_setup": round(plait_rec["steps_peak_above_setup_bytes_max"]
                                            / max(ds["steps_peak_above_setup_bytes_max"], 1), 3)}
    out["target_step_time_le_1"] = step <= 1.0
    out["at_equal_memory_or_less"] = mem <= 1.0
    out["target_met"] = step <= 1.0 and mem <= 1.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--quick", action="store_true", help="40 steps, one seed, fewer speed repetitions")
    ap.add_argument("--deepspeed-python", default="", help="interpreter with deepspeed (run as a subprocess)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating plait/DeepSpeed rounds of the step comparison")
    ap.add_argument("--only", choices=("quality", "speed", "grouped", "deepspeed"), nargs="+",
                    default=["quality", "speed", "grouped", "deepspeed"], help="run only these sections")
    args = ap.parse_args()
    steps, seeds, reps = (40, [1], 5) if args.quick else (args.steps, args.seeds, 20)
    result: dict = {"machine": f"{os.cpu_count()} CPU cores, gloo, one thread per rank", "torch": torch.__version__,
                    "load_average_at_start": [round(v, 2) for v in os.getloadavg()]}
    with tempfile.TemporaryDirectory() as tmp:
        if "quality" in args.only:
            result["quality"] = quality(steps, seeds, Path(tmp))
        if "speed" in args.only:
            result["speed"] = speed(TOKENS, reps)
        if "grouped" in args.only:
            from _moe_grouped import grouped

            result["grouped_experts"] = grouped(args.quick, tmp)
        if "deepspeed" in args.only:
            result["deepspeed_moe"] = versus_deepspeed(args.deepspeed_python, 3, 10 if args.quick else 50,
                                                       1 if args.quick else args.rounds)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
