"""Every fenced code block of README.md and docs/*.md runs, as a user would run it.

- ``python`` blocks are whole scripts: run with ``python``, or under ``plait run --nproc N`` when the line
  before the block says ``<!-- run: plait run --nproc N -->``.
- ``bash``/``sh`` blocks: each line is a ``plait`` command, run in order. ``plait train`` gets small settings
  for the keys the line does not set itself (few steps, a tiny GPT, no trackers), so the block runs in seconds.
- ``toml`` blocks are configs: loaded and checked for their world size (``parallel.nproc``), as ``plait train``
  checks them before starting a worker.
- A block that cannot run here (``make``, ``torchrun``, ``srun``, ``sbatch``, ``kubectl``, YAML, ...) carries
  ``<!-- not run: REASON -->`` on the line before it; the reason must be given.

Blocks run side by side (two at a time) in one scratch directory holding the fixtures they name: a small
document corpus (``corpus/``), a tokenizer (``my-tokenizer/``), a model factory (``mymodels.py``) and the
repository's ``examples/``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->")
RUN_UNDER = re.compile(r"<!--\s*run:\s*plait run --nproc (\d+)\s*-->")
# What a docs run of `plait train` uses for the keys its command line leaves to the defaults.
FAST = {"train.steps": "3", "train.eval_every": "0", "train.eval_sequences": "8", "train.log_every": "1",
        "observe.trackers": "[]", "observe.progress": "false", "model.n_layer": "1", "model.d_model": "32",
        "model.n_head": "2", "model.seq_len": "32"}
NEEDS_MARK = ("make", "torchrun", "srun", "sbatch", "kubectl")


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    text: str
    not_run: str | None  # the reason, when the doc says the block is not run
    nproc: int  # > 0: a python block run under plait run --nproc nproc

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    found, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, lang, body, indent = i, m.group(2), [], m.group(1)
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append(lines[i].removeprefix(indent))  # a block inside a list item is indented with it
            i += 1
        i += 1
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        not_run = NOT_RUN.search(before)
        under = RUN_UNDER.search(before)
        found.append(Block(path, start + 1, lang, "\n".join(body) + "\n", not_run.group(1) if not_run else None,
                           int(under.group(1)) if under else 0))
    return found


ALL = [b for p in DOCS for b in blocks(p)]


def _fixtures(tmp: Path) -> None:
    """What the blocks name: the repository's examples, a corpus of documents, a tokenizer, a model factory."""
    (tmp / "examples").symlink_to(ROOT / "examples")
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    docs = [f"document {i}: " + " ".join(f"word{(i * 7 + j) % 50}" for j in range(40)) for i in range(60)]
    (tmp / "corpus").mkdir()
    for part in range(2):
        pq.write_table(pa.table({"text": docs[part::2]}), tmp / "corpus" / f"part{part}.parquet", row_group_size=10)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]", "</s>"]))
    (tmp / "my-tokenizer").mkdir()
    tok.save(str(tmp / "my-tokenizer" / "tokenizer.json"))
    (tmp / "mymodels.py").write_text(
        "from torch import nn\n\n\ndef build(hidden: int = 64) -> nn.Module:\n"
        "    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))\n")


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "SLURM_",
                                                                   "LOCAL_RANK", "PLAIT_"))}
    return {**env, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(tmp), "PYTHONUNBUFFERED": "1"}


def _plait_command(args: list[str]) -> list[str]:
    if args[:1] == ["train"] and "--resume" not in args:
        given = {a.split("=", 1)[0].removeprefix("--") for a in args if a.startswith("--")}
        args = args + [f"--{k}={v}" for k, v in FAST.items() if k not in given]
    return [sys.executable, "-m", "plait.cli", *args]


def _run(cmd: list[str], tmp: Path, what: str) -> None:
    proc = subprocess.run(cmd, cwd=tmp, env=_env(tmp), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{what}: {shlex.join(cmd)} exited {proc.returncode}\n{proc.stderr[-3000:]}"


def _check_toml(block: Block, tmp: Path) -> None:
    from plait.config import load_config
    from plait.recipes import validate_config

    path = tmp / f"block{block.line}.toml"
    path.write_text(block.text)
    cfg = load_config(path)
    validate_config(cfg, cfg.parallel.nproc)


def run_block(block: Block, tmp: Path) -> None:
    if block.lang == "python":
        script = tmp / f"{block.path.stem}_{block.line}.py"
        script.write_text(block.text)
        launcher = [sys.executable, "-m", "plait.cli", "run", "--nproc", str(block.nproc)] if block.nproc else \
            [sys.executable]
        _run([*launcher, str(script)], tmp, block.where)
    elif block.lang in ("bash", "sh"):
        for line in block.text.splitlines():
            args = shlex.split(line, comments=True)
            if args:
                assert args[0] == "plait", f"{block.where}: `{line}` is not a plait command; mark the block"
                _run(_plait_command(args[1:]), tmp, block.where)
    elif block.lang == "toml":
        _check_toml(block, tmp)
    else:
        raise AssertionError(f"{block.where}: a ```{block.lang} block is not run; mark it <!-- not run: why -->")


def test_every_block_is_run_or_marked_with_a_reason() -> None:
    assert len(ALL) > 10
    for b in ALL:
        if b.not_run is not None:
            assert b.not_run, f"{b.where}: <!-- not run: --> needs the reason"
            continue
        commands = [shlex.split(x, comments=True)[:1] for x in b.text.splitlines()] if b.lang in ("bash", "sh") else []
        assert not any(c and c[0] in NEEDS_MARK for c in commands), f"{b.where} needs <!-- not run: why -->"


def test_docs_stand_alone() -> None:
    """No path outside the repository; every relative link names a file that exists."""
    for path in DOCS + [ROOT / "docs" / "monitoring" / "README.md"]:
        text = path.read_text()
        assert "../shared" not in text and "DESIGN.md" not in text, path
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert (path.parent / target).exists(), f"{path.relative_to(ROOT)} links to missing {target}"


@pytest.mark.parametrize("doc", [p.relative_to(ROOT).as_posix() for p in DOCS])
def test_blocks_run(doc: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    todo = [b for b in ALL if b.path == ROOT / doc and b.not_run is None]
    if not todo:
        pytest.skip(f"{doc} has no block to run")
    tmp = tmp_path_factory.mktemp("docs")
    _fixtures(tmp)
    # Blocks are independent (each names its own run directory): two at a time; one failure fails the test.
    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(run_block, b, tmp) for b in todo]:
            future.result()
