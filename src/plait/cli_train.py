"""``plait train``: the command that trains a registered model (or a factory's) on its data, locally through the
elastic agent, under torchrun or SLURM, or as torchft replica groups; ``plait.cli`` dispatches to it."""

from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path
from typing import Any

from plait.config import Config, ConfigError, to_toml
from plait.runtime.args import split_args

# torchrun's names for several machines, in parse_nodes's order
NODE_OPTIONS = ("--nnodes", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf", "--local-addr")


JOB_FILE = "job_id"  # the rendezvous id of the torchrun job that started a run (plait train under torchrun)
REPLICA_RESUME_ENV = "PLAIT_REPLICA_RESUME"  # set by plait train --resume for its replica groups' workers


def split_train_args(argv: list[str]) -> tuple[str | None, str | None, list[str]]:
    """Separate the optional CONFIG path, ``--resume DIR`` and ``--section.key=value`` overrides (the options for
    several machines, ``NODE_OPTIONS``, are read by ``_nodes_of``)."""
    options = {"--resume": str, **dict.fromkeys(NODE_OPTIONS, str)}
    config_path, values, overrides = split_args(argv, options, metavars={"--resume": "RUN_DIR"})
    return config_path, values.get("--resume"), overrides


def nodes_of(argv: list[str]) -> object:
    """``plait.launch.Nodes`` of a ``plait train`` or ``plait run`` command line's ``NODE_OPTIONS``."""
    from plait.launch import parse_nodes

    _, values, _ = split_args(argv, {"--resume": str, **dict.fromkeys(NODE_OPTIONS, str)})
    return parse_nodes(*(values.get(o) for o in NODE_OPTIONS))


def _job_id() -> str | None:
    """The rendezvous id of the torchrun job this worker belongs to; None outside torchrun and for torchrun's
    default id (``none``), which names no job in particular."""
    job = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return job if job != "none" else None


def _job_of(run_dir: Path) -> str | None:
    """The rendezvous id of the torchrun job that started the run in ``run_dir`` (``JOB_FILE``), if noted."""
    try:
        return (run_dir / JOB_FILE).read_text().strip()
    except OSError:
        return None


def _prepare_run(argv: list[str]) -> tuple[Config, Config, Path, bool]:
    """Returns (validated config, config as written to the run dir, run dir, resume?). The written copy
    keeps inferred values unresolved (parallel.dp=0 stays 0) so a resumed run may change the world size."""
    from plait.checkpoint.dcp import latest_checkpoint
    from plait.recipes import load_recipe_config
    from plait.recipes import validate_config as validate
    from plait.runtime.dist import external_world_size, launched_externally, restarted_by_agent

    config_path, resume, overrides = split_train_args(argv)
    restarted = restarted_by_agent()
    # a replica group's replacement heals from a live replica (or its own newest checkpoint), and a resumed replica
    # group continues from its own newest checkpoint: neither is a new run in a directory that holds one
    replacement = (restarted or os.environ.get(REPLICA_RESUME_ENV) == "1") and "PLAIT_REPLICA_GROUP" in os.environ
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if not resume and run_id and "PLAIT_REPLICA_GROUP" not in os.environ and launched_externally():
        # torchrun started this worker again: continue the run it was training. Its agent may not have counted the
        # restart (an agent whose workers were stopped for another machine's restart does not), so the run
        # directory also says which job started it: the same rendezvous id continues it
        cfg0 = load_recipe_config(config_path, overrides)
        run_dir0 = Path(cfg0.run.dir or f"runs/plait-{run_id}")
        ours = _job_id() is not None and _job_of(run_dir0) == _job_id() and latest_checkpoint(run_dir0) is not None
        if (run_dir0 / "config.toml").is_file() and (restarted or ours):
            resume, config_path = str(run_dir0), None
    if resume:
        run_dir = Path(resume)
        if config_path:
            raise ConfigError("pass either CONFIG.toml or --resume RUN_DIR (a resumed run uses its saved config)")
        groups = [latest_checkpoint(d) for d in sorted(run_dir.glob("replica*")) if d.is_dir()]  # fault.mode=replicas
        if not (run_dir / "config.toml").is_file() or (latest_checkpoint(run_dir) is None and not any(groups)):
            raise ConfigError(
                f"{run_dir} holds no checkpoint to resume from (no {run_dir}/checkpoints/latest); "
                "start a new run without --resume, or point --resume at a run directory that saved one"
            )
        cfg = load_recipe_config(run_dir / "config.toml", overrides)
        cfg.run.dir = str(run_dir)
    else:
        cfg = load_recipe_config(config_path, overrides)
        run_id = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID")
        run_dir = Path(cfg.run.dir or f"runs/plait-{run_id or time.strftime('%Y%m%d-%H%M%S')}")
        if (run_dir / "checkpoints" / "latest").exists() and not replacement:
            again = (" (a worker torchrun started again after another machine's failure continues its run when the "
                     "launch names a --rdzv-id)") if os.environ.get("TORCHELASTIC_RUN_ID") == "none" else ""
            raise ConfigError(
                f"{run_dir} already holds a run with checkpoints; continue it with --resume {run_dir}, "
                f"or choose another run.dir{again}"
            )
        cfg.run.dir = str(run_dir)
    world = external_world_size() if launched_externally() else cfg.parallel.nproc
    if world < 1:
        raise ConfigError(f"parallel.nproc must be at least 1; got {world}")
    written = copy.deepcopy(cfg)
    nodes = nodes_of(argv)
    if nodes.multi:  # every world size the nodes can make; each worker validates its own again
        for n in range(nodes.min_nodes, nodes.max_nodes + 1):
            validate(copy.deepcopy(cfg), n * world)
        return copy.deepcopy(written), written, run_dir, bool(resume)
    validate(cfg, world)
    return cfg, written, run_dir, bool(resume)


def cmd_train(argv: list[str]) -> int:
    from plait.launch import Restarts, launch_local, run_worker
    from plait.recipes import train
    from plait.runtime.dist import ERROR_DIR_ENV, launched_externally, restarted_by_agent

    cfg, written, run_dir, resume = _prepare_run(argv)
    if cfg.observe.report:  # before training, not after it: the run would end without its report
        from plait.observe.report import require_plotting

        require_plotting()
    external = launched_externally()
    if cfg.fault.mode == "replicas" and not external:
        return _train_replicas(argv, cfg, written, run_dir, resume)
    is_rank0 = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0
    if is_rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(to_toml(written))
        if external and _job_id() is not None and not resume:
            (run_dir / JOB_FILE).write_text(_job_id())
    if external:
        os.environ.setdefault(ERROR_DIR_ENV, str((run_dir / "errors").resolve()))
        if "PLAIT_REPLICA_GROUP" in os.environ and (restarted_by_agent() or os.environ.get(REPLICA_RESUME_ENV) == "1"):
            # a replica group's replacement heals from a live group, else continues from its own newest checkpoint;
            # a resumed group continues from its own newest checkpoint (one without heals from the others)
            from plait.checkpoint.dcp import latest_checkpoint

            resume = latest_checkpoint(run_dir) is not None
        summary = run_worker(train, (cfg, run_dir, resume), cfg.comm.backend, cfg.comm.timeout_s)
    elif cfg.parallel.nproc == 1 and not nodes_of(argv).multi:
        summary = train(cfg, run_dir, resume)
    else:
        f = cfg.fault
        restarts = Restarts(max_restarts=f.max_restarts, backoff_s=f.restart_backoff_s, state_dir=run_dir)
        nodes = nodes_of(argv)
        holder = _start_holder(run_dir, nodes) if f.memory_checkpoint else None
        try:
            summary = launch_local(train_worker, lambda attempt: (cfg, run_dir, resume or attempt > 0),
                                   cfg.parallel.nproc, run_dir / "errors", cfg.comm.backend, cfg.comm.timeout_s,
                                   restarts, nodes)
        finally:
            if holder is not None:
                holder.stop()
    if is_rank0:
        if "tokens_per_s" in summary and summary["tokens_per_s"]:
            speed = f"{summary['tokens_per_s']:,.0f} tokens/s"
        else:
            speed = f"{summary['samples_per_s']:,.0f} samples/s"
        accuracy = f", val accuracy {summary['final_val_accuracy']:.2%}" if "final_val_accuracy" in summary else ""
        lines = [
            f"\nplait: trained {summary['steps']} steps on {summary['world_size']} worker(s): "
            f"val loss {summary['final_val_loss']:.4f}{accuracy}, {speed}",
            f"  run directory: {run_dir}",
            f"  metrics:       {run_dir / 'metrics.jsonl'}" + (f" (also to {', '.join(cfg.observe.trackers)})"
                                                                    if cfg.observe.trackers else ""),
            f"  summary:       {run_dir / 'summary.json'}",
        ]
        if cfg.model.name == "gpt" and not cfg.model.factory:
            lines.append(f"  sample:        plait sample {run_dir} --prompt \"def \"")
        report = run_dir / "report.html"  # written by the run itself with observe.report = true
        made = cfg.observe.report and report.is_file()
        lines.append(f"  report:        {report}" if made else f"  report:        plait report {run_dir}")
        print("\n".join(lines))
    return 0


def _train_replicas(argv: list[str], cfg: Config, written: Config, run_dir: Path, resume: bool = False) -> int:
    """``plait train`` with fault.mode=replicas: parallel.dp_replicate torchft replica groups (when 0, one per
    model replica: per tp x pp x cp x ep ranks) of nproc / dp_replicate workers each, group g training in
    RUN_DIR/replica<g> under its own elastic agent (restarting its workers up to fault.max_restarts times). With
    ``--resume RUN_DIR`` each group continues from the newest checkpoint in RUN_DIR/replica<g>, and a group that
    has none heals from the others at the first step."""
    from plait.fault.replica_events import describe, run_summary
    from plait.fault.replicas import default_groups, launch_replica_groups
    from plait.parallel.replicas.topology import smallest_group

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(written))
    p = cfg.parallel
    f, groups = cfg.fault, p.dp_replicate or default_groups(p.nproc, smallest_group(p))
    if resume:  # each group from its own directory, with the run's saved config and this command's overrides
        from plait.checkpoint.dcp import latest_checkpoint

        missing = [g for g in range(groups) if latest_checkpoint(run_dir / f"replica{g}") is None]
        if missing:  # it would start from fresh weights while the others resume: the groups must start equal
            raise ConfigError(f"--resume {run_dir}: replica group(s) {missing} hold no checkpoint in "
                              f"{run_dir}/replica<g>/checkpoints; copy another group's checkpoints directory there "
                              "(the groups hold the same state at the same step), or start a new run")
        argv = [str(run_dir / "config.toml"), *split_train_args(argv)[2]]
        os.environ[REPLICA_RESUME_ENV] = "1"
    rc = launch_replica_groups(lambda g: ["-m", "plait.cli", "train", *argv, f"--run.dir={run_dir / f'replica{g}'}"],
                               groups, f.max_restarts, f.lighthouse, f.min_replicas, cfg.parallel.nproc // groups)
    if rc:
        print(f"plait: a replica group failed (exit status {rc}); see {run_dir}/replica*/errors", file=sys.stderr)
        return rc
    summary = run_summary(run_dir, groups)
    print(f"\nplait: trained {cfg.train.steps} steps in {groups} torchft replica groups: "
          f"{describe(summary['replicas'])}\n  run directory: {run_dir}/replica0 .. replica{groups - 1} (each its own "
          f"metrics, summary and checkpoints)\n  summary:       {run_dir / 'summary.json'}")
    return 0


def _start_holder(run_dir: Path, nodes: Any) -> Any:
    """``fault.memory_checkpoint``: this machine's holder (``plait.fault.holder``), which outlives every attempt's
    workers so that a restart reloads from it; its address and token go to the workers in the environment. On one
    machine it listens on loopback; on several, on ``--local-addr`` or else the address this machine uses toward
    the rendezvous host, where the other machines' workers put and find their second copies (its pid file then
    names this launcher: several launchers may share the run directory)."""
    from plait.fault.holder import facing, start

    if not nodes.multi:
        holder = start(run_dir)
    else:
        host = nodes.local_addr or facing(nodes.endpoint.rsplit(":", 1)[0].strip("[]"))
        holder = start(run_dir, host, f"holder.{os.getpid()}.pid")
    os.environ.update(holder.env())
    return holder


def train_worker(cfg: Config, run_dir: Path, resume: bool) -> dict:
    """One worker of ``plait train``'s launcher: after the agents restarted the group on several machines (a node
    left or joined), continue from the newest checkpoint.

    Whether a checkpoint exists decides, not ``TORCHELASTIC_RESTART_COUNT``: torch's agent counts only failures
    (a join restarts the group without counting), and each agent counts its own, so after a join the workers of
    one group see different counts (0 on the machine that joined). A launch without ``--resume`` started into a
    run directory with no checkpoint (``_prepare_run`` refuses one that has), so any checkpoint found here was
    saved by this job: its workers stopped for a new rendezvous, every one of them, before any restarted."""
    from plait.checkpoint.dcp import latest_checkpoint
    from plait.recipes import train

    return train(cfg, run_dir, resume or latest_checkpoint(run_dir) is not None)
