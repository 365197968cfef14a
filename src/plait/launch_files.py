"""``plait launch slurm|k8s CONFIG --nodes N --gpus-per-node G ...``: the file that starts a run on a cluster.

SLURM: an sbatch script that runs ``srun`` with one task per worker process (one per GPU; with
``--gpus-per-node 0``, ``--procs-per-node`` CPU processes). Chosen over one ``torchrun`` per node
because SLURM then starts, binds, accounts and signals every process itself (``scancel`` reaches each
one, ``--kill-on-bad-exit`` ends the step when one fails) and plait needs no second launcher between
SLURM and itself: it reads ``SLURM_PROCID`` / ``SLURM_NTASKS`` / ``SLURM_LOCALID`` directly
(``plait.runtime.dist.adopt_slurm_env``). The rendezvous is rank 0's TCP store on the allocation's first node,
``MASTER_ADDR`` / ``MASTER_PORT``, which the script derives from the allocation and exports to every task.

Kubernetes: a Kubeflow ``PyTorchJob`` (training-operator >= 1.7) with a Master and N-1 Workers, one pod
per node. Each pod runs ``torchrun`` for its GPUs (the operator gives every pod ``MASTER_ADDR``,
``MASTER_PORT`` and its node index as ``RANK``; torchrun turns them into per-process ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` for plait). The config travels in a ConfigMap in the same file.

Restarts follow ``fault.max_restarts`` (0 when the config has no such setting): the sbatch script reruns
the step from the newest checkpoint up to that many times, and the PyTorchJob restarts failed pods
(``restartPolicy: OnFailure``, ``backoffLimit``) likewise, or never at 0. A restarted run continues with
``plait train --resume RUN_DIR`` when the run directory holds a checkpoint, which needs the run directory
on storage every node shares (a shared file system under SLURM; ``--pvc`` under Kubernetes). Neither a
configuration error (exit 2) nor a preemption (exit 75: every rank saved; with ``--time`` SLURM sends the
SIGTERM two minutes before the limit) is retried in the same allocation.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.config import Config, ConfigError, to_toml

K8S_PORT = 23456  # the training operator's default port for the master service


@dataclass(frozen=True)
class Cluster:
    """The shape of the job: ``nodes`` x ``procs_per_node`` worker processes, ``gpus_per_node`` GPUs each
    node (one process per GPU; 0 for CPU processes)."""

    nodes: int
    gpus_per_node: int
    procs_per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


def cluster(nodes: int, gpus_per_node: int, procs_per_node: int | None) -> Cluster:
    """Check the shape: a process per GPU, or ``procs_per_node`` CPU processes without GPUs."""
    if nodes < 1:
        raise ConfigError(f"--nodes must be at least 1; got {nodes}")
    if gpus_per_node < 0:
        raise ConfigError(f"--gpus-per-node must be 0 (CPU processes) or more; got {gpus_per_node}")
    if gpus_per_node > 0:
        if procs_per_node not in (None, gpus_per_node):
            raise ConfigError(f"plait runs one process per GPU: --procs-per-node {procs_per_node} does not match "
                              f"--gpus-per-node {gpus_per_node}; leave --procs-per-node out")
        return Cluster(nodes, gpus_per_node, gpus_per_node)
    procs = 1 if procs_per_node is None else procs_per_node
    if procs < 1:
        raise ConfigError(f"--procs-per-node must be at least 1; got {procs}")
    return Cluster(nodes, 0, procs)


def max_restarts_of(cfg: Config) -> int:
    """``fault.max_restarts`` of the config, 0 where the config has no ``[fault]`` section (yet)."""
    return int(getattr(getattr(cfg, "fault", None), "max_restarts", 0) or 0)


def job_name(config_path: str | Path) -> str:
    """A name both schedulers accept (Kubernetes: lower-case letters, digits and '-', at most 40 here so
    that pod and service names built from it stay under 63)."""
    stem = re.sub(r"[^a-z0-9-]+", "-", Path(config_path).stem.lower()).strip("-")
    return f"plait-{stem}"[:40].rstrip("-") if stem else "plait"


def checked_config(config_path: str | Path, overrides: list[str], world_size: int) -> Config:
    """The config with overrides, validated for the job's world size here rather than on the cluster."""
    from plait.recipes import load_recipe_config
    from plait.recipes import validate_config as validate

    cfg = load_recipe_config(config_path, overrides)
    validate(copy.deepcopy(cfg), world_size)  # the file keeps inferred values open (parallel.dp=0), as a run does
    return cfg


def _sbatch_header(c: Cluster, name: str, workdir: Path, partition: str | None, time_limit: str | None,
                   cpus_per_task: int | None) -> list[str]:
    """The ``#SBATCH`` lines of the script."""
    head = [f"#SBATCH --job-name={name}", f"#SBATCH --nodes={c.nodes}", f"#SBATCH --ntasks-per-node={c.procs_per_node}",
            f"#SBATCH --chdir={workdir}", "#SBATCH --output=%x-%j.out"]
    if c.gpus_per_node:
        head.append(f"#SBATCH --gres=gpu:{c.gpus_per_node}")
    if cpus_per_task:
        head.append(f"#SBATCH --cpus-per-task={cpus_per_task}")
    if partition:
        head.append(f"#SBATCH --partition={partition}")
    if time_limit:
        # SIGTERM to every task 2 minutes before the limit: plait saves at the next step boundary and exits 75.
        head += [f"#SBATCH --time={time_limit}", "#SBATCH --signal=TERM@120"]
    return head


def slurm_script(config_path: str | Path, overrides: list[str], c: Cluster, *, name: str, max_restarts: int,
                 partition: str | None = None, time_limit: str | None = None, cpus_per_task: int | None = None,
                 python: str = sys.executable, workdir: str | Path | None = None) -> str:
    """The sbatch script (see the module docstring); ``python`` is the interpreter the nodes run plait with."""
    workdir = Path(workdir or Path.cwd()).resolve()
    config = Path(config_path).resolve()
    head = _sbatch_header(c, name, workdir, partition, time_limit, cpus_per_task)
    srun = ["srun", "--kill-on-bad-exit=1"] + ([f"--cpus-per-task={cpus_per_task}"] if cpus_per_task else [])
    new_run = " ".join(['"$CONFIG"', '--run.dir="$RUN_DIR"', *map(shlex.quote, overrides)])
    return f"""#!/bin/bash
# plait on SLURM: {c.nodes} node(s) x {c.procs_per_node} process(es) = world size {c.world_size}
# ({f"{c.gpus_per_node} GPU(s) per node, one process each" if c.gpus_per_node else "CPU processes"}).
# Written by `plait launch slurm` on {time.strftime("%Y-%m-%d %H:%M")}. Submit with: sbatch <this file>
{chr(10).join(head)}
set -uo pipefail

CONFIG={shlex.quote(str(config))}
PYTHON={shlex.quote(python)}
# The run directory must be on a file system every node shares (checkpoints are written by every rank).
RUN_DIR="${{PLAIT_RUN_DIR:-runs/{name}-$SLURM_JOB_ID}}"
MAX_RESTARTS={max_restarts}  # fault.max_restarts: rerun the step from the newest checkpoint this many times

# Rendezvous: rank 0 (first task of the first node) hosts the process group's TCP store; plait reads
# SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID for rank, world size and local device.
export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
export MASTER_PORT="${{PLAIT_MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}}"
export OMP_NUM_THREADS="${{SLURM_CPUS_PER_TASK:-1}}"
export PYTHONUNBUFFERED=1

attempt=0
while true; do
  if [ -e "$RUN_DIR/checkpoints/latest" ]; then
    set -- --resume "$RUN_DIR"
  else
    set -- {new_run}
  fi
  status=0
  {" ".join(srun)} "$PYTHON" -m plait.cli train "$@" || status=$?
  if [ "$status" -eq 0 ]; then
    echo "plait: done; report: $PYTHON -m plait.cli report $RUN_DIR"
    exit 0
  fi
  if [ "$status" -eq 2 ]; then  # a configuration error: running it again would fail the same way
    exit 2
  fi
  if [ "$status" -eq 75 ]; then  # preempted (SIGTERM): every rank saved; continue in a new allocation
    echo "plait: preempted; saved in $RUN_DIR. Continue with: PLAIT_RUN_DIR=$RUN_DIR sbatch <this file>" >&2
    exit 75
  fi
  attempt=$((attempt + 1))
  if [ "$attempt" -gt "$MAX_RESTARTS" ]; then
    echo "plait: the run failed (exit $status) after $MAX_RESTARTS restart(s); errors in $RUN_DIR/errors" >&2
    exit "$status"
  fi
  echo "plait: the run failed (exit $status); restart $attempt of $MAX_RESTARTS from the newest checkpoint" >&2
done
"""


_PLAIN = re.compile(r"^[A-Za-z/][A-Za-z0-9_./-]*$")
_YAML_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null"}  # read as booleans or null unquoted


def _yaml_scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    text = str(v)
    if _PLAIN.match(text) and text.lower() not in _YAML_WORDS:
        return text
    return json.dumps(text)  # a JSON string is a valid YAML double-quoted scalar


def to_yaml(obj: dict[str, Any] | list[Any], indent: int = 0) -> str:
    """Block YAML for nested dicts, lists and scalars; multi-line strings (the config file) as literal blocks."""
    pad = " " * indent
    if isinstance(obj, dict):
        return "\n".join(_yaml_entry(f"{pad}{key}:", value, indent) for key, value in obj.items())
    lines = []
    for value in obj:
        if isinstance(value, dict) and value:  # a mapping in a list starts on the dash's line
            lines.append(f"{pad}- " + to_yaml(value, indent + 2)[indent + 2:])
        else:
            lines.append(_yaml_entry(f"{pad}-", value, indent))
    return "\n".join(lines)


def _yaml_entry(lead: str, value: Any, indent: int) -> str:
    if isinstance(value, str) and "\n" in value:
        body = "\n".join(" " * (indent + 2) + line if line else "" for line in value.rstrip("\n").split("\n"))
        return f"{lead} |\n{body}"
    if isinstance(value, dict | list):
        empty = "{}" if isinstance(value, dict) else "[]"
        return f"{lead}\n{to_yaml(value, indent + 2)}" if value else f"{lead} {empty}"
    return f"{lead} {_yaml_scalar(value)}"


def _pod(c: Cluster, image: str, name: str, run_dir: str, pvc: str | None, cpus: str | None,
         memory: str | None) -> dict[str, Any]:
    """The pod template every replica shares: the container named ``pytorch`` (the operator looks for it)."""
    script = ('if [ -e "$PLAIT_RUN_DIR/checkpoints/latest" ]; then set -- --resume "$PLAIT_RUN_DIR"; '
              'else set -- /etc/plait/config.toml --run.dir="$PLAIT_RUN_DIR"; fi; '
              f"exec python -m torch.distributed.run --nnodes={c.nodes} "
              '--nproc-per-node="$PLAIT_NPROC_PER_NODE" --node-rank="$RANK" --master-addr="$MASTER_ADDR" '
              '--master-port="$MASTER_PORT" -m plait.cli train "$@"')
    resources: dict[str, Any] = {}
    if c.gpus_per_node:
        resources["nvidia.com/gpu"] = c.gpus_per_node
    resources["cpu"] = cpus or str(c.procs_per_node)
    if memory:
        resources["memory"] = memory
    env = [{"name": "PLAIT_RUN_DIR", "value": run_dir},
           {"name": "PLAIT_NPROC_PER_NODE", "value": str(c.procs_per_node)},
           {"name": "PLAIT_ERROR_DIR", "value": "$(PLAIT_RUN_DIR)/errors"},
           {"name": "OMP_NUM_THREADS", "value": "1" if c.gpus_per_node else str(max(1, int(float(
               cpus or c.procs_per_node)) // c.procs_per_node))},
           {"name": "PYTHONUNBUFFERED", "value": "1"}]
    runs_volume = {"persistentVolumeClaim": {"claimName": pvc}} if pvc else {"emptyDir": {}}
    return {"spec": {
        "containers": [{
            "name": "pytorch", "image": image, "command": ["/bin/sh", "-c", script], "env": env,
            "ports": [{"name": "pytorchjob-port", "containerPort": K8S_PORT}],
            "resources": {"requests": dict(resources), "limits": dict(resources)},
            "volumeMounts": [{"name": "config", "mountPath": "/etc/plait", "readOnly": True},
                             {"name": "runs", "mountPath": "/runs"}, {"name": "dshm", "mountPath": "/dev/shm"}],
        }],
        # Data-loader workers and NCCL use shared memory; a container's default /dev/shm is 64 MiB.
        "volumes": [{"name": "config", "configMap": {"name": f"{name}-config"}}, {"name": "runs", **runs_volume},
                    {"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    }}


def k8s_manifest(cfg: Config, c: Cluster, *, name: str, image: str, max_restarts: int, namespace: str = "default",
                 pvc: str | None = None, cpus: str | None = None, memory: str | None = None) -> str:
    """A ConfigMap with the resolved config and the PyTorchJob, as one multi-document YAML file."""
    run_dir = f"/runs/{name}"
    restart = "OnFailure" if max_restarts > 0 else "Never"
    template = _pod(c, image, name, run_dir, pvc, cpus, memory)
    replicas = {"Master": {"replicas": 1, "restartPolicy": restart, "template": template}}
    if c.nodes > 1:
        replicas["Worker"] = {"replicas": c.nodes - 1, "restartPolicy": restart, "template": template}
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-config",
                                                                         "namespace": namespace},
                  "data": {"config.toml": to_toml(cfg)}}
    job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
           "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/created-by": "plait"}},
           "spec": {"nprocPerNode": str(c.procs_per_node),
                    "runPolicy": {"backoffLimit": max_restarts, "cleanPodPolicy": "Running"},
                    "pytorchReplicaSpecs": replicas}}
    head = (f"# plait on Kubernetes: {c.nodes} pod(s) x {c.procs_per_node} process(es) = world size "
            f"{c.world_size}. Written by `plait launch k8s` on {time.strftime('%Y-%m-%d %H:%M')}.\n"
            "# Needs the Kubeflow training operator (>= 1.7). Submit with: kubectl apply -f <this file>\n")
    return head + "---\n" + to_yaml(config_map) + "\n---\n" + to_yaml(job) + "\n"


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


def cli_launch(argv: list[str]) -> int:
    """``plait launch slurm|k8s CONFIG --nodes N --gpus-per-node G ...``: write the file, say how to submit it."""
    import argparse

    ap = argparse.ArgumentParser(prog="plait launch", description="Write the file that starts a run on a cluster.")
    ap.add_argument("kind", choices=["slurm", "k8s"])
    ap.add_argument("config", metavar="CONFIG")
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--gpus-per-node", type=int, required=True, help="0: CPU processes (see --procs-per-node)")
    ap.add_argument("--procs-per-node", type=int, default=None, help="CPU processes per node with --gpus-per-node 0")
    ap.add_argument("-o", "--output", default=None)
    ap.add_argument("--partition", default=None, help="slurm: partition")
    ap.add_argument("--time", default=None, help="slurm: time limit, e.g. 02:00:00")
    ap.add_argument("--cpus-per-task", type=int, default=None, help="slurm: CPU cores per process")
    ap.add_argument("--python", default=sys.executable, help="slurm: the interpreter the nodes run plait with")
    ap.add_argument("--image", default=None, help="k8s: container image with plait installed")
    ap.add_argument("--namespace", default="default", help="k8s: namespace")
    ap.add_argument("--pvc", default=None, help="k8s: PersistentVolumeClaim for the run directory (shared storage)")
    ap.add_argument("--cpus", default=None, help="k8s: CPU request and limit per pod")
    ap.add_argument("--memory", default=None, help="k8s: memory request and limit per pod, e.g. 64Gi")
    args, rest = ap.parse_known_args(argv)
    overrides = _split_overrides(rest)
    c = cluster(args.nodes, args.gpus_per_node, args.procs_per_node)
    cfg = checked_config(args.config, overrides, c.world_size)
    name, restarts = job_name(args.config), max_restarts_of(cfg)
    if args.kind == "slurm":
        text = slurm_script(args.config, overrides, c, name=name, max_restarts=restarts, partition=args.partition,
                            time_limit=args.time, cpus_per_task=args.cpus_per_task, python=args.python)
        path = Path(args.output or f"{name}.sbatch")
        how = [f"submit it:     sbatch {path}", "watch it:      squeue --me; output in <job name>-<job id>.out",
               f"run directory: runs/{name}-<job id> (PLAIT_RUN_DIR overrides it; a shared file system)"]
    else:
        if not args.image:
            raise ConfigError("plait launch k8s needs --image IMAGE: a container image with plait installed")
        text = k8s_manifest(cfg, c, name=name, image=args.image, max_restarts=restarts, namespace=args.namespace,
                            pvc=args.pvc, cpus=args.cpus, memory=args.memory)
        path = Path(args.output or f"{name}-pytorchjob.yaml")
        how = [f"submit it:     kubectl apply -f {path}", f"watch it:      kubectl get pytorchjob {name} -n "
               f"{args.namespace}; kubectl logs -f {name}-master-0 -n {args.namespace}",
               f"run directory: /runs/{name} in the pods" + (f" (claim {args.pvc})" if args.pvc else
                                                             " (pod-local: pass --pvc CLAIM to keep it and resume)")]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    shape = f"{c.nodes} node(s) x {c.procs_per_node} process(es) = world size {c.world_size}"
    print("\n".join([f"plait: wrote {path} ({shape}; restarts: {restarts})", *[f"  {h}" for h in how]]))
    return 0
