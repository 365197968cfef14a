"""The Kubernetes manifest of ``plait launch k8s``: a ConfigMap with the config, then a Kubeflow Trainer v2
``TrainJob`` (the default) or a training operator ``PyTorchJob`` (v1), and, when asked, Kueue's
``WorkloadPriorityClass``.

Every pod runs plait's own launcher (``plait train --nnodes ... --rdzv-endpoint ...``: PyTorch's elastic agent
and its c10d rendezvous, hosted by the first pod), so that a SIGTERM gives the workers the whole
``terminationGracePeriodSeconds`` to save rather than torchrun's fixed 30 s. Kueue admits the job by its queue
label and priority class, and preempts it by suspending it: the pods get SIGTERM, every rank saves at the next
step boundary, and the re-admitted job resumes from the run directory's newest checkpoint (shared storage:
``--pvc``). TrainJob (Trainer 2.3's API) has a fixed ``numNodes``; an elastic node range needs the PyTorchJob's
``elasticPolicy``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from plait.config import Config, ConfigError, to_toml
from plait.launch_files.shape import Cluster
from plait.launch_files.yaml_out import to_yaml

K8S_PORT = 23456  # the training operator's default port for the master service
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
TRAINER_CONTAINER = "node"  # the container and replicated job of Trainer's torch runtimes


@dataclass
class K8sJob:
    """The settings of one manifest besides its shape (``[launch]`` and the command line's flags)."""

    name: str
    image: str
    max_restarts: int = 0
    grace_s: int = 120
    namespace: str = "default"
    pvc: str | None = None
    cpus: str | None = None
    memory: str | None = None
    api: str = "trainjob"
    runtime: str = "torch-distributed"
    queue: str = ""
    priority_class: str = ""
    priority: int = 0


def _script(c: Cluster, job: K8sJob, endpoint: str) -> str:
    """The pod's command: resume when the run directory holds a checkpoint, else start; then plait's launcher."""
    nodes = f"{c.min_nodes}:{c.nodes}" if c.elastic else str(c.nodes)
    return ('if [ -e "$PLAIT_RUN_DIR/checkpoints/latest" ]; then set -- --resume "$PLAIT_RUN_DIR"; '
            'else set -- /etc/plait/config.toml --run.dir="$PLAIT_RUN_DIR"; fi; '
            f'exec python -m plait.cli train "$@" --parallel.nproc="$PLAIT_NPROC_PER_NODE" --nnodes={nodes} '
            f'--rdzv-endpoint="{endpoint}" --rdzv-id={job.name}')


def _resources(c: Cluster, job: K8sJob) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if c.gpus_per_node:
        resources["nvidia.com/gpu"] = str(c.gpus_per_node)  # quantities are strings in the API's schema
    resources["cpu"] = job.cpus or str(c.procs_per_node)
    if job.memory:
        resources["memory"] = job.memory
    return {"requests": dict(resources), "limits": dict(resources)}


def _env(c: Cluster, job: K8sJob) -> list[dict[str, str]]:
    threads = 1 if c.gpus_per_node else max(1, int(float(job.cpus or c.procs_per_node)) // c.procs_per_node)
    return [{"name": "PLAIT_RUN_DIR", "value": f"/runs/{job.name}"},
            {"name": "PLAIT_NPROC_PER_NODE", "value": str(c.procs_per_node)},
            {"name": "PLAIT_ERROR_DIR", "value": "$(PLAIT_RUN_DIR)/errors"},
            {"name": "PLAIT_GRACE_S", "value": str(job.grace_s)},
            {"name": "OMP_NUM_THREADS", "value": str(threads)},
            {"name": "PYTHONUNBUFFERED", "value": "1"}]


def _volumes(job: K8sJob) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts): the config, the run directory, and a memory-backed /dev/shm (data-loader workers and
    NCCL use shared memory; a container's default is 64 MiB)."""
    runs = {"persistentVolumeClaim": {"claimName": job.pvc}} if job.pvc else {"emptyDir": {}}
    volumes = [{"name": "config", "configMap": {"name": f"{job.name}-config"}}, {"name": "runs", **runs},
               {"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    mounts = [{"name": "config", "mountPath": "/etc/plait", "readOnly": True},
              {"name": "runs", "mountPath": "/runs"}, {"name": "dshm", "mountPath": "/dev/shm"}]
    return volumes, mounts


def _labels(job: K8sJob) -> dict[str, str]:
    labels = {"app.kubernetes.io/created-by": "plait"}
    if job.queue:
        labels[QUEUE_LABEL] = job.queue
    if job.priority_class:
        labels[PRIORITY_LABEL] = job.priority_class
    return labels


def trainjob(c: Cluster, job: K8sJob) -> dict[str, Any]:
    """A Kubeflow Trainer v2 TrainJob on ``job.runtime``: the trainer's image, command, nodes and resources, and a
    runtime patch for what the TrainJob's own fields do not hold (grace period, volumes, mounts)."""
    if c.elastic:
        raise ConfigError("a TrainJob has a fixed number of nodes (Kubeflow Trainer 2.3 has no elastic policy); "
                          "give --nodes N, or --launch.api=pytorchjob for an elastic range")
    volumes, mounts = _volumes(job)
    pod = {"terminationGracePeriodSeconds": job.grace_s, "volumes": volumes,
           "containers": [{"name": TRAINER_CONTAINER, "volumeMounts": mounts}]}
    patch = {"manager": "plait", "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": TRAINER_CONTAINER, "template": {"spec": {"template": {"spec": pod}}}}]}}}}
    # Trainer's torch runtime gives every node PET_MASTER_ADDR and PET_MASTER_PORT: the first node's pod
    script = _script(c, job, "$PET_MASTER_ADDR:$PET_MASTER_PORT")
    trainer = {"image": job.image, "command": ["/bin/sh", "-c", script],
               "numNodes": c.nodes, "numProcPerNode": c.procs_per_node, "resourcesPerNode": _resources(c, job),
               "env": _env(c, job)}
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
            "metadata": {"name": job.name, "namespace": job.namespace, "labels": _labels(job)},
            "spec": {"runtimeRef": {"name": job.runtime}, "trainer": trainer, "runtimePatches": [patch]}}


def pytorchjob(c: Cluster, job: K8sJob) -> dict[str, Any]:
    """A training operator PyTorchJob (v1): a Master and the other nodes as Workers, or, for an elastic range,
    Workers only with an ``elasticPolicy`` (the operator's rule for elastic jobs)."""
    restart = "OnFailure" if job.max_restarts > 0 else "Never"
    volumes, mounts = _volumes(job)
    first = f"{job.name}-worker-0" if c.elastic else f"{job.name}-master-0"  # the operator's service per pod
    script = _script(c, job, f"{first}:{K8S_PORT}")
    container = {"name": "pytorch", "image": job.image, "command": ["/bin/sh", "-c", script],
                 "env": _env(c, job), "ports": [{"name": "pytorchjob-port", "containerPort": K8S_PORT}],
                 "resources": _resources(c, job), "volumeMounts": mounts}
    template = {"spec": {"terminationGracePeriodSeconds": job.grace_s, "containers": [container],
                         "volumes": volumes}}
    if job.queue or job.priority_class:
        template["metadata"] = {"labels": _labels(job)}
    spec: dict[str, Any] = {"nprocPerNode": str(c.procs_per_node),
                            "runPolicy": {"backoffLimit": job.max_restarts, "cleanPodPolicy": "Running"}}
    if c.elastic:
        spec["elasticPolicy"] = {"minReplicas": c.min_nodes, "maxReplicas": c.nodes, "rdzvBackend": "c10d",
                                 "maxRestarts": max(job.max_restarts, 1)}
        replicas = {"Worker": {"replicas": c.nodes, "restartPolicy": restart, "template": template}}
    else:
        replicas = {"Master": {"replicas": 1, "restartPolicy": restart, "template": template}}
        if c.nodes > 1:
            replicas["Worker"] = {"replicas": c.nodes - 1, "restartPolicy": restart, "template": template}
    spec["pytorchReplicaSpecs"] = replicas
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": job.name, "namespace": job.namespace, "labels": _labels(job)}, "spec": spec}


def priority_class(job: K8sJob) -> dict[str, Any]:
    """Kueue's WorkloadPriorityClass named by ``launch.priority_class`` with ``launch.priority`` as its value."""
    return {"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "WorkloadPriorityClass",
            "metadata": {"name": job.priority_class}, "value": job.priority,
            "description": f"written by plait launch for {job.name}"}


def k8s_manifest(cfg: Config, c: Cluster, job: K8sJob) -> str:
    """The ConfigMap with the resolved config, the job (TrainJob or PyTorchJob), and the WorkloadPriorityClass
    when ``job.priority`` is set, as one multi-document YAML file."""
    if job.priority and not job.priority_class:
        raise ConfigError("launch.priority is the value of a Kueue WorkloadPriorityClass: name it with "
                          "launch.priority_class")
    config_map = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {"name": f"{job.name}-config", "namespace": job.namespace},
                  "data": {"config.toml": to_toml(cfg)}}
    docs = [config_map, trainjob(c, job) if job.api == "trainjob" else pytorchjob(c, job)]
    if job.priority:
        docs.append(priority_class(job))
    nodes = f"{c.min_nodes} to {c.nodes}" if c.elastic else str(c.nodes)
    needs = ("Kubeflow Trainer (>= 2.3) and its torch-distributed runtime" if job.api == "trainjob" else
             "the Kubeflow training operator (>= 1.7)") + (", Kueue" if job.queue or job.priority_class else "")
    head = (f"# plait on Kubernetes: {nodes} pod(s) x {c.procs_per_node} process(es). Written by `plait launch k8s` "
            f"on {time.strftime('%Y-%m-%d %H:%M')}.\n# Needs {needs}. Submit with: kubectl apply -f <this file>\n")
    return head + "".join("---\n" + to_yaml(d) + "\n" for d in docs)
