"""Mixture of experts: quality against a dense GPT of equal active FLOPs, balancing, capacity, and the
expert-parallel layer's speed and all-to-all bytes. One run prints JSON.

Quality (``plait train`` on the embedded corpus, one process, equal steps and data): plait's GPT with
every block's MLP an MoE of 8 experts, top-2, each expert ``4 d / 2`` wide (so a token's active MLP FLOPs
equal the dense ``4 d`` MLP's), against the dense GPT; 3 seeds each, final validation loss median and
spread. Then aux-loss against bias balancing (loss, MaxVio over training) and capacity factor 1.0 / 1.25 /
2.0 / dropless (drop rate, loss), one seed each.

Speed (gloo, one thread per rank): the MoE layer's forward+backward tokens/s at ep=1 (one process, all
experts) and ep=2 (two processes, each with its own tokens and half the experts), and the bytes the
all-to-alls put on the wire, read from the c10d calls' own split sizes by a dispatch-mode counter, against
the formula from the routing: per forward, dispatch and combine each move every assignment routed to a
remote expert (``C x 4`` bytes), the dispatch also its int64 expert id, and the count exchange ``8 x (ep-1)``
bytes; backward moves the dispatch and combine payloads again (not the ids and counts).

Not run here: DeepSpeed-MoE side by side (its CPU/gloo path was not installed in this environment).

    python bench/moe.py [--steps 200] [--quick]
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

import _common  # noqa: F401  (puts src/ on the path)

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["--model.n_layer=2", "--model.d_model=64", "--model.n_head=4", "--model.seq_len=64",
         "--train.global_batch_size=16", "--train.micro_batch_size=16", "--optim.lr=3e-3",
         "--optim.warmup_steps=20", "--train.eval_sequences=128", "--parallel.nproc=1",
         "--observe.progress=false", "--observe.tensorboard=false", "--checkpoint.every=0"]
MOE = ["--moe.num_experts=8", "--moe.top_k=2"]


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
    res: dict = {"dense": [], "moe": []}
    for s in seeds:
        res["dense"].append(train([], steps, s, root, f"dense{s}"))
        res["moe"].append(train(MOE, steps, s, root, f"moe{s}"))
    summary = {}
    for k, runs in res.items():
        losses = [r["val_loss"] for r in runs]
        summary[k] = {"val_loss_median": statistics.median(losses), "val_loss_min": min(losses),
                      "val_loss_max": max(losses), "tokens_per_s_median": statistics.median(r["tokens_per_s"]
                                                                                             for r in runs)}
    spread = max(summary["dense"]["val_loss_max"] - summary["dense"]["val_loss_min"],
                 summary["moe"]["val_loss_max"] - summary["moe"]["val_loss_min"])
    verdict = summary["moe"]["val_loss_median"] < summary["dense"]["val_loss_median"] - spread / 2
    balance = {b: train(MOE + [f"--moe.balance={b}"], steps, seeds[0], root, f"bal-{b}") for b in ("aux", "bias")}
    capacity = {str(c): train(MOE + [f"--moe.capacity_factor={c}"], steps, seeds[0], root, f"cap{c}")
                for c in (1.0, 1.25, 2.0, 0.0)}
    return {"seeds": seeds, "steps": steps, "dense_vs_moe": summary, "runs": res,
            "target_moe_below_dense": bool(verdict), "balance": balance, "capacity (0.0 = dropless)": capacity}


# -- speed -----------------------------------------------------------------------------------------
def _speed_worker(rank: int, world: int, port: int, tokens: int, reps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from plait.nn import MoE
    from plait.parallel.expert import AllToAllDispatcher

    C, H, E, K = 128, 256, 8, 2
    torch.manual_seed(0)
    layer = MoE(C, H, E, top_k=K)
    if world > 1:
        import torch.nn as nn

        n = E // world
        for name in ("w1", "w2"):
            full = getattr(layer.experts, name)
            setattr(layer.experts, name, nn.Parameter(full.detach()[rank * n:(rank + 1) * n].clone()))
        layer.dispatcher = AllToAllDispatcher(None, rank * n, n, world, rank)

    class Bytes(TorchDispatchMode):
        """Bytes sent to other ranks by every c10d all-to-all, from the call's own input and split sizes."""

        def __init__(self) -> None:
            super().__init__()
            self.sent = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            if func._overloadpacket.__name__ == "alltoall_base_":
                inp, send_splits = args[1], args[4]  # (output, input, group, out_splits, in_splits, ...)
                row = inp[0].numel() * inp.element_size() if inp.size(0) else 0
                splits = list(send_splits) or [inp.size(0) // world] * world
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
    formula = 0
    if world > 1:  # dispatch + combine payloads, twice (backward), ids once, counts once per forward
        formula = remote * (4 * C * 4 + 8) + reps * 8 * (world - 1)
    result = {"tokens_per_s": tokens * reps / elapsed, "a2a_bytes_measured": counter.sent, "a2a_bytes_formula": formula}
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    dist.destroy_process_group()


def speed(tokens: int, reps: int) -> dict:
    import socket

    import torch.multiprocessing as mp

    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in (1, 2):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.spawn(_speed_worker, args=(world, port, tokens, reps, f"{tmp}/r"), nprocs=world)
            ranks = [json.loads(Path(f"{tmp}/r.{r}").read_text()) for r in range(world)]
            out[f"ep{world}"] = {"tokens_per_s_total": sum(r["tokens_per_s"] for r in ranks),
                                 "a2a_bytes_measured": sum(r["a2a_bytes_measured"] for r in ranks),
                                 "a2a_bytes_formula": sum(r["a2a_bytes_formula"] for r in ranks)}
    m, f = out["ep2"]["a2a_bytes_measured"], out["ep2"]["a2a_bytes_formula"]
    out["a2a_bytes_ratio"] = m / f if f else None
    out["target_a2a_within_1pct"] = bool(f and abs(m / f - 1) <= 0.01)
    out["ep2_over_ep1_throughput"] = out["ep2"]["tokens_per_s_total"] / out["ep1"]["tokens_per_s_total"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--quick", action="store_true", help="40 steps, one seed, fewer speed repetitions")
    args = ap.parse_args()
    steps, seeds, reps = (40, [1], 5) if args.quick else (args.steps, args.seeds, 20)
    with tempfile.TemporaryDirectory() as tmp:
        result = {"machine": f"{os.cpu_count()} CPU cores, gloo, one thread per rank",
                  "quality": quality(steps, seeds, Path(tmp)), "speed": speed(1024, reps),
                  "deepspeed_moe": "not run: DeepSpeed-MoE was not installed beside plait here; no comparison made"}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
