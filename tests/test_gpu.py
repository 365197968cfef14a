"""CUDA paths: training on a GPU with bf16 autocast, and NCCL data parallelism where 2+ GPUs exist."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_cli import TINY, _ok, plait


@pytest.mark.gpu
def test_train_on_cuda_bf16(tmp_path: Path) -> None:
    _ok(plait("train", *TINY, "--parallel.nproc=1", "--train.steps=3", "--train.precision=bf16",
              f"--run.dir={tmp_path}/g", cwd=tmp_path))
    summary = json.loads((tmp_path / "g/summary.json").read_text())
    assert summary["steps"] == 3 and summary["final_val_loss"] < 6.0


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL data parallelism needs 2 GPUs")
def test_nccl_data_parallel(tmp_path: Path) -> None:
    _ok(plait("train", *TINY, "--parallel.nproc=2", "--train.steps=3", "--comm.backend=nccl",
              f"--run.dir={tmp_path}/n", cwd=tmp_path))
    assert json.loads((tmp_path / "n/summary.json").read_text())["world_size"] == 2
