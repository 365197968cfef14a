"""CUDA paths: training on a GPU with bf16 autocast, and, where 2+ GPUs exist, NCCL data parallelism and
ZeRO with CPU offload against the same ZeRO stage without it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import TINY_CLI, assert_same_training, plait_cli, succeeded


@pytest.mark.gpu
def test_train_on_cuda_bf16(tmp_path: Path) -> None:
    succeeded(plait_cli("train", *TINY_CLI, "--parallel.nproc=1", "--train.steps=3", "--train.precision=bf16",
              f"--run.dir={tmp_path}/g", cwd=tmp_path))
    summary = json.loads((tmp_path / "g/summary.json").read_text())
    assert summary["steps"] == 3 and summary["final_val_loss"] < 6.0


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL data parallelism needs 2 GPUs")
def test_nccl_data_parallel(tmp_path: Path) -> None:
    succeeded(plait_cli("train", *TINY_CLI, "--parallel.nproc=2", "--train.steps=3", "--comm.backend=nccl",
              f"--run.dir={tmp_path}/n", cwd=tmp_path))
    assert json.loads((tmp_path / "n/summary.json").read_text())["world_size"] == 2


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="ZeRO over NCCL needs 2 GPUs")
@pytest.mark.parametrize(("zero", "offload"), [(2, "optimizer"), (3, "params")])
def test_zero_offload_equals_no_offload(tmp_path: Path, zero: int, offload: str) -> None:
    """Offload moves the optimizer shard (zero=2) or the sharded parameters (zero=3, FSDP2
    CPUOffloadPolicy) to host memory; the fp32 arithmetic is the same, so 3 steps end with the same
    weights as the run without offload (atol 1e-5)."""
    runs = {}
    for name in ("none", offload):
        runs[name] = f"{tmp_path}/{name}"
        succeeded(plait_cli("train", *TINY_CLI, "--train.steps=3", "--comm.backend=nccl", f"--parallel.zero={zero}",
                  f"--parallel.offload={name}", f"--run.dir={runs[name]}", cwd=tmp_path))
    assert_same_training(runs["none"], runs[offload], atol=1e-5, loss_tol=1e-5, steps=3)
