"""``plait launch slurm|k8s``: the files as written, parsed and checked field by field, and bad input.

The sbatch script also runs against a real SLURM in tests/test_launch_slurm.py.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from plait.cli import main
from plait.config import ConfigError, load_config
from plait.launch_files import K8sJob, cluster, k8s_manifest, to_yaml

yaml = pytest.importorskip("yaml", reason="PyYAML parses the manifest (the dev extra)")

TINY = """[model]
n_layer = 2
d_model = 32
n_head = 2
seq_len = 32
[train]
steps = 4
global_batch_size = 16
micro_batch_size = 2
eval_every = 0
"""


def plait(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The command line as a user runs it, in a subprocess."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "plait.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def plait_here(*args: str) -> subprocess.CompletedProcess:
    """``plait.cli.main`` in this process (no interpreter start per case), captured like a subprocess."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    return path


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"]}


def test_k8s_manifest_field_by_field(tmp_path: Path, config: Path) -> None:
    out = tmp_path / "job.yaml"
    p = plait("launch", "k8s", str(config), "--nodes", "2", "--gpus-per-node", "4", "--image", "registry/plait:1",
              "--pvc", "runs", "--memory", "64Gi", "-o", str(out), "--fault.max_restarts=2", "--api", "pytorchjob",
              cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert f"wrote {out}" in p.stdout and f"kubectl apply -f {out}" in p.stdout
    config_map, job = list(yaml.safe_load_all(out.read_text()))
    assert config_map["kind"] == "ConfigMap" and config_map["metadata"]["name"] == "plait-tiny-config"
    saved = tomllib.loads(config_map["data"]["config.toml"])
    assert saved["model"]["d_model"] == 32 and saved["train"]["global_batch_size"] == 16
    assert saved["parallel"]["dp"] == 0  # inferred at run time, as plait train keeps it
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    assert job["metadata"]["name"] == "plait-tiny" and job["spec"]["nprocPerNode"] == "4"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"}
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 1
    restarts = getattr(getattr(load_config(config, ["--fault.max_restarts=2"]), "fault", None), "max_restarts", 0)
    assert job["spec"]["runPolicy"]["backoffLimit"] == restarts
    for spec in specs.values():
        assert spec["restartPolicy"] == ("OnFailure" if restarts else "Never")
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        assert container["name"] == "pytorch" and container["image"] == "registry/plait:1"
        assert container["ports"] == [{"name": "pytorchjob-port", "containerPort": 23456}]
        env = _env(container)
        assert env["PLAIT_RUN_DIR"] == "/runs/plait-tiny" and env["PLAIT_NPROC_PER_NODE"] == "4"
        assert env["PLAIT_ERROR_DIR"] == "$(PLAIT_RUN_DIR)/errors" and env["OMP_NUM_THREADS"] == "1"
        for res in (container["resources"]["requests"], container["resources"]["limits"]):
            assert res == {"nvidia.com/gpu": "4", "cpu": "4", "memory": "64Gi"}
        script = container["command"][-1]
        # plait's launcher in every pod, meeting at the master pod's service; a restarted pod resumes from the
        # run directory's checkpoint.
        for part in ("--nnodes=2", '--parallel.nproc="$PLAIT_NPROC_PER_NODE"', "--rdzv-id=plait-tiny",
                     '--rdzv-endpoint="plait-tiny-master-0:23456"', "-m plait.cli train",
                     '--resume "$PLAIT_RUN_DIR"', "/etc/plait/config.toml"):
            assert part in script
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts == {"config": "/etc/plait", "runs": "/runs", "dshm": "/dev/shm"}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["runs"]["persistentVolumeClaim"] == {"claimName": "runs"}
        assert volumes["config"]["configMap"]["name"] == "plait-tiny-config"


def test_k8s_single_node_cpu_no_restarts(config: Path) -> None:
    cfg = load_config(config)
    c = cluster(1, 0, 2)
    job = list(yaml.safe_load_all(k8s_manifest(cfg, c, K8sJob("cpu", "img", api="pytorchjob"))))[1]
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert list(specs) == ["Master"] and specs["Master"]["restartPolicy"] == "Never"
    assert job["spec"]["runPolicy"]["backoffLimit"] == 0
    container = specs["Master"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"cpu": "2"} and _env(container)["PLAIT_NPROC_PER_NODE"] == "2"
    assert specs["Master"]["template"]["spec"]["volumes"][1] == {"name": "runs", "emptyDir": {}}


def test_yaml_writer_round_trips() -> None:
    data = {"a": [{"b": 1, "c": [True, None, "yes", "x: y"]}, "two\nlines\n", []], "d": {}, "e": "2", "f": 1.5}
    data["a"][0]["c"][1] = "null"
    assert yaml.safe_load(to_yaml(data)) == data


def test_sbatch_script_fields(tmp_path: Path, config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the script starts its tasks where it was written (--chdir)
    out = tmp_path / "job.sbatch"
    p = plait_here("launch", "slurm", str(config), "--nodes", "4", "--gpus-per-node", "8", "--partition", "gpu",
                   "--time", "01:00:00", "--cpus-per-task", "6", "-o", str(out), "--train.steps=9",
                   "--train.global_batch_size=64")
    assert p.returncode == 0, p.stderr
    assert f"sbatch {out}" in p.stdout and "world size 32" in p.stdout
    text = out.read_text()
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "#SBATCH --gres=gpu:8",
                 "#SBATCH --partition=gpu", "#SBATCH --time=01:00:00", "#SBATCH --signal=B:USR1@120",
                 "#SBATCH --requeue",
                 "#SBATCH --cpus-per-task=6", 'if [ "$status" -eq 75 ]',
                 f"#SBATCH --chdir={tmp_path.resolve()}", f"CONFIG={config.resolve()}",
                 "--train.steps=9 --train.global_batch_size=64", "srun --kill-on-bad-exit=1 --cpus-per-task=6",
                 'scontrol show hostnames "$SLURM_JOB_NODELIST"', "-m plait.cli train"):
        assert line in text, line
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0


@pytest.mark.parametrize(("args", "message"), [
    (["slurm", "--nodes", "0", "--gpus-per-node", "1"], "--nodes must be at least 1"),
    (["slurm", "--nodes", "1", "--gpus-per-node", "2", "--procs-per-node", "3"], "one process per GPU"),
    (["k8s", "--nodes", "1", "--gpus-per-node", "1"], "needs --image"),
    (["slurm", "--nodes", "3", "--gpus-per-node", "1"], "global_batch_size"),
    (["slurm", "--nodes", "1", "--gpus-per-node", "1", "--train.stepz=3"], "unknown config key"),
])
def test_launch_bad_input_is_one_line(tmp_path: Path, config: Path, args: list[str], message: str) -> None:
    p = plait_here("launch", args[0], str(config), *args[1:])
    assert p.returncode == 2 and message in p.stderr and p.stderr.count("\n") == 1, p.stderr


def test_cluster_shape() -> None:
    assert cluster(2, 8, None).world_size == 16 and cluster(3, 0, None).world_size == 3
    with pytest.raises(ConfigError):
        cluster(1, 0, 0)
