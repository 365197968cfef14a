"""``plait plan --hardware P --gpus N --jobs JOBS.toml``: several jobs sharing a pool of N GPUs.

Each job (a config, a priority, optionally ``min_gpus`` / ``max_gpus``) is planned at every GPU count it may get
(``counts``: the powers of two below a node and the multiples of a node, within its bounds) by the planner
(``plait.plan.planner.plan``: every layout at that count, simulated, the preferred one kept). The rule, chosen by
an exact dynamic programme over the pool's GPUs:

1. admit the jobs whose minimums fit, highest priority first: the admitted jobs' total priority is maximised
   (a job that cannot get its minimum waits in the queue with 0 GPUs);
2. among those allocations, maximise the total weighted throughput: the sum over jobs of priority x the useful
   FLOP/s the simulator predicts (tokens/s x the model's FLOPs per token). FLOP/s, not tokens/s, so that jobs on
   models of different sizes compare (a token of a 7B model costs 50 times one of a 125M model); for one model the
   two are proportional, so a job's own choice is unchanged;
3. GPUs no job can use (each at its maximum) stay free.

One job with ``gpus = N`` (min = max) answers "this queue grants me N GPUs: which layout?".
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait.config import ConfigError
from plait.plan.flops import model_flops


@dataclass
class Job:
    """One job of the pool (a ``[[job]]`` table of the jobs file)."""

    name: str
    config: str | None = None
    priority: float = 1.0
    min_gpus: int = 1
    max_gpus: int = 0  # 0: the pool
    overrides: list[str] = field(default_factory=list)


@dataclass
class Option:
    """A job at one GPU count: the planner's layout and its predicted figures."""

    gpus: int
    layout: str
    tokens_per_s: float
    efficiency: float
    flops_per_s: float


def read_jobs(path: str | Path) -> list[Job]:
    """The jobs file: ``[[job]]`` tables with name, config (relative to the file), priority, min_gpus, max_gpus
    (or gpus for both) and overrides; one clear error for a bad entry."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--jobs {path}: no such file")
    try:
        tables = tomllib.loads(path.read_text()).get("job", [])
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--jobs {path}: not valid TOML ({e})") from None
    jobs = []
    for i, t in enumerate(tables):
        unknown = set(t) - {"name", "config", "priority", "min_gpus", "max_gpus", "gpus", "overrides"}
        if unknown:
            raise ConfigError(f"--jobs {path}: job {i + 1} has unknown keys {sorted(unknown)}")
        gpus = t.get("gpus")
        job = Job(str(t.get("name", f"job{i + 1}")), None, float(t.get("priority", 1.0)),
                  int(gpus or t.get("min_gpus", 1)), int(gpus or t.get("max_gpus", 0)), list(t.get("overrides", [])))
        if t.get("config"):
            job.config = str((path.parent / t["config"]).resolve())
        if job.priority <= 0 or job.min_gpus < 1 or (job.max_gpus and job.max_gpus < job.min_gpus):
            raise ConfigError(f"--jobs {path}: job {job.name} needs priority > 0 and 1 <= min_gpus <= max_gpus")
        jobs.append(job)
    if not jobs:
        raise ConfigError(f"--jobs {path} names no [[job]]")
    return jobs


def counts(job: Job, pool: int, per_node: int) -> list[int]:
    """GPU counts a job is planned at: powers of two below a node, multiples of a node, within its bounds."""
    top = min(job.max_gpus or pool, pool)
    small = [1 << k for k in range(per_node.bit_length()) if (1 << k) < per_node]
    return [g for g in sorted(set(small + list(range(per_node, top + 1, per_node)))) if job.min_gpus <= g <= top]


def options(job: Job, profile: Any, pool: int, models: Any) -> list[Option]:
    """The job planned at each of its counts (``counts``); counts where no layout fits or splits are left out."""
    from plait.data.tokenize import resolve_vocab_size
    from plait.plan.planner import base_of, plan
    from plait.plan.record import optimizer_traffic, shape_from_config

    cfg = models.load_recipe_config(job.config, job.overrides)
    resolve_vocab_size(cfg)
    shape = shape_from_config(cfg, models)
    batch = cfg.train.global_batch_size
    base = base_of(cfg, shape)
    per_node = profile.devices_per_node if profile.kind == "gpu" else pool
    out = []
    for g in counts(job, pool, per_node):
        try:
            sim = plan(shape, profile, g, batch, base=base, top=1, traffic=optimizer_traffic(cfg)).best
        except ConfigError:
            continue
        useful = model_flops(shape, sim.work.tokens_per_step) / sim.step_s
        out.append(Option(g, sim.work.layout.describe(), sim.tokens_per_s, sim.scaling_efficiency, useful))
    return out


def allocate(jobs: list[Job], choices: dict[str, list[Option]], pool: int) -> dict[str, Option | None]:
    """The allocation of the module docstring's rule: an exact dynamic programme over (job, GPUs used) whose value
    is (admitted priority, weighted FLOP/s), compared in that order."""
    best: dict[int, tuple[tuple[float, float], list[Option | None]]] = {0: ((0.0, 0.0), [])}
    for job in jobs:
        nxt: dict[int, tuple[tuple[float, float], list[Option | None]]] = {}
        for used, (value, picks) in best.items():
            for opt in [None, *choices.get(job.name, [])]:
                g = used + (opt.gpus if opt else 0)
                if g > pool:
                    continue
                gain = (job.priority, job.priority * opt.flops_per_s) if opt else (0.0, 0.0)
                cand = ((value[0] + gain[0], value[1] + gain[1]), [*picks, opt])
                if g not in nxt or cand[0] > nxt[g][0]:
                    nxt[g] = cand
        best = nxt
    _, picks = max(best.values(), key=lambda v: v[0])
    return {job.name: pick for job, pick in zip(jobs, picks, strict=True)}


def table(jobs: list[Job], chosen: dict[str, Option | None], pool: int) -> str:
    """What ``plait plan --jobs`` prints: job, priority, GPUs, layout, predicted tokens/s, scaling efficiency."""
    rows = [("job", "priority", "GPUs", "layout", "tokens/s", "scaling eff.")]
    for job in jobs:
        o = chosen[job.name]
        rows.append((job.name, f"{job.priority:g}", str(o.gpus) if o else "0 (queued)", o.layout if o else "-",
                     f"{o.tokens_per_s:,.0f}" if o else "-", f"{o.efficiency:.1%}" if o else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    used = sum(o.gpus for o in chosen.values() if o)
    return "\n".join([*lines, f"{used} of {pool} GPUs allocated"])


def cmd_pool(jobs_path: str, profile: Any, pool: int, models: Any) -> dict[str, Any]:
    """Plan every job, allocate the pool, print the table; returns the allocation for ``--json`` style use."""
    jobs = read_jobs(jobs_path)
    choices = {job.name: options(job, profile, pool, models) for job in jobs}
    chosen = allocate(jobs, choices, pool)
    print(table(jobs, chosen, pool))
    return {name: (o.__dict__ if o else None) for name, o in chosen.items()}
