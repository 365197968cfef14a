"""``plait train`` as a thin client of the library: a user's model factory, a plugin's registered model,
the CNN recipe, and ``--help`` on every command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import run_weights

from plait.config import Config, load_config
from plait.recipes import validate_config as validate

ROOT = Path(__file__).resolve().parents[2]
QUIET = ["--observe.progress=false", "--observe.trackers=[]"]

FACTORY = """
    from transformers import LlamaConfig, LlamaForCausalLM

    def build(hidden=32, layers=2):
        return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                                            num_hidden_layers=layers, num_attention_heads=2,
                                            num_key_value_heads=2, max_position_embeddings=64))
"""
PLUGIN = """
    from torch import nn

    def build(hidden=32):
        return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
"""


def _plait(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "plait.cli", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _plugin(tmp_path: Path) -> Path:
    """A package registering a model under the plait.models entry-point group, as pip would install it."""
    site = tmp_path / "site"
    (site / "plaitplug").mkdir(parents=True)
    (site / "plaitplug" / "__init__.py").write_text(textwrap.dedent(PLUGIN))
    info = site / "plaitplug-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: plaitplug\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[plait.models]\ntinymlp = plaitplug:build\n")
    return site


def test_factory_plugin_and_cnn_recipes_train(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("sklearn")
    (tmp_path / "mymodels.py").write_text(textwrap.dedent(FACTORY))
    site = _plugin(tmp_path)
    small = ["--train.steps=3", "--train.global_batch_size=8", "--train.micro_batch_size=2", "--train.eval_every=0",
             "--train.eval_sequences=8", *QUIET]
    runs = {
        # a module in the working directory, called with [model.args]; the text data; the loss inferred
        "factory": _plait("train", "--model.factory=mymodels:build", "--model.args.hidden=32", "--data.name=text",
                          "--model.seq_len=32",
                          "--parallel.nproc=2", "--parallel.zero=2", *small, "--run.dir=factory", cwd=tmp_path),
        "plugin": _plait("train", "--model.name=tinymlp", "--data.name=digits", "--parallel.nproc=1", *small,
                         "--run.dir=plugin", cwd=tmp_path, env={"PYTHONPATH": str(site)}),
        "cnn": _plait("train", str(ROOT / "examples" / "cnn.toml"), "--train.steps=40", "--train.eval_every=0",
                      *QUIET, "--run.dir=cnn", cwd=tmp_path),
    }
    out = {name: proc.communicate(timeout=300) for name, proc in runs.items()}
    for name, proc in runs.items():
        assert proc.returncode == 0, (name, out[name][1][-3000:])
    summary = {name: json.loads((tmp_path / name / "summary.json").read_text()) for name in runs}
    assert summary["factory"]["loss"] == "causal_lm" and summary["factory"]["world_size"] == 2
    assert summary["plugin"]["loss"] == "classification"
    assert summary["cnn"]["loss"] == "classification" and summary["cnn"]["final_val_accuracy"] > 0.8
    assert "val accuracy" in out["cnn"][0]

    sys.path.insert(0, str(tmp_path))
    try:
        import mymodels
    finally:
        sys.path.remove(str(tmp_path))
    mymodels.build(hidden=32).load_state_dict(run_weights(tmp_path / "factory"), strict=True)


def test_help_on_every_command_lists_commands_and_keys(tmp_path: Path, capsys) -> None:
    """``plait --help`` lists every command and key; ``plait COMMAND --help`` prints that command's usage, with
    every key for the commands that take ``--section.key=value``; ``plait run --help`` prints run's own options,
    while ``--help`` after the script is the script's. The ``--help`` commands go through ``plait.cli.main`` (what
    ``python -m plait.cli`` calls) in this process: they start nothing, so a process each would only add
    start-up; the script's ``--help`` runs under a real ``plait run`` (it starts a worker), beside them."""
    from plait.cli import main

    (tmp_path / "script.py").write_text("import sys\nprint('script got', sys.argv[1:])\n")
    script = _plait("run", "--nproc", "1", "script.py", "--help", cwd=tmp_path)
    keys = [f"{section}.{key}" for section, obj in vars(Config()).items() for key in vars(obj)]
    texts = {}
    for cmd in ("--help", "train --help", "run --help", "sample --help", "plan --help", "checkpoint --help"):
        code = main(cmd.split())
        text, err = capsys.readouterr()
        assert code == 0, (cmd, err)
        texts[cmd] = text
        missing = [k for k in keys if f"  {k} = " not in text]
        assert (not missing) == (cmd in ("--help", "train --help", "plan --help")), (cmd, missing[:3])
    for command in ("plait train", "plait run", "plait sample", "plait plan memory"):
        assert command in texts["--help"], command
    assert texts["run --help"].startswith("usage: plait run [--nproc N] [--max-restarts R] SCRIPT")
    assert "--max-restarts R" in texts["run --help"] and "RUN_DIR/errors/rank<r>.txt" in texts["run --help"]
    assert "plait train" not in texts["run --help"] and "plait sample" not in texts["run --help"]
    assert texts["sample --help"].startswith("usage: plait sample RUN_DIR --prompt TEXT")
    assert texts["checkpoint --help"].startswith("usage: plait checkpoint verify RUN_DIR")
    assert texts["train --help"].startswith("usage: plait train [CONFIG.toml]")
    out, err = script.communicate(timeout=120)
    assert script.returncode == 0 and "script got ['--help']" in out, err
    # each key's documentation and default: for example
    assert 'train.loss = "auto"   (str)' in texts["train --help"] and "Loss of a batch: auto" in texts["train --help"]


def test_example_configs_name_registered_recipes() -> None:
    cfg = validate(load_config(ROOT / "examples" / "cnn.toml"), 2)
    assert (cfg.model.name, cfg.parallel.dp, cfg.model.args) == ("cnn", 2, {"width": 16, "num_blocks": 2})
