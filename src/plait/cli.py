"""``plait train | run | sample | plan | simulate | calibrate | report | launch``: the command line.

    plait train [CONFIG.toml] [--section.key=value ...] [--resume RUN_DIR] [--nnodes MIN:MAX --rdzv-endpoint H:P]
    plait run [--nproc N] [--max-restarts R] [--nnodes MIN:MAX --rdzv-endpoint H:P --rdzv-id ID] SCRIPT [ARGS ...]
    plait sample RUN_DIR --prompt TEXT [--tokens N] [--temperature T] [--top-k K] [--seed S]
    plait plan memory [CONFIG.toml] [--run-dir RUN_DIR] [--section.key=value ...]
    plait plan [CONFIG.toml] --hardware PROFILE --gpus N [--top K] [--write OUT.toml] [--section.key=value ...]
    plait plan --hardware PROFILE --gpus N --jobs JOBS.toml
    plait simulate [CONFIG.toml] --hardware PROFILE [--nodes N --gpus-per-node G] [--compare RUN_DIR]
                   [--trace PATH] [--section.key=value ...]
    plait calibrate [--out PATH] [--quick]
    plait checkpoint verify RUN_DIR
    plait report RUN_DIR [RUN_DIR ...] [-o report.html]
    plait launch slurm CONFIG --nodes N|MIN:MAX --gpus-per-node G [--qos Q] [--account A] [--partition P] [--time T]
                       [--array=OVERRIDES ...]
    plait launch k8s CONFIG --nodes N|MIN:MAX --gpus-per-node G --image IMAGE [--pvc CLAIM] [--queue Q]
                     [--priority-class C] [--api trainjob|pytorchjob]

Errors a user can cause end in one line on stderr and a non-zero exit, never a traceback: 2 for a
configuration error, 1 for a worker that failed (its traceback is in the error file the line names).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from plait.cli_train import NODE_OPTIONS, cmd_train, nodes_of, split_train_args
from plait.config import ConfigError, describe_keys, load_config


def cmd_run(argv: list[str]) -> int:
    """``plait run [--nproc N] [--max-restarts R] SCRIPT [ARGS ...]``: the user's script in N local workers
    under the elastic agent, with the same one-line failure report as ``plait train``; a failed group is
    started again up to R times (``PLAIT_ATTEMPT`` tells the script which attempt it is, so it can load
    its newest checkpoint)."""
    import tempfile

    from plait.launch import Restarts, launch_script

    nproc, max_restarts, replicas, i, node_args, lighthouse = 1, 0, 0, 0, [], ""
    options = {"--nproc": "nproc", "--nproc-per-node": "nproc", "--nproc_per_node": "nproc",
               "--max-restarts": "max_restarts", "--max_restarts": "max_restarts", "--replicas": "replicas",
               "--lighthouse": "lighthouse", **dict.fromkeys(NODE_OPTIONS, "")}
    while i < len(argv) and argv[i].startswith("-"):
        a = argv[i]
        name = a.split("=", 1)[0]
        if name not in options:
            raise ConfigError(f"unknown option {a} for plait run; usage: plait run [--nproc N] [--max-restarts R] "
                              "[--replicas G [--lighthouse URL]] [--nnodes MIN:MAX --rdzv-endpoint HOST:PORT "
                              "--rdzv-id ID] SCRIPT [ARGS ...]")
        if "=" in a:
            value, i = a.split("=", 1)[1], i + 1
        elif i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
        else:
            raise ConfigError(f"{a} needs a value")
        if not options[name]:  # several machines: read by _nodes_of
            node_args.append(f"{name}={value}")
            continue
        if options[name] == "lighthouse":
            lighthouse = value
            continue
        try:
            number = int(value)
        except ValueError:
            raise ConfigError(f"{name} needs a whole number; got {value!r}") from None
        if options[name] == "nproc":
            nproc = number
        elif options[name] == "replicas":
            replicas = number
        else:
            max_restarts = number
    if nproc < 1:
        raise ConfigError(f"--nproc must be at least 1; got {nproc}")
    if i >= len(argv):
        raise ConfigError("plait run needs a script: plait run [--nproc N] SCRIPT [ARGS ...]")
    script = argv[i]
    if not Path(script).is_file():
        raise ConfigError(f"script {script} does not exist")
    if replicas or lighthouse:
        return _run_replicas(script, argv[i + 1:], replicas, nproc, max_restarts, lighthouse)
    from plait.runtime.dist import FOLLOW_RUN_DIR_ENV

    # The launcher's own files (progress, worker pids, errors raised before plait.Plait exists) go to a fresh
    # directory; a worker's report goes to RUN_DIR/errors once the script's plait.Plait knows its run directory.
    error_dir = Path(tempfile.mkdtemp(prefix="plait-run-")) / "errors"
    os.environ[FOLLOW_RUN_DIR_ENV] = "1"
    restarts = Restarts(max_restarts=max_restarts, state_dir=error_dir.parent)
    launch_script(script, argv[i + 1:], nproc, error_dir, restarts, nodes_of(node_args))
    return 0


def _run_replicas(script: str, args: list[str], replicas: int, nproc: int, max_restarts: int, lighthouse: str) -> int:
    """``plait run --replicas G [--nproc R]``: the script as G torchft replica groups of R workers each
    (fault.mode=replicas; a group of several is data-parallel or sharded inside as the script's config says), each
    group under its own elastic agent restarting its workers up to ``max_restarts`` times; a loopback Lighthouse
    unless ``--lighthouse`` names one."""
    from plait.fault.replicas import launch_replica_groups, require_torchft

    if replicas < 1:
        raise ConfigError(f"--replicas must be at least 1 (replica groups); got {replicas}")
    require_torchft()
    rc = launch_replica_groups(lambda g: ["-m", "plait.launch", script, *args], replicas, max_restarts, lighthouse,
                               ranks=nproc)
    if rc:
        print(f"plait: a replica group failed (exit status {rc}) after {max_restarts} restart(s)", file=sys.stderr)
    return rc


def cmd_sample(argv: list[str]) -> int:
    import torch

    from plait.checkpoint.single_file import load_safetensors
    from plait.models.gpt import GPT

    ap = argparse.ArgumentParser(prog="plait sample", description="Generate text from a trained run.")
    ap.add_argument("run_dir")
    ap.add_argument("--prompt", default="\n")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not (run_dir / "config.toml").is_file():
        raise ConfigError(f"{run_dir} is not a plait run directory (no config.toml)")
    cfg = load_config(run_dir / "config.toml")
    if cfg.model.factory or cfg.model.name != "gpt":
        raise ConfigError(f"plait sample generates text from plait's GPT (model.name=gpt); {run_dir} trained "
                          f"{cfg.model.factory or cfg.model.name}")
    from plait.data.tokenize import load_tokenizer, resolve_vocab_size

    resolve_vocab_size(cfg)  # model.vocab_size = 0: the run's tokenizer's
    tokenizer = load_tokenizer(cfg.data.tokenizer)  # the run's own (bytes when it had none)
    model = GPT(cfg.model, cfg.moe)
    load_safetensors(model, run_dir)  # RUN_DIR/model/ (or model.safetensors of older runs)
    model.eval()
    if not cfg.data.tokenizer and cfg.model.vocab_size < 256:
        raise ConfigError("this run's vocabulary is not byte-level; sampling from text needs vocab_size >= 256")
    prompt = tokenizer.encode(args.prompt or "\n") or tokenizer.encode("\n")
    idx = torch.tensor([prompt], dtype=torch.long)
    gen = torch.Generator().manual_seed(args.seed)
    out = model.generate(idx, args.tokens, temperature=args.temperature, top_k=args.top_k, generator=gen)
    ids = out[0].tolist()
    if cfg.data.tokenizer or max(ids) < 256:
        print(tokenizer.decode(ids))
    else:
        print(ids)
    return 0


def cmd_plan(argv: list[str]) -> int:
    """``plait plan memory ...`` (predicted per-rank memory) or ``plait plan CONFIG --hardware P --gpus N``
    (ranked layouts); both in ``plait.plan.commands``."""
    from plait.plan import commands

    if argv and argv[0] == "memory":
        return commands.cmd_plan_memory(argv[1:])
    return commands.cmd_plan(argv)


def cmd_simulate(argv: list[str]) -> int:
    from plait.plan.commands import cmd_simulate as simulate

    return simulate(argv)


def cmd_calibrate(argv: list[str]) -> int:
    from plait.plan.commands import cmd_calibrate as calibrate

    return calibrate(argv)


def cfg_world(config_path: str | None, overrides: list[str]) -> int:
    """The world size a config asks for: parallel.nproc workers."""
    from plait.recipes import load_recipe_config

    return load_recipe_config(config_path, overrides).parallel.nproc


def cmd_report(argv: list[str]) -> int:
    """``plait report RUN_DIR [RUN_DIR ...] [-o report.html]``: see ``plait.observe.report``."""
    from plait.observe.report import cli_report

    return cli_report(argv)


def cmd_launch(argv: list[str]) -> int:
    """``plait launch slurm|k8s CONFIG --nodes N --gpus-per-node G ...``: see ``plait.launch_files``."""
    from plait.launch_files import cli_launch

    return cli_launch(argv)


def cmd_checkpoint(argv: list[str]) -> int:
    """``plait checkpoint verify RUN_DIR|CHECKPOINT``: every checkpoint checked against its SHA-256 manifest;
    exit 0 when all are whole, 1 when one is damaged (each problem printed)."""
    from plait.checkpoint.integrity import checkpoints_newest_first, verify

    if len(argv) != 2 or argv[0] != "verify":
        raise ConfigError("usage: plait checkpoint verify RUN_DIR (or the path of one checkpoint)")
    target = Path(argv[1])
    paths = [target] if (target / "meta.json").is_file() or (target / ".metadata").is_file() else \
        checkpoints_newest_first(target)
    if not paths:
        raise ConfigError(f"{target} holds no checkpoints (no {target}/checkpoints/step_*)")
    damaged = 0
    for path in paths:
        problems = verify(path)
        damaged += bool(problems)
        print(f"{path}: " + ("ok" if not problems else "DAMAGED\n  " + "\n  ".join(problems)))
    return 1 if damaged else 0


COMMANDS = {"train": cmd_train, "run": cmd_run, "sample": cmd_sample, "plan": cmd_plan, "report": cmd_report,
            "launch": cmd_launch, "checkpoint": cmd_checkpoint, "simulate": cmd_simulate, "calibrate": cmd_calibrate}


def _run_dir_of(argv: list[str]) -> str:
    """The run directory of a ``plait train`` command line (for the resume hint)."""
    try:
        config_path, resume, overrides = split_train_args(argv[1:])
        return resume or load_config(config_path, overrides).run.dir or "RUN_DIR"
    except ConfigError:
        return "RUN_DIR"


# What each command's --help prints: its usage and what it does; the commands that read a config
# (KEYED) list every config key after it, since they take --section.key=value.
USAGE = {
    "train": ("plait train [CONFIG.toml] [--section.key=value ...] [--resume RUN_DIR] [--nnodes MIN:MAX "
              "--rdzv-endpoint HOST:PORT --rdzv-id ID [--rdzv-conf KEY=N,...] [--local-addr ADDRESS]]",
              "Train a registered model (or model.factory) with the layout the config chooses; parallel.nproc "
              "local workers, or the world of torchrun / SLURM. --resume continues a run from its newest good "
              "checkpoint. On several machines, run the same command on each with --nnodes MIN:MAX and the "
              "rendezvous of the machine HOST, which must stay (parallel.nproc workers each, one shared run "
              "directory): a machine that is lost makes the others go on without it from the newest complete "
              "checkpoint (a restart: up to fault.max_restarts); one that joins later runs the same command with "
              "--resume RUN_DIR, and the running workers save at the step boundary before all go on at the "
              "larger world size. --rdzv-conf last_call_timeout=N,keep_alive_interval=N,keep_alive_max_attempt=N "
              "tunes the rendezvous; --local-addr ADDRESS is the address the other machines reach this one at "
              "(default: its host name's; fault.memory_checkpoint's holder listens there too, by default on the "
              "address facing the rendezvous host) (docs/clusters.md)."),
    "run": ("plait run [--nproc N] [--max-restarts R] SCRIPT [ARGS ...]",
            "Run your own script (plait.Plait or the Trainer) in N local worker processes under PyTorch's "
            "elastic agent, with RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT set as torchrun sets them.\n\n"
            "  --nproc N           worker processes (default 1); also --nproc-per-node\n"
            "  --max-restarts R    start the whole group again up to R times after a failure (default 0); "
            "PLAIT_ATTEMPT tells the script which attempt it is\n"
            "  --nnodes MIN:MAX --rdzv-endpoint HOST:PORT --rdzv-id ID   several machines, N workers each, meeting "
            "at HOST's rendezvous; a machine leaving or joining restarts the group: the script resumes from its "
            "newest checkpoint whenever one exists (TORCHELASTIC_RESTART_COUNT counts only failures, and each "
            "machine its own)\n"
            "  --replicas G [--lighthouse URL]   fault.mode=replicas: G torchft replica groups of N workers each, "
            "each under its own agent (a group of several is data-parallel or sharded inside as the script's config "
            "says; docs/fault-tolerance.md)\n\n"
            "A failed worker ends the run with one line naming its rank, its error and the file holding the "
            "traceback: RUN_DIR/errors/rank<r>.txt once the script has created plait.Plait (RUN_DIR is its "
            "run.dir), else a plait-run-* directory under the temporary directory. Options after SCRIPT go to "
            "the script (plait run SCRIPT --help shows the script's)."),
    "sample": ("plait sample RUN_DIR --prompt TEXT [--tokens N] [--temperature T] [--top-k K] [--seed S]",
               "Generate text from the weights a plait train run of plait's GPT exported."),
    "plan": ("plait plan memory [CONFIG.toml] [--run-dir RUN_DIR] [--section.key=value ...]\n"
             "       plait plan [CONFIG.toml] --hardware PROFILE --gpus N [--top K] [--write OUT.toml] [--table] "
             "[--section.key=value ...]\n"
             "       plait plan --hardware PROFILE --gpus N --jobs JOBS.toml",
             "plan memory: the predicted per-rank memory of a config, without launching (--run-dir: MoE experts "
             "priced at that run's measured routing imbalance). plan: layouts for N "
             "GPUs ranked by simulated step time (--table: the layout a queue's N GPUs should run). --jobs: "
             "several jobs with priorities sharing a pool of N GPUs: each job's GPUs and layout."),
    "simulate": ("plait simulate [CONFIG.toml] --hardware PROFILE [--nodes N --gpus-per-node G] "
                 "[--compare RUN_DIR] [--trace PATH] [--section.key=value ...]",
                 "Predict one training step of a config on a cluster (JSON on stdout)."),
    "calibrate": ("plait calibrate [--out PATH] [--quick]",
                  "Measure this machine into a hardware profile (--hardware local)."),
    "checkpoint": ("plait checkpoint verify RUN_DIR",
                   "Check every checkpoint of a run (or one checkpoint directory) against its SHA-256 manifest; "
                   "exit 1 when one is damaged."),
    "report": ("plait report RUN_DIR [RUN_DIR ...] [-o report.html]",
               "An HTML report of one or more runs: plots and a bottleneck verdict."),
    "launch": ("plait launch slurm CONFIG --nodes N|MIN:MAX --gpus-per-node G [--procs-per-node P] [--qos Q] "
               "[--account A] [--partition P] [--time T] [--array=OVERRIDES ...] [--grace-from RUN_DIR]\n"
               "       plait launch k8s CONFIG --nodes N|MIN:MAX --gpus-per-node G --image IMAGE [--pvc CLAIM] "
               "[--namespace NS] [--queue Q] [--priority-class C] [--api trainjob|pytorchjob]",
               "Write an sbatch script (requeued after a preemption, SLURM's warning --signal=B:USR1@<grace>) or a "
               "Kubeflow TrainJob / PyTorchJob manifest (Kueue's queue and priority labels) for a config, checked "
               "for every world size the job can have."),
}
KEYED = {"train", "plan", "simulate", "launch"}


def keys_text() -> str:
    """Every config key; a registered model's own default follows plait's (``plait.recipes.defaults_by_key``)."""
    from plait.recipes import defaults_by_key

    return ("Config keys (a TOML file's [section] key = value, or --section.key=value; tables such as "
            "[model.args] take --model.args.name=value; a registered model's own default follows plait's, as in "
            "'recipe gpt: 1.0', and applies where the config does not set the key):\n\n"
            + describe_keys(defaults_by_key()))


def help_text(command: str | None = None) -> str:
    """``plait --help``: the commands, then every config key with its type, default and documentation.
    ``plait COMMAND --help``: that command's usage (and the config keys for commands that take them)."""
    if command is None:
        return __doc__.strip() + "\n\n" + keys_text()
    usage, what = USAGE[command]
    text = f"usage: {usage}\n\n{what}"
    return text + ("\n\n" + keys_text() if command in KEYED else "")


def _asks_help(argv: list[str]) -> bool:
    """Whether a command line asks for its command's help: ``-h``/``--help`` anywhere for most commands; for
    ``plait run`` only before the script (after it, the option is the script's)."""
    if argv[0] != "run":
        return any(a in ("-h", "--help") for a in argv[1:])
    i = 1
    while i < len(argv) and argv[i].startswith("-"):  # run's own options, each with a value, then SCRIPT
        if argv[i] in ("-h", "--help"):
            return True
        i += 1 if "=" in argv[i] else 2
    return False


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the process exit code."""
    from plait.launch import NoProgress, RunPreempted, WorkerFailed

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"plait: error: unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
            return 2
        print(help_text())
        return 0
    if _asks_help(argv):
        print(help_text(argv[0]))
        return 0
    from plait.fault.preempt import CONFIG_EXIT, FAILED_EXIT, NO_PROGRESS_EXIT, PREEMPTED_EXIT, Preempted

    try:
        return COMMANDS[argv[0]](argv[1:])
    except ConfigError as e:
        print(f"plait: error: {e}", file=sys.stderr)
        return CONFIG_EXIT
    except NoProgress as e:
        print(f"plait: error: {e}", file=sys.stderr)
        return NO_PROGRESS_EXIT
    except WorkerFailed as e:
        print(f"plait: error: {e}", file=sys.stderr)
        return FAILED_EXIT
    except (RunPreempted, Preempted) as e:
        where = f" ({e})" if str(e) else ""
        resume = f"; resume with: plait train --resume {_run_dir_of(argv)}" if argv[0] == "train" else ""
        print(f"plait: preempted{where}{resume}", file=sys.stderr)
        return PREEMPTED_EXIT
    except KeyboardInterrupt:
        print("plait: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
