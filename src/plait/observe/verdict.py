"""The bottleneck verdict: what bounds a run's step, its measured share, and the change most likely to help.

The rule (documented in the README's "Looking at a run"):

1. Steady state: the logged training steps without step 1 (warm-up). Shares are time-weighted: the sum of
   a part over those steps divided by the sum of ``step_s``.
2. The parts of a step: ``data`` (``data_s``), ``communication`` (``comm_exposed_s``, the wait for
   gradient communication after backward that overlap did not hide), ``optimizer`` (``optimizer_s``),
   ``bubble`` (pipeline runs: the mean measured idle fraction of the pipeline ranks in ``summary.json``,
   times the forward+backward share it idles within), ``straggler`` (with per-rank timings: every rank
   waits in collectives for the slowest, which itself waits least; the share is what the other ranks
   wait more than it, their median ``comm_wait_s`` less its own, over the median step; medians over
   steps, so that one slow step is not a straggler) and ``compute`` (forward + backward, less the bubble).
   With per-rank timings, communication is the *smallest* exposed wait over the ranks: the slowest rank
   waits least, so what it still waits is the link; the rest of the others' wait is waiting for it.
3. Each overhead has a threshold: straggler 10%, bubble 15%, communication 15%, data 10%, optimizer 15%.
   The verdict names the overhead with the largest share among those at or over their threshold; when
   none is, the step is compute-bound (the parallel machinery is not the limit).

The suggestion is a change to the run's config, chosen with what the run already uses (no advice to
turn on what is on), and comes with its reason.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from plait.observe.runs import Run

THRESHOLDS = {"straggler": 0.10, "bubble": 0.15, "communication": 0.15, "data": 0.10, "optimizer": 0.15}
NAMES = {"compute": "compute", "communication": "exposed communication", "bubble": "pipeline bubble",
         "data": "data loading", "optimizer": "optimizer step", "straggler": "a straggler rank",
         "unknown": "unknown"}


@dataclass
class Verdict:
    """``bound``: one of compute, communication, bubble, data, optimizer, straggler, unknown (no timings);
    ``share``: its fraction of the step; ``shares``: every measured part; ``suggestion`` and ``reason``:
    the change and why; ``detail``: figures behind it (the straggler's rank, bandwidth, bubble theory)."""

    bound: str
    share: float
    suggestion: str
    reason: str
    shares: dict[str, float] = field(default_factory=dict)
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def headline(self) -> str:
        if self.bound == "unknown":
            return "no verdict: no step timings yet"
        return f"{NAMES[self.bound]} bounds the step: {self.share:.0%} of its time"


def _sum(records: list[dict[str, Any]], key: str) -> float:
    return sum(float(r.get(key) or 0.0) for r in records)


def _per_rank(records: list[dict[str, Any]], plus: tuple[str, ...], minus: tuple[str, ...] = (),
              how: Any = statistics.fmean) -> list[float] | None:
    """Per rank, ``how`` (mean, median) over steps of the ``rank_<key>`` values in ``plus`` less those in
    ``minus``; None without per-rank timings."""
    keys = plus + minus
    rows = [r for r in records if all(isinstance(r.get(f"rank_{k}"), list) for k in keys)]
    if not rows:
        return None
    width = min(len(r[f"rank_{k}"]) for r in rows for k in keys)
    return [how([sum(float(r[f"rank_{k}"][i]) for k in plus) - sum(float(r[f"rank_{k}"][i]) for k in minus)
                 for r in rows]) for i in range(width)]


def measure(run: Run) -> tuple[dict[str, float], dict[str, Any]]:
    """(shares of the step, details) over the run's steady state; empty shares without timings."""
    records = [r for r in run.steady() if float(r.get("step_s") or 0.0) > 0]
    total = _sum(records, "step_s")
    if not records or total <= 0:
        return {}, {}
    detail: dict[str, Any] = {"step_ms": 1e3 * total / len(records)}
    compute = (_sum(records, "forward_s") + _sum(records, "backward_s")) / total
    shares = {"data": _sum(records, "data_s") / total, "optimizer": _sum(records, "optimizer_s") / total,
              "communication": _sum(records, "comm_exposed_s") / total}
    exposed = _per_rank(records, ("comm_exposed_s",))
    if exposed:
        shares["communication"] = min(exposed) * len(records) / total
    # A straggler shows in what the others wait: each rank waits in collectives for the slowest one, which
    # itself waits least. Medians over steps: a straggler is slow step after step, one slow step is not.
    waits = _per_rank(records, ("comm_wait_s",), how=statistics.median)
    shares["straggler"] = 0.0
    if waits and len(waits) > 1:
        rank = waits.index(min(waits))
        others = statistics.median(waits[:rank] + waits[rank + 1:])
        step = statistics.median(float(r["step_s"]) for r in records)
        busy = _per_rank(records, ("compute_s", "data_s"), how=statistics.median) or [0.0] * len(waits)
        detail.update(straggler_rank=rank, straggler_wait_ms=1e3 * waits[rank], others_wait_ms=1e3 * others,
                      straggler_busy_ms=1e3 * busy[rank], others_busy_ms=1e3 * statistics.median(
                          busy[:rank] + busy[rank + 1:]))
        shares["straggler"] = min(1.0, max(0.0, others - waits[rank]) / step)
    pipeline = run.summary.get("pipeline") or {}
    bubbles = [float(r["bubble_measured"]) for r in pipeline.get("ranks", []) if "bubble_measured" in r]
    bubble = statistics.fmean(bubbles) if bubbles else 0.0
    shares["bubble"] = bubble * compute
    shares["compute"] = compute * (1.0 - bubble)
    if bubbles:
        detail.update(bubble_measured=bubble, bubble_theory=pipeline.get("bubble_theory"),
                      pp=pipeline.get("num_ranks"), microbatches=pipeline.get("microbatches"),
                      virtual_stages=pipeline.get("virtual_stages") or 1)
    sent, waited = _sum(records, "comm_bytes"), _sum(records, "comm_wait_s")
    detail["comm_mb_per_step"] = sent / len(records) / 2**20
    if waited > 0 and sent > 0:
        detail["comm_mb_per_s"] = sent / waited / 2**20
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    return shares, detail


def bottleneck(run: Run) -> Verdict:
    """The verdict for one run (see the module docstring for the rule)."""
    shares, detail = measure(run)
    if not shares:
        return Verdict("unknown", 0.0, "let the run log a step (train.log_every), then make the report again",
                       "the run has no step timings in metrics.jsonl yet")
    over = [b for b, limit in THRESHOLDS.items() if shares.get(b, 0.0) >= limit]
    bound = max(over, key=lambda b: shares[b]) if over else "compute"
    suggestion, reason = SUGGEST[bound](run, shares, detail)
    return Verdict(bound, shares[bound], suggestion, reason, shares, detail)


def _communication(run: Run, shares: dict[str, float], d: dict[str, Any]) -> tuple[str, str]:
    rate = f" at an effective {d['comm_mb_per_s']:.0f} MiB/s" if "comm_mb_per_s" in d else ""
    why = (f"each step sends {d['comm_mb_per_step']:.1f} MiB of gradients{rate}, and {shares['communication']:.0%} "
           "of the step waits for it after backward (overlap did not hide it)")
    compress = run.setting("comm", "compress", "none")
    if compress == "none":
        return ("try `comm.compress=powersgd` (or `comm.compress=auto`, which turns it on only when "
                "communication is exposed)", why + "; PowerSGD sends a low-rank approximation, a few percent of "
                "the bytes, with error feedback: it pays on a slow link")
    return ("raise `train.global_batch_size` (more accumulation micro-steps per optimizer step)",
            why + f" although gradients are already compressed ({compress}); accumulation micro-steps do not "
            "communicate, so each all-reduce is paid over more samples")


def _bubble(run: Run, shares: dict[str, float], d: dict[str, Any]) -> tuple[str, str]:
    m = int(d.get("microbatches") or run.setting("parallel", "microbatches", 4))
    p = int(d.get("pp") or run.setting("parallel", "pp", 2))
    v = int(d.get("virtual_stages") or 1)
    now, then = (p - 1) / (v * m + p - 1), (p - 1) / (v * 2 * m + p - 1)
    why = (f"the pipeline ranks idle {d.get('bubble_measured', 0.0):.0%} of the schedule (theory for p={p}, m={m}, "
           f"v={v}: (p-1)/(v*m+p-1) = {now:.0%}); doubling the micro-batches lowers the theory to {then:.0%}")
    schedule = run.setting("parallel", "pp_schedule", "1f1b")
    also = " or `parallel.pp_schedule=interleaved` (v=2 stages per rank)" if schedule in ("gpipe", "1f1b") else ""
    return f"raise `parallel.microbatches` from {m} to {2 * m}{also}", why


def _data(run: Run, shares: dict[str, float], d: dict[str, Any]) -> tuple[str, str]:
    workers = int(run.setting("data", "num_workers", 0) or 0)
    why = f"{shares['data']:.0%} of the step waits for the next batch"
    if workers == 0:
        return ("set `data.num_workers=2`", why + ", loaded in the training process itself; worker processes "
                "prepare batches while the model computes")
    return (f"raise `data.num_workers` (now {workers}) or pre-tokenise the data (`data.path` to a uint16 .bin)",
            why + f" even with {workers} loader worker(s)")


def _optimizer(run: Run, shares: dict[str, float], d: dict[str, Any]) -> tuple[str, str]:
    why = f"the optimizer update takes {shares['optimizer']:.0%} of the step"
    if run.setting("optim", "fused", False) is not True:  # "auto" is fused on a GPU only
        return "try `optim.fused=true`", why + "; the fused AdamW makes one pass over each parameter instead of " \
            "several (several times faster on CPU for large models)"
    if int(run.setting("parallel", "zero", 0) or 0) == 0 and run.world_size > 1:
        return ("try `parallel.zero=1`", why + "; ZeRO-1 shards the optimizer states and their update over the "
                "data-parallel ranks, so each rank updates 1/dp of them")
    return ("raise `train.global_batch_size`", why + " already fused and sharded; a larger batch per update "
            "spreads its cost over more samples")


def _straggler(run: Run, shares: dict[str, float], d: dict[str, Any]) -> tuple[str, str]:
    r = d["straggler_rank"]
    return (f"check rank {r}'s host (other jobs, thermal throttling, a slower device) or leave that node out",
            f"the other ranks wait {d['others_wait_ms']:.1f} ms per step in collectives and rank {r} only "
            f"{d['straggler_wait_ms']:.1f} ms: they wait for rank {r}, {shares['straggler']:.0%} of the step "
            f"(forward, backward and data: {d['straggler_busy_ms']:.1f} ms on rank {r}, "
            f"{d['others_busy_ms']:.1f} ms on the others)")


def _compute(run: Run, shares: dict[str, float], d: dict[str, Any]) -> tuple[str, str]:
    why = (f"forward and backward take {shares['compute']:.0%} of the step and no overhead reaches its threshold; "
           "the parallel machinery is not the limit")
    if run.setting("train", "activation_checkpointing", "none") != "none":
        return ("turn `train.activation_checkpointing` off if memory allows",
                why + "; activation checkpointing recomputes the forward pass in backward")
    if run.setting("train", "precision", "fp32") == "fp32":
        return ("try `train.precision=bf16` on hardware with fast bf16, or more workers (`parallel.nproc`)",
                why + "; lower precision speeds the arithmetic itself, and data parallelism scales while "
                "communication stays hidden")
    return "add workers (`parallel.nproc`, or more nodes)", why + "; data parallelism scales while communication " \
        "stays hidden"


SUGGEST = {"communication": _communication, "bubble": _bubble, "data": _data, "optimizer": _optimizer,
           "straggler": _straggler, "compute": _compute}
