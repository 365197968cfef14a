"""Shared test setup: the suite's helper modules (``helpers``, ``references``, ``sysdeps``, ``plan_factories``)
import by their plain names from every folder, spawned ranks are forked from a server that imported what they
use once, and GPU tests run only where CUDA exists.

Test folders mirror ``src/plait`` (``tests/parallel/zero/test_optimizer.py`` tests
``plait/parallel/zero/optimizer.py``) and are packages, so two folders may hold files of the same name;
spawned ranks import a test's functions by the package name and find the helpers through the path set here,
which they inherit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

# What every spawned rank would import again: the fork server imports it once, and ranks are forked from it
# (plait.runtime.spawn). Started here, before any test can change the environment the server keeps.
RANK_IMPORTS = [
    "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.tensor.parallel",
    "torch.distributed.pipelining", "torch.distributed.elastic.multiprocessing",
    "plait", "plait.engine", "plait.parallel.compose", "plait.train.trainer", "plait.recipes", "plait.models.tiny",
    "transformers", *(f"transformers.models.{m}.modeling_{m}" for m in (
        "llama", "qwen2", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "t5", "bert", "gpt2",
        "deepseek_v3")),
    "helpers", "references",
]


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return  # pytest-xdist's controller runs no test: each worker starts its own server
    from plait.runtime import spawn

    spawn.preload(RANK_IMPORTS)
    spawn.start_server()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
