"""The ``plait simulate``, ``plait calibrate`` and ``plait plan`` commands (``plait.cli`` dispatches here).

    plait simulate [CONFIG.toml] --hardware PROFILE [--nodes N --gpus-per-node G] [--trace PATH]
                   [--compare RUN_DIR] [--stack plait|megatron] [--attention auto|flash|unfused]
                   [--recompute none|full|every_k|selective] [--section.key=value ...]
    plait calibrate [--out PATH] [--quick]
    plait plan [CONFIG.toml] --hardware PROFILE --gpus N [--top K] [--write OUT.toml] [--section.key=value ...]
    plait plan memory [CONFIG.toml] [--run-dir RUN_DIR] [--section.key=value ...]
    plait plan --hardware PROFILE --gpus N --jobs JOBS.toml     (several jobs sharing a pool: plait.plan.pool)

``--hardware`` takes a shipped profile (a100-80gb, h100-sxm, h200-sxm), ``local`` (this machine's calibration) or a
TOML path. ``--stack megatron`` / ``--attention unfused`` model software plait does not run (Megatron-LM's
kernels, unfused attention), for comparing with published numbers; ``--recompute`` overrides
``train.activation_checkpointing`` (``selective`` is each stack's own: plait's keeps matmul and attention
outputs, Megatron-LM's recomputes the attention core).
Errors a user can cause raise ``ConfigError`` (one line, exit code 2).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from plait import recipes
from plait.config import ConfigError
from plait.runtime.args import split_args

FLAGS = {"--hardware": str, "--nodes": int, "--gpus-per-node": int, "--trace": str, "--compare": str,
         "--stack": str, "--attention": str, "--recompute": str, "--gpus": int, "--top": int, "--write": str,
         "--out": str, "--jobs": str, "--run-dir": str}
SWITCHES = ("--quick",)
CHOICES = {"--stack": ("plait", "megatron", "metaseq"), "--attention": ("auto", "flash", "unfused"),
           "--recompute": ("none", "full", "every_k", "selective")}


def parse(argv: list[str], allowed: tuple[str, ...]) -> tuple[str | None, dict[str, Any], list[str]]:
    """(CONFIG path or None, flags, ``--section.key=value`` overrides); unknown options are errors."""
    return split_args(argv, {n: None if n in SWITCHES else FLAGS[n] for n in allowed}, CHOICES)


def _profile(flags: dict[str, Any]) -> Any:
    from plait.plan.hardware import load_profile

    if "--hardware" not in flags:
        raise ConfigError("--hardware PROFILE is required: a100-80gb, h100-sxm, h200-sxm, local (after plait "
                          "calibrate) or a TOML path")
    return load_profile(flags["--hardware"])


def cmd_simulate(argv: list[str]) -> int:
    """``plait simulate``: JSON prediction on stdout, Chrome trace to ``--trace`` (default simulate_trace.json)."""
    from plait.plan.compare import compare_run
    from plait.plan.configured import simulate_config
    from plait.plan.trace import write_trace

    config, flags, overrides = parse(argv, ("--hardware", "--nodes", "--gpus-per-node", "--trace", "--compare",
                                            "--stack", "--attention", "--recompute"))
    profile = _profile(flags)
    run_dir = flags.get("--compare")
    if run_dir and config is None:
        config = str(Path(run_dir) / "config.toml")
        if not Path(config).is_file():
            raise ConfigError(f"{run_dir} holds no config.toml; --compare takes a run directory plait train wrote")
    cfg = _load(config, overrides)
    nodes, per_node = flags.get("--nodes", 0), flags.get("--gpus-per-node", 0)
    if run_dir and not nodes:
        cfg.parallel.nproc = _run_world(Path(run_dir), cfg.parallel.nproc)
    sim = simulate_config(cfg, profile, nodes=nodes, gpus_per_node=per_node, attention=flags.get("--attention", "auto"),
                          stack=flags.get("--stack", "plait"), recompute=flags.get("--recompute"), models=recipes)
    out = sim.as_dict()
    if not sim.fits():
        from plait.plan.fixes import smallest_fix

        raise ConfigError(smallest_fix(sim, cfg, profile, recipes))
    trace = Path(flags.get("--trace", "simulate_trace.json"))
    write_trace(sim, trace)
    out["trace"] = str(trace)
    if run_dir:
        out["compare"] = compare_run(sim, Path(run_dir))
    print(json.dumps(out, indent=1))
    return 0


def _run_world(run_dir: Path, default: int) -> int:
    summary = run_dir / "summary.json"
    if summary.is_file():
        return int(json.loads(summary.read_text()).get("world_size", default))
    return default


def cmd_calibrate(argv: list[str]) -> int:
    """``plait calibrate [--out PATH] [--quick]``: measure this machine into a profile."""
    from plait.plan.calibrate import calibrate
    from plait.recipes import build_trainer

    config, flags, overrides = parse(argv, ("--out", "--quick"))
    if config or overrides:
        raise ConfigError("plait calibrate takes only --out PATH and --quick")
    calibrate(flags.get("--out"), quick=bool(flags.get("--quick")), log=lambda s: print(s, file=sys.stderr),
              build_trainer=build_trainer)
    return 0


def _load(config: str | None, overrides: list[str]) -> Any:
    """The config with its recipe's defaults (``load_recipe_config``) and ``model.vocab_size = 0`` resolved (the
    tokenizer's, 256 for bytes), for the model's shape."""
    from plait.data.tokenize import resolve_vocab_size

    cfg = recipes.load_recipe_config(config, overrides)
    resolve_vocab_size(cfg)
    return cfg


def cmd_plan(argv: list[str]) -> int:
    """``plait plan CONFIG --hardware P --gpus N``: ranked layouts as JSON; ``--write`` the best as a config."""
    from plait.plan.planner import base_of, plan, summary_row, write_config
    from plait.plan.record import shape_from_config

    config, flags, overrides = parse(argv, ("--hardware", "--gpus", "--top", "--write", "--jobs"))
    profile = _profile(flags)
    if "--jobs" in flags:  # several jobs sharing a pool (plait.plan.pool)
        from plait.plan.pool import cmd_pool

        if config or overrides or "--gpus" not in flags:
            raise ConfigError("plait plan --jobs JOBS.toml takes --hardware and --gpus N (the pool); each job's "
                              "config and changes are in the jobs file")
        cmd_pool(flags["--jobs"], profile, flags["--gpus"], recipes)
        return 0
    cfg = _load(config, overrides)
    gpus = flags.get("--gpus", cfg.parallel.nproc)
    if gpus < 1:
        raise ConfigError(f"--gpus must be at least 1; got {gpus}")
    from plait.plan.record import optimizer_traffic

    shape = shape_from_config(cfg, recipes)
    result = plan(shape, profile, gpus, cfg.train.global_batch_size, base=base_of(cfg, shape),
                  top=flags.get("--top", 5), traffic=optimizer_traffic(cfg))
    out = {"model": {"name": shape.name, "params": shape.param_count()}, "gpus": gpus, "hardware": profile.name,
           "screened": result.screened, "ranked": [summary_row(s) for s in result.ranked], "pruned": result.pruned}
    if "--write" in flags:
        write_config(result.best, cfg, flags["--write"])
        out["written"] = flags["--write"]
    print(json.dumps(out, indent=1))
    return 0


def cmd_plan_memory(argv: list[str]) -> int:
    """``plait plan memory [CONFIG.toml] [--hardware P] [--run-dir DIR]``: predicted per-rank memory, no launch.

    The simulator's memory model (``plait.plan.rank_memory``) for every layout plait runs, per pipeline
    rank; for plait's GPT under data parallelism and ZeRO also the table next to the ZeRO paper's
    accounting (``plait.plan.memory.format_memory_table``). Activation peaks under pipelining depend on the
    schedule's order, which is simulated with ``--hardware``'s timings (default a100-80gb). MoE experts'
    activations are priced at the busiest expert-parallel rank's rows (``plait.plan.ops_moe``): ``moe.imbalance``,
    or with ``--run-dir`` the imbalance measured from that run's logged ``tokens_per_expert`` (the run's own
    config.toml when no CONFIG is given)."""
    from plait.plan.configured import simulate_config
    from plait.plan.hardware import load_profile
    from plait.plan.memory import GPTShape, format_memory_table

    config, flags, overrides = parse(argv, ("--hardware", "--run-dir"))
    run_dir = flags.get("--run-dir")
    if run_dir and config is None:
        config = str(Path(run_dir) / "config.toml")
    cfg = _load(config, overrides)
    measured = _measured_imbalance(Path(run_dir), cfg) if run_dir else None
    if measured is not None:
        cfg.moe.imbalance = measured[0]
    profile = load_profile(flags.get("--hardware", "a100-80gb"))
    sim = simulate_config(cfg, profile, derive_tp=False, memory_only=True, models=recipes)
    m, t, p, lay = cfg.model, cfg.train, cfg.parallel, sim.work.layout
    lines = []
    if not m.factory and m.name == "gpt" and lay.tp == lay.pp == 1 and lay.sync != "diloco":
        # a context-parallel rank: its 1 / cp of the sequence, the states sharded over dp x cp
        shape = GPTShape(micro_batch=lay.micro_batch_size, seq_len=m.seq_len // lay.cp, d_model=m.d_model,
                         n_head=m.n_head, n_layer=m.n_layer, vocab_size=m.vocab_size)
        lines += [format_memory_table(sim.work.shape.param_count(), dp=lay.dp * lay.cp, stage=p.zero,
                                      dp_shard=lay.shard if lay.hybrid else 0,
                                      precision="fp32" if t.precision == "fp32" else "bf16", shape=shape,
                                      checkpointing=t.activation_checkpointing, k=t.checkpoint_every_k), ""]
    mib = 2**20
    lines.append(f"per-rank memory by pipeline rank ({lay.describe()}; MiB):")
    keys = ("params", "grads", "optimizer", "activations", "buffers", "total")
    lines.append(f"{'rank':<6}" + "".join(f"{k:>14}" for k in keys))
    for rank, mem in sorted(sim.memory.items()):
        row = mem.as_dict()
        lines.append(f"{rank:<6}" + "".join(f"{row[k] / mib:>14.3f}" for k in keys))
    if lay.tp == lay.pp == 1:
        lines += ["", _setup_line(sim.work.shape.param_count(), lay, bool(cfg.model.weights))]
    if sim.work.shape.num_experts:
        lines += ["", _moe_line(sim.work.shape, lay, measured, run_dir, 4 if t.precision == "fp32" else 2)]
    print("\n".join(lines))
    return 0


def _measured_imbalance(run_dir: Path, cfg: Any) -> tuple[float, int] | None:
    """(the busiest ep rank's rows over the balanced share, its MoE layer) from the last logged
    ``tokens_per_expert`` of ``run_dir/metrics.jsonl``, at ``cfg``'s ``parallel.ep``; None without MoE records."""
    from plait.plan.ops_moe import rank_imbalance

    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"--run-dir {run_dir}: no metrics.jsonl there; give the run directory of a plait run")
    last = None
    for line in path.read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        if rec.get("moe"):
            last = rec["moe"]
    if last is None:
        return None
    ep = max(1, cfg.parallel.ep)
    per_layer = [rank_imbalance(layer["tokens_per_expert"], ep) for layer in last]
    worst = max(range(len(per_layer)), key=per_layer.__getitem__)
    return per_layer[worst], worst


def _moe_line(shape: Any, lay: Any, measured: tuple[float, int] | None, run_dir: str | None, act: int) -> str:
    """What the MoE experts' activations were priced at, per rank and micro-batch of each MoE layer."""
    from plait.plan.ops_moe import expert_rows

    tokens = lay.micro_batch_size * shape.seq_len
    held, computed = expert_rows(shape, tokens, lay.ep)
    balanced = tokens * shape.top_k
    source = (f"measured in {run_dir} (MoE layer {measured[1]})" if measured is not None else
              "moe.imbalance" + (" (balanced routing)" if shape.moe_imbalance == 1.0 else ""))
    how = ("the static all-to-all's buffers at their bound whatever the routing (set moe.capacity_factor to lower "
           "it, or moe.dispatcher=alltoall_split)" if lay.ep > 1 and shape.moe_dispatch == "alltoall" else
           "the busiest rank's rows")
    return (f"MoE experts per rank and micro-batch: balanced {balanced} rows; imbalance {shape.moe_imbalance:.3f} "
            f"from {source}: computes {computed} rows, holds {held} rows ({how}); their saved activations "
            f"(input, fc, GELU) {held * (shape.d_model + 2 * shape.expert_hidden) * act / 2**20:.3f} MiB per MoE layer")


def _setup_line(params: int, lay: Any, from_weights: bool = False) -> str:
    """The peak of setup per rank (``plait.plan.memory.predict_setup_bytes``) for a data-parallel layout;
    ``from_weights``: ``model.weights`` is set, so the model is built on the meta device and each rank reads its
    part (plait's reader reads straight into the shards: no loading transient is counted)."""
    from plait.plan.memory import predict_setup_bytes

    setup = predict_setup_bytes(4 * params, 0, world=lay.world, zero=lay.zero, dp=lay.dp * lay.cp,
                                shard=lay.shard * lay.cp,  # the gradients and shards span dp x cp
                                bucket_mb=lay.bucket_mb, source="shards" if from_weights else "whole")
    keys = ("given", "allocated", "broadcast", "loading", "layout", "peak")
    parts = "  ".join(f"{k} {setup[k] / 2**20:.3f}" for k in keys)
    how = ("built on the meta device, each rank reading its part of model.weights" if from_weights else
           "the whole model given on every rank, rank 0's weights broadcast")
    return f"setup peak per rank ({how}; fp32 parameters, buffers not counted; MiB):\n  {parts}"
