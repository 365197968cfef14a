"""Bad input through the API and the command line: one clear message, a non-zero exit, no traceback, no hang."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import cli_argv, run_all, run_ranks

import plait
from plait.config import ConfigError
from plait.engine import PlaitError

QUIET = {"observe": {"progress": False, "trackers": []}}


def _plait(tmp_path: Path, **sections) -> plait.Plait:
    return plait.Plait(run={"dir": str(tmp_path / "run")}, **QUIET, **sections)


def test_optimizer_that_holds_state_is_refused(tmp_path) -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    with pytest.raises(ConfigError, match="already holds state .* Pass a factory instead"):
        _plait(tmp_path).setup(model, opt)


def test_optimizer_without_state_is_rebuilt_over_the_model(tmp_path) -> None:
    model = torch.nn.Linear(4, 2)
    given = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    _, opt = _plait(tmp_path).setup(model, given)
    assert type(opt) is torch.optim.SGD and opt.param_groups[0]["lr"] == 0.5
    assert opt.param_groups[0]["momentum"] == 0.9


def test_loss_that_is_not_a_scalar(tmp_path) -> None:
    p = _plait(tmp_path)
    model, _ = p.setup(torch.nn.Linear(4, 2))
    with pytest.raises(PlaitError, match=r"backward\(\) needs a scalar loss; got \(3, 2\)"):
        p.backward(model(torch.randn(3, 4)))
    with pytest.raises(PlaitError, match="does not require grad"):
        p.backward(torch.tensor(1.0))


def test_dataset_smaller_than_one_global_batch(tmp_path) -> None:
    p = _plait(tmp_path, train={"global_batch_size": 32, "micro_batch_size": 8})
    data = torch.utils.data.TensorDataset(torch.randn(20, 4))
    with pytest.raises(ConfigError, match="holds 20 samples, fewer than one global batch of 32"):
        p.setup_dataloader(data)


def test_unknown_config_section_in_keyword_form(tmp_path) -> None:
    with pytest.raises(ConfigError, match="unknown config key 'train.stpes'; did you mean 'train.steps'"):
        plait.Plait(train={"stpes": 3})


def _tp_errors(rank: int, world: int, root: str) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    out = {}
    cases = {
        "nothing": ({"model.layers.*.attention.q": "colwise"}, 4),
        "heads": (None, 3),
        "style": ({"model.layers.*.self_attn.q_proj": "diagonal"}, 4),
        "kind": ({"model.layers.*.input_layernorm": "colwise"}, 4),
    }
    for name, (plan, heads) in cases.items():
        p = plait.Plait(parallel={"tp": 2, "tp_plan": plan or "auto"}, run={"dir": f"{root}/{name}"}, **QUIET)
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=12 * heads, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=heads,
                                             num_key_value_heads=heads))
        try:
            p.setup(model)
            out[name] = None
        except ConfigError as e:
            out[name] = str(e)
        p.close()
    return out


def test_tensor_parallel_plan_errors_before_any_collective(tmp_path) -> None:
    pytest.importorskip("transformers")
    for r in run_ranks(_tp_errors, 2, str(tmp_path), timeout=180):
        assert "tp plan pattern 'model.layers.*.attention.q' matches no module of LlamaForCausalLM; nearest module " \
               "names:" in r["nothing"]
        assert "num_attention_heads=3, which does not divide by parallel.tp=2" in r["heads"]
        assert "unknown tensor-parallel style 'diagonal'" in r["style"]
        assert "model.layers.0.input_layernorm is a LlamaRMSNorm, but colwise takes Linear" in r["kind"]


# -- the command line ----------------------------------------------------------------------------------
TINY = ["--model.n_layer=1", "--model.d_model=32", "--model.n_head=2", "--model.seq_len=16",
        "--train.global_batch_size=4", "--train.micro_batch_size=2", "--train.steps=2", "--train.eval_sequences=4",
        "--observe.progress=false", "--observe.trackers=[]"]
SCRIPTS = {
    "not_scalar.py": """
        import torch, plait
        p = plait.Plait(observe={"progress": False})
        model, _ = p.setup(torch.nn.Linear(4, 2))
        p.backward(model(torch.randn(3, 4)))
    """,
    "save_on_one_rank.py": """
        import torch, plait
        p = plait.Plait(comm={"timeout_s": 8}, observe={"progress": False}, run={"dir": "one-rank"})
        model, opt = p.setup(torch.nn.Linear(4, 2))
        p.backward(model(torch.randn(3, 4)).sum())
        p.step()
        if p.rank == 0:
            p.save("one-rank/ckpt", model=model, optimizer=opt)
        p.close()
    """,
    "badmodel.py": """
        def build(width=8):
            raise ValueError("this factory is broken on purpose")
    """,
}
COMMANDS = {
    "not_scalar": (["run", "--nproc", "2", "not_scalar.py"], 1,
                   ["rank ", "failed: PlaitError: backward() needs a scalar loss; got (3, 2)"]),
    "save_on_one_rank": (["run", "--nproc", "2", "save_on_one_rank.py"], 1,
                         ["rank 0 failed: CollectiveTimeout: step 1 phase 'checkpoint save'",
                          "ranks [1] did not arrive (rank 1 closed its Plait after step 2 'forward/backward')"]),
    "unknown_factory": (["train", *TINY, "--model.factory=nosuch.module:build", "--data.name=digits",
                         "--run.dir=r1"], 2,
                        ["model.factory='nosuch.module:build': cannot import module 'nosuch.module'"]),
    "factory_raises": (["train", *TINY, "--model.factory=badmodel:build", "--data.name=digits", "--parallel.nproc=2",
                        "--run.dir=r2"], 1,
                       ["failed: ConfigError: model.factory=badmodel:build raised ValueError: this factory is broken"]),
    "factory_arguments": (["train", *TINY, "--model.factory=badmodel:build", "--model.args.depth=3",
                           "--data.name=digits", "--parallel.nproc=1", "--run.dir=r3"], 2,
                          ["model.factory=badmodel:build cannot be called with {'depth': 3}"]),
}


def test_command_line_errors_are_one_line(tmp_path: Path) -> None:
    for name, text in SCRIPTS.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = run_all({name: cli_argv(*args) for name, (args, _, _) in COMMANDS.items()},
                    cwd=tmp_path, env=env)
    for name, (_, code, fragments) in COMMANDS.items():
        err = procs[name].stderr
        assert procs[name].returncode == code, (name, err[-3000:])
        lines = [line for line in err.splitlines() if line.startswith("plait: error:")]
        assert len(lines) == 1 and "Traceback" not in err, (name, err[-3000:])
        for fragment in fragments:
            assert fragment in lines[0], (name, lines[0])
    # the factory's own traceback is kept where the line points
    report = (tmp_path / "r2" / "errors" / "rank0.txt").read_text()
    assert "this factory is broken on purpose" in report and "badmodel.py" in report


def test_plait_run_error_file_is_in_the_scripts_run_dir(tmp_path: Path) -> None:
    """Under ``plait run`` a worker's traceback goes to the script's ``RUN_DIR/errors/rank<r>.txt`` once it has
    created ``plait.Plait`` (as under ``plait train``), and the one line printed names that file; an error before
    ``plait.Plait`` exists goes to the launcher's own ``plait-run-*`` directory, named the same way."""
    (tmp_path / "after.py").write_text(textwrap.dedent("""
        import plait
        p = plait.Plait(observe={"progress": False}, run={"dir": "myrun"})
        raise ValueError(f"broken after setup on rank {p.rank}")
    """))
    (tmp_path / "before.py").write_text("raise ValueError('broken before plait')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = run_all({name: cli_argv("run", "--nproc", "1", f"{name}.py") for name in ("after", "before")},
                    cwd=tmp_path, env=env)
    errs = {name: p.stderr for name, p in procs.items()}
    for name, p in procs.items():
        assert p.returncode == 1, (name, errs[name][-2000:])
    line = next(x for x in errs["after"].splitlines() if x.startswith("plait: error:"))
    report = tmp_path / "myrun" / "errors" / "rank0.txt"
    assert "rank 0 failed: ValueError: broken after setup on rank 0" in line, line
    assert f"(details: {report.resolve()})" in line, line
    assert "Traceback" in report.read_text() and "after.py" in report.read_text()
    line = next(x for x in errs["before"].splitlines() if x.startswith("plait: error:"))
    detail = Path(line.split("(details: ")[1].rstrip(")"))
    assert "ValueError: broken before plait" in line and detail.parent.parent.name.startswith("plait-run-"), line
    assert detail.name == "rank0.txt" and "before.py" in detail.read_text()
