"""Shared test setup: the suite's helper modules (``helpers``, ``references``, ``sysdeps``, ``plan_factories``)
import by their plain names from every folder, and GPU tests run only where CUDA exists.

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
