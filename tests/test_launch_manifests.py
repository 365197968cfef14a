"""The files ``plait launch`` writes, checked against the projects' schemas and against golden files.

Every Kubernetes document (TrainJob, PyTorchJob, ConfigMap, Kueue's WorkloadPriorityClass) is validated against the
JSON Schemas in ``tests/schemas`` (their sources and versions in its README), strictly: a field the API does not
declare fails. The Kueue labels are checked against Kubernetes' label syntax. Golden files in ``tests/golden`` hold
a TrainJob with Kueue, an elastic PyTorchJob and an sbatch script with QoS and an array: a change to what plait
writes shows up as a diff (``PLAIT_UPDATE_GOLDEN=1`` writes them again).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from plait.config import ConfigError, load_config, to_toml
from plait.launch_files import K8sJob, SlurmJob, cluster, k8s_manifest, slurm_script
from plait.launch_files.k8s import PRIORITY_LABEL, QUEUE_LABEL

yaml = pytest.importorskip("yaml", reason="PyYAML parses the manifest (the dev extra)")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema validates the manifests (the dev extra)")

HERE = Path(__file__).resolve().parent
SCHEMAS = HERE / "schemas"
GOLDEN = HERE / "golden"
SCHEMA_OF = {"TrainJob": "trainjob", "PyTorchJob": "pytorchjob", "ConfigMap": "configmap",
             "WorkloadPriorityClass": "workloadpriorityclass"}
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")  # Kubernetes: at most 63 characters
OVERRIDES = ["--model.n_layer=2", "--model.d_model=32", "--model.n_head=2", "--train.global_batch_size=48",
             "--train.micro_batch_size=2"]


def _validate(doc: dict) -> None:
    schema = json.loads((SCHEMAS / f"{SCHEMA_OF[doc['kind']]}.schema.json").read_text())
    jsonschema.validate(doc, schema, cls=jsonschema.Draft202012Validator)


def _docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def _manifest(**job: object) -> str:
    cfg = load_config(None, OVERRIDES)
    nodes = str(job.pop("nodes", "2"))
    return k8s_manifest(cfg, cluster(nodes, 4, None), K8sJob("plait-tiny", "registry/plait:1", **job))


def _reload(toml_text: str) -> str:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(toml_text)
    try:
        return to_toml(load_config(f.name, []))
    finally:
        os.unlink(f.name)


def _golden(name: str, text: str) -> None:
    """Compare ``text`` with its golden file, with the embedded config replaced by a marker.

    The embedded config is plait's whole config, which grows with every new option; it is checked here to be the
    config the manifest was written from (it reads back to the same values), so the golden file holds only what
    ``plait launch`` itself writes.
    """
    text = re.sub(r"on \d{4}-\d\d-\d\d \d\d:\d\d", "on DATE", text)
    block = re.search(r"^(  config\.toml: \|\n)((?:    .*\n|\n)+)", text, flags=re.M)
    if block is not None:
        embedded = "".join(line[4:] for line in block.group(2).splitlines(keepends=True))
        assert to_toml(load_config(None, [])) != embedded  # the overrides are in it
        assert _reload(embedded) == to_toml(load_config(None, OVERRIDES)), "the embedded config is not the run's"
        text = text[:block.start(2)] + "    <plait's config: checked to read back to the run's>\n" + text[block.end(2):]
    path = GOLDEN / name
    if os.environ.get("PLAIT_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.is_file(), f"no golden file {path}: run with PLAIT_UPDATE_GOLDEN=1 to write it"
    assert text == path.read_text(), f"{name} differs from its golden file (PLAIT_UPDATE_GOLDEN=1 rewrites it)"


def test_trainjob_with_kueue_is_valid_and_matches_its_golden_file() -> None:
    text = _manifest(queue="team-a", priority_class="research-high", priority=1000, pvc="runs", grace_s=300,
                     max_restarts=2)
    docs = _docs(text)
    assert [d["kind"] for d in docs] == ["ConfigMap", "TrainJob", "WorkloadPriorityClass"]
    for doc in docs:
        _validate(doc)
    job = docs[1]
    labels = job["metadata"]["labels"]
    assert labels[QUEUE_LABEL] == "team-a" and labels[PRIORITY_LABEL] == "research-high"
    assert all(LABEL_VALUE.match(v) and len(v) <= 63 for v in labels.values())
    assert docs[2]["metadata"]["name"] == "research-high" and docs[2]["value"] == 1000
    trainer = job["spec"]["trainer"]
    assert trainer["numNodes"] == 2 and trainer["numProcPerNode"] == 4
    pod = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    assert pod["template"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 300
    assert "--nnodes=2" in trainer["command"][-1] and "$PET_MASTER_ADDR:$PET_MASTER_PORT" in trainer["command"][-1]
    _golden("trainjob-kueue.yaml", text)


def test_elastic_pytorchjob_is_valid_and_matches_its_golden_file() -> None:
    text = _manifest(nodes="1:3", api="pytorchjob", queue="team-a", grace_s=180)
    docs = _docs(text)
    assert [d["kind"] for d in docs] == ["ConfigMap", "PyTorchJob"]
    for doc in docs:
        _validate(doc)
    spec = docs[1]["spec"]
    assert spec["elasticPolicy"] == {"minReplicas": 1, "maxReplicas": 3, "rdzvBackend": "c10d", "maxRestarts": 1}
    assert list(spec["pytorchReplicaSpecs"]) == ["Worker"] and spec["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3
    template = spec["pytorchReplicaSpecs"]["Worker"]["template"]
    assert template["metadata"]["labels"][QUEUE_LABEL] == "team-a"  # Kueue reads it from the pods too
    assert template["spec"]["terminationGracePeriodSeconds"] == 180
    assert "--nnodes=1:3" in template["spec"]["containers"][0]["command"][-1]
    _golden("pytorchjob-elastic.yaml", text)


def test_the_schemas_refuse_what_the_api_does_not_declare() -> None:
    job = _docs(_manifest())[1]
    job["spec"]["trainer"]["numNode"] = 2  # misspelt: an API server would drop it silently
    with pytest.raises(jsonschema.ValidationError, match="numNode"):
        _validate(job)
    wpc = {"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "WorkloadPriorityClass", "metadata": {"name": "x"}}
    with pytest.raises(jsonschema.ValidationError, match="value"):
        _validate(wpc)


def test_a_trainjob_has_no_elastic_range_and_a_priority_needs_its_class() -> None:
    with pytest.raises(ConfigError, match="fixed number of nodes"):
        _manifest(nodes="1:3")
    with pytest.raises(ConfigError, match="launch.priority_class"):
        _manifest(priority=10)


def test_sbatch_script_matches_its_golden_file() -> None:
    c = cluster("2:4", 8, None)
    job = SlurmJob("plait-tiny", max_restarts=2, grace_s=95, grace_why="2 x (slowest step 1.20 s + slowest save "
                   "11.30 s) + 30 s, at least 60 s, measured in runs/earlier", partition="gpu", qos="low",
                   account="team-a", time_limit="04:00:00", cpus_per_task=6,
                   array=[["--optim.lr=1e-3"], ["--optim.lr=3e-4", "--train.seed=2"]])
    text = slurm_script("/work/plait/tiny.toml", ["--train.steps=100"], c, job, python="/usr/bin/python3",
                        workdir="/work/plait")
    _golden("array-qos.sbatch", text)


def test_committed_schemas_are_what_the_packages_give() -> None:
    pytest.importorskip("kubeflow_trainer_api", reason="kubeflow-trainer-api writes the TrainJob schema (dev extra)")
    pytest.importorskip("kubeflow.training", reason="kubeflow-training writes the PyTorchJob schema (dev extra)")
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_schemas", SCHEMAS / "make_schemas.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

    made = {"trainjob": make.one_of_values(TrainerV1alpha1TrainJob.model_json_schema(by_alias=True)),
            "pytorchjob": make.openapi_schema("KubeflowOrgV1PyTorchJob"),
            "configmap": make.openapi_schema("V1ConfigMap")}
    for name, schema in made.items():
        assert make.strict(schema) == json.loads((SCHEMAS / f"{name}.schema.json").read_text()), name
