"""Every example config parses strictly and validates for its own world size."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.config import load_config
from plait.recipes import validate_config as validate

EXAMPLES = sorted((Path(__file__).parents[1] / "examples").glob("*.toml"))


def test_examples_exist_for_each_layout() -> None:
    names = {p.stem for p in EXAMPLES}
    assert {"tp", "tp_sp", "pp_gpipe", "pp_1f1b", "pp_interleaved", "pp_zbv", "dp_tp", "dp_pp", "tp_pp",
            "dp_tp_pp", "dp_tp_zero3", "zero1", "zero2", "zero3", "hsdp", "pp_zero2", "pp_zero3"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_validates(path: Path) -> None:
    cfg = load_config(path)
    validate(cfg, cfg.parallel.nproc)
    p = cfg.parallel
    servers = cfg.ps.servers if p.mode == "ps" else 0  # parameter servers are ranks outside dp
    assert p.dp * p.tp * p.pp == p.nproc - servers
