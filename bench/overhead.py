"""plait's step against the hand-written one: CPU time and device syncs per step, eager and compiled.

Issue 32's measure. Every implementation trains its own copy of one model (plait's GPT from one seed; full run:
4 layers, d_model 128, 4 heads, sequences of 64 byte tokens, 8 per micro-batch, 0.8M parameters) on the same
batches, with the same optimizer, ``torch.optim.AdamW(lr=1e-3, fused=True)`` (plait's default on a GPU, whose
``found_inf`` lets a non-finite step be skipped on the device), and clipping at 1.0 on every side.

World 1, one process, eight implementations:

  hand              ``loss = F.cross_entropy(model(x), y)``, ``loss.backward()``, ``clip_grad_norm_(params, 1.0)``,
                    ``opt.step()``, ``opt.zero_grad()`` over a list of batches
  plait             ``plait.Plait``: ``p.backward(F.cross_entropy(model(x), y))``, ``p.step()``, same batches
  plait_loader      the ``plait`` loop over ``p.setup_dataloader(dataset)`` (what the Trainer reads from)
  trainer           ``plait.Trainer(...).train_step()``: its loader, ``forward_backward``, ``step``
  *_compiled        the same four compiled: ``torch.compile(model)`` for the hand loop, ``train.compile="model"``
                    for the API (the user's loss outside the region), ``train.compile=true`` for the Trainer
                    (auto: the model and the loss in one region)

``train.log_every`` is larger than the run, so no timed step is a log step (step 1 is, in the warm-up).

World 2 (two spawned gloo ranks): ``plait`` (its bucketed reducer) against a plain DDP loop (``ddp``: DDP, the
same AdamW, ``clip_grad_norm_``), same batches per rank.

Timing: after ``warmup`` untimed steps each (compilation, optimizer states), ``rounds`` rounds; in each round
every implementation runs a block of ``per_block`` steps in turn, the order rotated by one per round, and the
block's CPU time (``time.process_time``: this process, every thread; on the loaded 2-core machine it is steadier
than wall time, which is reported beside it) divided by its steps is one sample. Ratios are paired: per round,
``hand / plait`` (and ``ddp / plait``, the slower rank's CPU time each), their median over rounds. A ratio above
1 means plait's step costs less. Verdicts compare with the issue's targets: ``hand/plait >= 0.97`` eager and
compiled, ``plait_loader/trainer >= 0.97`` (the Trainer within 3% of the API), ``ddp/plait >= 1.00`` at world 2.

Device syncs: ``torch.profiler``'s count of ``aten::_local_scalar_dense`` (what ``.item()``, ``float()`` and
``bool()`` of a tensor run; on a GPU each one waits for the device) over ``sync_steps`` non-logging steps of each
implementation, per step, and plait's extra over the peer (target: 0). The fused CPU AdamW kernel itself reads its
step counters this way (one per parameter, on both sides; on a GPU it does not), so the extra is what counts.
Beside it, one log step of ``plait`` (its one read of the step's values, and at world 2 its one agreement
all-reduce), and the extra of a non-fused AdamW (``fused=False``), which cannot skip a non-finite step by
itself: plait then reads the step's non-finite flag on the host, one sync per step. At world 2 also the c10d
collectives per non-logging step (a dispatch mode counting every ``c10d`` operator).

    python bench/overhead.py [--quick] [--rounds 15] [--per-block 8] [--warmup 3] [--backend inductor]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import _common  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SEED = 1234
LR = 1e-3
CLIP = 1.0
NEVER = 10**9  # train.log_every / train.steps: no timed step logs
TARGET_WORLD1, TARGET_TRAINER, TARGET_WORLD2 = 0.97, 0.97, 1.00
EAGER = ("hand", "plait", "plait_loader", "trainer")
COMPILED = tuple(f"{n}_compiled" for n in EAGER)
RATIOS = {"hand/plait": ("hand", "plait"), "hand_compiled/plait_compiled": ("hand_compiled", "plait_compiled"),
          "plait_loader/trainer": ("plait_loader", "trainer"),
          "plait_loader_compiled/trainer_compiled": ("plait_loader_compiled", "trainer_compiled")}


@dataclass(frozen=True)
class Setup:
    n_layer: int
    d_model: int
    n_head: int
    seq_len: int
    micro: int
    warmup: int
    rounds: int
    per_block: int
    sync_steps: int
    backend: str
    compiled: bool = True


FULL = Setup(n_layer=4, d_model=128, n_head=4, seq_len=64, micro=8, warmup=3, rounds=15, per_block=8, sync_steps=4,
             backend="inductor")
QUICK = Setup(n_layer=1, d_model=32, n_head=2, seq_len=16, micro=2, warmup=2, rounds=2, per_block=2, sync_steps=2,
              backend="aot_eager")


def gpt(s: Setup) -> torch.nn.Module:
    from plait.config import ModelConfig
    from plait.models.tiny import seeded_gpt

    return seeded_gpt(ModelConfig(n_layer=s.n_layer, d_model=s.d_model, n_head=s.n_head, seq_len=s.seq_len,
                                  vocab_size=256, dropout=0.0), seed=SEED)


def dataset(s: Setup, count: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, 256, (count, s.seq_len + 1), generator=g)
    return torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:])


def batches(data: torch.utils.data.TensorDataset, micro: int, rank: int = 0, world: int = 1) -> list[tuple]:
    """The data set in micro-batches, rank ``rank``'s share of each global batch (kept in memory: no loader)."""
    x, y = data.tensors
    out = []
    for i in range(0, len(x) - micro * world + 1, micro * world):
        lo = i + rank * micro
        out.append((x[lo:lo + micro], y[lo:lo + micro]))
    return out


def adamw(params: Any, fused: bool = True) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, fused=fused)


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


# -- the implementations: each is (one optimizer step -> loss tensor, close) -----------------------------------------
Step = Callable[[], Any]


def plait_config(s: Setup, root: str, name: str, world: int, compile_: Any = False) -> Any:
    import plait

    return plait.Plait(train={"global_batch_size": s.micro * world, "micro_batch_size": s.micro, "seed": SEED,
                              "log_every": NEVER, "steps": NEVER, "eval_every": 0, "compile": compile_,
                              "compile_backend": s.backend},
                       optim={"grad_clip": CLIP, "lr": LR, "warmup_steps": 0, "min_lr_ratio": 1.0},
                       checkpoint={"every": 0}, observe={"progress": False, "trackers": []},
                       run={"dir": str(Path(root, name))})


def build_hand(s: Setup, data: list, compiled: bool, fused: bool = True, wrap: Callable | None = None
               ) -> tuple[Step, Callable]:
    model = gpt(s)
    module = wrap(model) if wrap is not None else model
    opt = adamw(module.parameters(), fused)
    params = list(module.parameters())
    fwd = torch.compile(module, backend=s.backend) if compiled else module
    it = itertools.cycle(data)

    def step() -> torch.Tensor:
        x, y = next(it)
        loss = lm_loss(fwd(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step, lambda: None


def build_plait(s: Setup, data: list, root: str, name: str, compiled: bool, world: int = 1, fused: bool = True,
                loader: torch.utils.data.Dataset | None = None) -> tuple[Step, Callable, Any]:
    p = plait_config(s, root, name, world, "model" if compiled else False)
    model, _ = p.setup(gpt(s), optimizer=lambda m: adamw(m.parameters(), fused))
    if loader is not None:
        source = p.setup_dataloader(loader)
        it = (b for _ in itertools.count() for b in source)
    else:
        it = itertools.cycle(data)

    def step() -> torch.Tensor:  # the README's loop body
        x, y = next(it)
        loss = lm_loss(model(x), y)
        p.backward(loss)
        p.step()
        return loss.detach()
    return step, p.close, p


def build_trainer(s: Setup, data: torch.utils.data.Dataset, root: str, name: str, compiled: bool
                  ) -> tuple[Step, Callable, Any]:
    import plait

    p = plait_config(s, root, name, 1, True if compiled else False)
    trainer = plait.Trainer(gpt(s), train_data=data, loss_fn="causal_lm", optimizer=lambda m: adamw(m.parameters()),
                            scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0), plait=p)
    return (lambda: trainer.train_step().info), p.close, p


def build_world1(s: Setup, root: str) -> dict[str, tuple[Step, Callable]]:
    count = max(64, s.micro * 8)
    data = dataset(s, count)
    listed = batches(data, s.micro)
    out: dict[str, tuple[Step, Callable]] = {}
    for compiled in (False, True) if s.compiled else (False,):
        tail = "_compiled" if compiled else ""
        out["hand" + tail] = build_hand(s, listed, compiled)
        out["plait" + tail] = build_plait(s, listed, root, "plait" + tail, compiled)[:2]
        out["plait_loader" + tail] = build_plait(s, listed, root, "plait_loader" + tail, compiled, loader=data)[:2]
        out["trainer" + tail] = build_trainer(s, data, root, "trainer" + tail, compiled)[:2]
    return out


# -- measuring --------------------------------------------------------------------------------------------------------
def count_syncs(step: Step, steps: int) -> float:
    """``aten::_local_scalar_dense`` per step over ``steps`` steps (reading nothing the step returns)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::_local_scalar_dense") / steps


def count_collectives(step: Step, steps: int) -> float:
    """c10d operators per step (every collective, whoever issues it)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            if getattr(func, "namespace", "") == "c10d":
                Count.calls += 1
            return func(*args, **(kwargs or {}))

    with Count():
        for _ in range(steps):
            step()
    return Count.calls / steps


def block(step: Step, n: int, barrier: Callable[[], None] | None = None) -> tuple[float, float]:
    """(CPU seconds, wall seconds) per step over ``n`` steps."""
    if barrier is not None:
        barrier()
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        step()
    return (time.process_time() - c0) / n, (time.perf_counter() - w0) / n


def alternate(impls: dict[str, tuple[Step, Callable]], s: Setup, barrier: Callable[[], None] | None = None,
              say: Callable[[str], None] = lambda _: None) -> dict[str, dict[str, list[float]]]:
    """Warm-up, then ``rounds`` rounds of one block per implementation, rotated; per-block samples."""
    names = list(impls)
    for name in names:
        for _ in range(s.warmup):
            impls[name][0]()
    out = {n: {"cpu": [], "wall": []} for n in names}
    for r in range(s.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            cpu, wall = block(impls[name][0], s.per_block, barrier)
            out[name]["cpu"].append(cpu)
            out[name]["wall"].append(wall)
        say(f"[overhead bench] round {r + 1}/{s.rounds}")
    return out


def spread(xs: list[float]) -> dict[str, float]:
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else xs * 3
    return {"median": statistics.median(xs), "q1": q1, "q3": q3, "min": min(xs), "max": max(xs)}


def loss_of(out: Any) -> float:
    """A step's loss: the tensor a loop returns, or a Trainer step's ``StepInfo.loss`` (read here, once)."""
    return float(out.loss) if hasattr(out, "loss") else float(out)


def paired(samples: dict[str, dict[str, list[float]]], peer: str, mine: str, key: str = "cpu") -> float:
    """Median over rounds of peer / mine (above 1: plait's step costs less)."""
    return statistics.median(a / b for a, b in zip(samples[peer][key], samples[mine][key], strict=True))


# -- world 1 ---------------------------------------------------------------------------------------------------------
def unfused_extra(s: Setup, root: str) -> dict[str, float]:
    """Syncs per non-logging step with a non-fused AdamW (it cannot take found_inf), hand against plait."""
    data = batches(dataset(s, max(64, s.micro * 8)), s.micro)
    hand = build_hand(s, data, False, fused=False)[0]
    plait_step, close, _ = build_plait(s, data, root, "plait_unfused", False, fused=False)
    for _ in range(2):
        hand(), plait_step()
    out = {"hand": count_syncs(hand, s.sync_steps), "plait": count_syncs(plait_step, s.sync_steps)}
    close()
    return {**out, "extra": out["plait"] - out["hand"]}


def log_step_syncs(s: Setup, root: str, world: int = 1) -> float:
    """Syncs of one log step of the API (``p.step(log=True)``): its one read of the step's values."""
    data = batches(dataset(s, max(64, s.micro * 8)), s.micro)
    _, close, p = build_plait(s, data, root, "plait_log", False, world)
    model = p.strategy.model
    it = itertools.cycle(data)

    def step(log: bool) -> None:
        x, y = next(it)
        p.backward(lm_loss(model(x), y))
        p.step(log=log)
    for _ in range(2):
        step(False)
    n = count_syncs(lambda: step(True), 1)
    close()
    return n


def run_world1(s: Setup, root: str) -> dict[str, Any]:
    impls = build_world1(s, root)
    samples = alternate(impls, s, say=lambda m: print(m, file=sys.stderr))
    syncs = {name: count_syncs(step, s.sync_steps) for name, (step, _) in impls.items()}
    losses = {name: loss_of(step()) for name, (step, _) in impls.items()}
    for _, close in impls.values():
        close()
    names = [n for n in EAGER + COMPILED if n in impls]
    ratios = {k: paired(samples, a, b) for k, (a, b) in RATIOS.items() if a in impls and b in impls}
    extra = {n: syncs[n] - syncs["hand" + ("_compiled" if n.endswith("_compiled") else "")]
             for n in names if not n.startswith("hand")}
    return {"impls": {n: {"cpu_s_per_step": spread(samples[n]["cpu"]), "wall_s_per_step": spread(samples[n]["wall"]),
                          "syncs_per_step": syncs[n], "loss_after": losses[n]} for n in names},
            "ratios_cpu_paired": ratios,
            "ratios_wall_paired": {k: paired(samples, a, b, "wall") for k, (a, b) in RATIOS.items()
                                   if a in impls and b in impls},
            "extra_syncs_per_step": extra,
            "plait_log_step_syncs": log_step_syncs(s, root),
            "unfused_adamw_syncs_per_step": unfused_extra(s, root)}


# -- world 2 ---------------------------------------------------------------------------------------------------------
def run_rank(rank: int, world: int, s: Setup, root: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    data = batches(dataset(s, max(64, s.micro * world * 8)), s.micro, rank, world)
    impls = {"ddp": build_hand(s, data, False, wrap=DistributedDataParallel),
             "plait": build_plait(s, data, root, "plait_w2", False, world)[:2]}
    samples = alternate(impls, s, barrier=dist.barrier,
                        say=lambda m: print(m, file=sys.stderr) if rank == 0 else None)
    syncs = {n: count_syncs(step, s.sync_steps) for n, (step, _) in impls.items()}
    collectives = {n: count_collectives(step, s.sync_steps) for n, (step, _) in impls.items()}
    log_syncs = log_step_syncs(s, root + f"/rank{rank}", world)
    for _, close in impls.values():
        close()
    return {"samples": samples, "syncs": syncs, "collectives": collectives, "log_syncs": log_syncs}


def run_world2(s: Setup, root: str) -> dict[str, Any]:
    per_rank = _common.spawn_group(run_rank, 2, s, root, name="overhead bench", timeout_s=3600)
    # a block's cost is its slower rank's
    samples = {n: {k: [max(v) for v in zip(*(r["samples"][n][k] for r in per_rank), strict=True)]
                   for k in ("cpu", "wall")} for n in ("ddp", "plait")}
    syncs = {n: max(r["syncs"][n] for r in per_rank) for n in ("ddp", "plait")}
    collectives = {n: max(r["collectives"][n] for r in per_rank) for n in ("ddp", "plait")}
    return {"impls": {n: {"cpu_s_per_step": spread(samples[n]["cpu"]), "wall_s_per_step": spread(samples[n]["wall"]),
                          "syncs_per_step": syncs[n], "collectives_per_step": collectives[n]} for n in samples},
            "ratio_cpu_paired": {"ddp/plait": paired(samples, "ddp", "plait")},
            "ratio_wall_paired": {"ddp/plait": paired(samples, "ddp", "plait", "wall")},
            "extra_syncs_per_step": syncs["plait"] - syncs["ddp"],
            "plait_log_step_syncs": max(r["log_syncs"] for r in per_rank)}


def verdicts(w1: dict[str, Any], w2: dict[str, Any]) -> dict[str, Any]:
    r = w1["ratios_cpu_paired"]
    out = {f"eager_hand/plait>={TARGET_WORLD1}": r["hand/plait"] >= TARGET_WORLD1,
           f"trainer_within_{1 - TARGET_TRAINER:.0%}_of_api": r["plait_loader/trainer"] >= TARGET_TRAINER,
           f"world2_ddp/plait>={TARGET_WORLD2}": w2["ratio_cpu_paired"]["ddp/plait"] >= TARGET_WORLD2,
           "zero_extra_syncs_non_logging_step": all(v == 0 for v in w1["extra_syncs_per_step"].values())
           and w2["extra_syncs_per_step"] == 0}
    if "hand_compiled/plait_compiled" in r:
        out[f"compiled_hand/plait>={TARGET_WORLD1}"] = r["hand_compiled/plait_compiled"] >= TARGET_WORLD1
        out[f"trainer_compiled_within_{1 - TARGET_TRAINER:.0%}_of_api"] = (
            r["plait_loader_compiled/trainer_compiled"] >= TARGET_TRAINER)
    out["all"] = all(out.values())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model, 2 rounds, aot_eager: checks that it runs")
    ap.add_argument("--rounds", type=int, help=f"timed rounds (default {FULL.rounds})")
    ap.add_argument("--per-block", type=int, help=f"steps per block (default {FULL.per_block})")
    ap.add_argument("--warmup", type=int, help=f"untimed steps per implementation (default {FULL.warmup})")
    ap.add_argument("--backend", help=f"torch.compile backend of the compiled ones (default {FULL.backend})")
    ap.add_argument("--no-compiled", action="store_true", help="leave the compiled implementations out")
    args = ap.parse_args()
    s = QUICK if args.quick else FULL
    given = {k: v for k, v in (("rounds", args.rounds), ("per_block", args.per_block), ("warmup", args.warmup),
                               ("backend", args.backend)) if v is not None}
    s = replace(s, **given, compiled=not args.no_compiled)
    torch.set_num_threads(1)
    started, load_before = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory() as root:
        w1 = run_world1(s, root)
        w2 = run_world2(s, root)
    out = {"bench": "overhead", "command": " ".join([Path(sys.executable).name, *sys.argv]),
           "machine": _common.machine_info(), "setup": asdict(s), "optimizer": f"AdamW(lr={LR}, fused=True)",
           "grad_clip": CLIP, "threads": 1, "world1": w1, "world2": w2, "verdicts": verdicts(w1, w2),
           "targets": {"hand/plait": TARGET_WORLD1, "plait_loader/trainer": TARGET_TRAINER, "ddp/plait": TARGET_WORLD2,
                       "extra_syncs": 0},
           "wall_s": round(time.perf_counter() - started, 1),
           "load_avg_1m": {"before": load_before[0], "after": os.getloadavg()[0]}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
