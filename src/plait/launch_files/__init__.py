"""``plait launch slurm|k8s CONFIG --nodes N --gpus-per-node G ...``: the file that starts a run on a cluster.

SLURM (``plait.launch_files.slurm``): an sbatch script that runs ``srun`` with one task per worker process (one
per GPU; with ``--gpus-per-node 0``, ``--procs-per-node`` CPU processes). Chosen over one ``torchrun`` per node
because SLURM then starts, binds, accounts and signals every process itself (``scancel`` reaches each one,
``--kill-on-bad-exit`` ends the step when one fails) and plait needs no second launcher between SLURM and itself:
it reads ``SLURM_PROCID`` / ``SLURM_NTASKS`` / ``SLURM_LOCALID`` directly (``plait.runtime.dist.adopt_slurm_env``).
The rendezvous is rank 0's TCP store on the allocation's first node. On a shared cluster the script asks for
``--requeue`` and ``--signal=B:USR1@<grace>``, and requeues itself after every rank saved.

Kubernetes (``plait.launch_files.k8s``): a Kubeflow Trainer v2 ``TrainJob`` (or a training operator
``PyTorchJob``), one pod per node, each running plait's launcher; Kueue's queue and priority labels; the config
in a ConfigMap in the same file.

Restarts follow ``fault.max_restarts``: the sbatch script reruns the step from the newest checkpoint up to that
many times, the PyTorchJob restarts failed pods likewise. A restarted run continues with ``plait train --resume
RUN_DIR`` when the run directory holds a checkpoint, which needs the run directory on storage every node shares
(a shared file system under SLURM; ``--pvc`` under Kubernetes). A configuration error (exit 2) is not retried; a
preemption (exit 75: every rank saved) is requeued. The grace between a scheduler's warning and its kill is sized
from the run's own step and save times (``plait.launch_files.shape.grace``).
"""

from __future__ import annotations

import copy
import re
import shlex
import sys
from pathlib import Path

from plait.config import Config, ConfigError
from plait.launch_files.k8s import K8S_PORT, K8sJob, k8s_manifest
from plait.launch_files.shape import Cluster, SlurmJob, cluster, grace
from plait.launch_files.slurm import slurm_script
from plait.launch_files.yaml_out import to_yaml

__all__ = ["K8S_PORT", "Cluster", "K8sJob", "SlurmJob", "cli_launch", "cluster", "grace", "k8s_manifest",
           "slurm_script", "to_yaml"]


def max_restarts_of(cfg: Config) -> int:
    """``fault.max_restarts`` of the config, 0 where the config has no ``[fault]`` section (yet)."""
    return int(getattr(getattr(cfg, "fault", None), "max_restarts", 0) or 0)


def job_name(config_path: str | Path) -> str:
    """A name both schedulers accept (Kubernetes: lower-case letters, digits and '-', at most 40 here so
    that pod and service names built from it stay under 63)."""
    stem = re.sub(r"[^a-z0-9-]+", "-", Path(config_path).stem.lower()).strip("-")
    return f"plait-{stem}"[:40].rstrip("-") if stem else "plait"


def checked_config(config_path: str | Path, overrides: list[str], c: Cluster) -> Config:
    """The config with overrides, validated here rather than on the cluster for every world size the job can
    have (each node count of an elastic range)."""
    from plait.recipes import load_recipe_config
    from plait.recipes import validate_config as validate

    cfg = load_recipe_config(config_path, overrides)
    for n in c.node_counts():
        try:  # the file keeps inferred values open (parallel.dp=0), as a run does
            validate(copy.deepcopy(cfg), n * c.procs_per_node)
        except ConfigError as e:
            if not c.elastic:
                raise
            raise ConfigError(f"at {n} node(s) (world size {n * c.procs_per_node}) of --nodes "
                              f"{c.min_nodes}:{c.nodes}: {e}") from None
    return cfg


def _split_overrides(rest: list[str]) -> list[str]:
    """``--section.key=value`` (or ``--section.key value``) arguments argparse did not know."""
    out, i = [], 0
    while i < len(rest):
        a = rest[i]
        if not (a.startswith("--") and "." in a.split("=", 1)[0]):
            raise ConfigError(f"unknown argument {a!r} for plait launch; config changes look like --section.key=value")
        if "=" not in a:
            if i + 1 >= len(rest):
                raise ConfigError(f"{a} needs a value: {a}=VALUE")
            a, i = f"{a}={rest[i + 1]}", i + 1
        out.append(a)
        i += 1
    return out


def _parser() -> object:
    import argparse

    ap = argparse.ArgumentParser(prog="plait launch", description="Write the file that starts a run on a cluster.")
    ap.add_argument("kind", choices=["slurm", "k8s"])
    ap.add_argument("config", metavar="CONFIG")
    ap.add_argument("--nodes", required=True, help="N, or MIN:MAX for an elastic range")
    ap.add_argument("--gpus-per-node", type=int, required=True, help="0: CPU processes (see --procs-per-node)")
    ap.add_argument("--procs-per-node", type=int, default=None, help="CPU processes per node with --gpus-per-node 0")
    ap.add_argument("-o", "--output", default=None)
    ap.add_argument("--grace-from", default=None, metavar="RUN_DIR",
                    help="size the warning-to-kill grace from this run's step and save times (default: run.dir)")
    for key, what in (("partition", "slurm: partition"), ("qos", "slurm: quality of service"),
                      ("account", "slurm: account"), ("queue", "k8s: Kueue LocalQueue"),
                      ("priority-class", "k8s: Kueue WorkloadPriorityClass")):
        ap.add_argument(f"--{key}", default=None, help=f"{what} (launch.{key.replace('-', '_')})")
    ap.add_argument("--array", action="append", default=None, metavar="OVERRIDES",
                    help="slurm: one array task with these config changes; repeat per task (launch.array)")
    ap.add_argument("--time", default=None, help="slurm: time limit, e.g. 02:00:00")
    ap.add_argument("--cpus-per-task", type=int, default=None, help="slurm: CPU cores per process")
    ap.add_argument("--python", default=sys.executable, help="slurm: the interpreter the nodes run plait with")
    ap.add_argument("--image", default=None, help="k8s: container image with plait installed")
    ap.add_argument("--api", choices=["trainjob", "pytorchjob"], default=None, help="k8s: launch.api")
    ap.add_argument("--namespace", default="default", help="k8s: namespace")
    ap.add_argument("--pvc", default=None, help="k8s: PersistentVolumeClaim for the run directory (shared storage)")
    ap.add_argument("--cpus", default=None, help="k8s: CPU request and limit per pod")
    ap.add_argument("--memory", default=None, help="k8s: memory request and limit per pod, e.g. 64Gi")
    return ap


def cli_launch(argv: list[str]) -> int:
    """``plait launch slurm|k8s CONFIG --nodes N --gpus-per-node G ...``: write the file, say how to submit it."""
    args, rest = _parser().parse_known_args(argv)  # type: ignore[attr-defined]
    overrides = _split_overrides(rest)
    flags = {"partition": args.partition, "qos": args.qos, "account": args.account, "queue": args.queue,
             "priority_class": args.priority_class, "api": args.api}
    overrides += [f"--launch.{k}={v}" for k, v in flags.items() if v is not None]
    c = cluster(args.nodes, args.gpus_per_node, args.procs_per_node)
    cfg = checked_config(args.config, overrides, c)
    launch, name, restarts = cfg.launch, job_name(args.config), max_restarts_of(cfg)
    grace_s, why = grace(launch.grace_s, args.grace_from or cfg.run.dir or None)
    if args.kind == "slurm":
        array = [shlex.split(entry) for entry in (args.array or launch.array)]
        for words in array:  # every task's config is checked before anything is submitted
            checked_config(args.config, overrides + _split_overrides(words), c)
        job = SlurmJob(name, restarts, grace_s, why, launch.partition, launch.qos, launch.account, args.time or "",
                       args.cpus_per_task, array)
        text = slurm_script(args.config, overrides, c, job, python=args.python)
        path = Path(args.output or f"{name}.sbatch")
        runs = f"runs/{name}-<array job id>/task-<i>" if array else f"runs/{name}-<job id>"
        how = [f"submit it:     sbatch {path}", "watch it:      squeue --me; output in <job name>-<job id>.out",
               f"run directory: {runs} (PLAIT_RUN_DIR overrides it; a shared file system)",
               f"grace:         {grace_s} s between SLURM's warning and its kill ({why})"]
    else:
        if not args.image:
            raise ConfigError("plait launch k8s needs --image IMAGE: a container image with plait installed")
        job = K8sJob(name, args.image, restarts, grace_s, args.namespace, args.pvc, args.cpus, args.memory,
                     launch.api, launch.runtime, launch.queue, launch.priority_class, launch.priority)
        text = k8s_manifest(cfg, c, job)
        path = Path(args.output or f"{name}-{launch.api}.yaml")
        first = f"{name}-node-0-0" if launch.api == "trainjob" else f"{name}-{'worker' if c.elastic else 'master'}-0"
        how = [f"submit it:     kubectl apply -f {path}", f"watch it:      kubectl get {launch.api} {name} -n "
               f"{args.namespace}; kubectl logs -f <pod {first}...> -n {args.namespace}",
               f"run directory: /runs/{name} in the pods" + (f" (claim {args.pvc})" if args.pvc else
                                                             " (pod-local: pass --pvc CLAIM to keep it and resume)"),
               f"grace:         terminationGracePeriodSeconds {grace_s} ({why})"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if c.elastic:
        shape = (f"{c.min_nodes} to {c.nodes} node(s) x {c.procs_per_node} process(es) = world size "
                 f"{c.min_nodes * c.procs_per_node} to {c.world_size}")
    else:
        shape = f"{c.nodes} node(s) x {c.procs_per_node} process(es) = world size {c.world_size}"
    print("\n".join([f"plait: wrote {path} ({shape}; restarts: {restarts})", *[f"  {h}" for h in how]]))
    return 0
