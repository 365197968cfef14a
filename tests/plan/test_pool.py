"""``plait plan --gpus N --jobs JOBS.toml``: the pool planner's rule on allocations worked out by hand.

The rule (``plait.plan.pool``): admit the jobs whose minimums fit, highest priority first; then maximise the sum of
priority x predicted useful FLOP/s. The first checks give the allocator throughput figures directly, so the right
split follows by arithmetic; the last runs the command on a 1.3B GPT on 32 simulated A100s.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.cli import main
from plait.config import ConfigError
from plait.plan.pool import Job, Option, allocate, counts, read_jobs


def _opts(**flops: float) -> list[Option]:
    return [Option(int(g[1:]), f"dp={g[1:]}", f, 1.0, f) for g, f in flops.items()]


def _gpus(chosen: dict[str, Option | None]) -> dict[str, int]:
    return {name: o.gpus if o else 0 for name, o in chosen.items()}


def test_the_higher_priority_job_takes_what_it_can_use() -> None:
    # 3 x A + B: A12 + B4 = 36 + 4 = 40 beats A8 + B8 = 24 + 8 = 32 and A4 + B8 = 20; B keeps its minimum of 4
    jobs = [Job("a", priority=3), Job("b", priority=1, min_gpus=4)]
    choices = {"a": _opts(g4=4, g8=8, g12=12), "b": _opts(g4=4, g8=8)}
    assert _gpus(allocate(jobs, choices, 16)) == {"a": 12, "b": 4}


def test_poor_scaling_gives_the_gpus_to_the_job_that_uses_them() -> None:
    # A doubles its GPUs for 25% more: 2 x 10 + 8 = 28 < 2 x 8 + 16 = 32, so B gets 16 despite its lower priority
    jobs = [Job("a", priority=2), Job("b", priority=1)]
    choices = {"a": _opts(g8=8, g16=10), "b": _opts(g8=8, g16=16)}
    assert _gpus(allocate(jobs, choices, 24)) == {"a": 8, "b": 16}


def test_a_job_whose_minimum_does_not_fit_waits_and_the_higher_priority_runs() -> None:
    jobs = [Job("low", priority=1, min_gpus=8), Job("high", priority=2, min_gpus=8)]
    choices = {"low": _opts(g8=100.0), "high": _opts(g8=1.0)}  # admission comes before throughput
    assert _gpus(allocate(jobs, choices, 8)) == {"low": 0, "high": 8}


def test_counts_are_powers_of_two_below_a_node_then_whole_nodes() -> None:
    assert counts(Job("x", min_gpus=2, max_gpus=24), 64, 8) == [2, 4, 8, 16, 24]
    assert counts(Job("x"), 16, 8) == [1, 2, 4, 8, 16]


GPT = ["--model.n_layer=24", "--model.d_model=2048", "--model.n_head=16", "--model.seq_len=2048",
       "--model.vocab_size=51200", "--train.global_batch_size=64", "--train.micro_batch_size=4",
       "--train.precision=bf16"]


def _jobs_file(tmp: Path, jobs: list[dict]) -> Path:
    lines = []
    for job in jobs:
        lines.append("[[job]]")
        lines += [f"{k} = {v!r}" if not isinstance(v, list) else f"{k} = {v!r}".replace("'", '"')
                  for k, v in job.items()]
    path = tmp / "jobs.toml"
    path.write_text("\n".join(lines).replace("'", '"') + "\n")
    return path


def _rows(out: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in out.splitlines()[1:-1]}


def test_pool_of_32_gpus_split_by_hand(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # Three jobs of one model. Every minimum fits (fixed 8, small 8, big 1), so all run; fixed has exactly 8; the 16
    # left go where priority x throughput grows most: to big (priority 4 against small's 1) up to its maximum of 16,
    # small keeping its 8. Nothing is left over: 16 + 8 + 8 = 32.
    path = _jobs_file(tmp_path, [{"name": "big", "priority": 4, "max_gpus": 16, "overrides": GPT},
                                 {"name": "small", "priority": 1, "min_gpus": 8, "overrides": GPT},
                                 {"name": "fixed", "priority": 2, "gpus": 8, "overrides": GPT}])
    assert main(["plan", "--hardware", "a100-80gb", "--gpus", "32", "--jobs", str(path)]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert {name: int(row[2]) for name, row in rows.items()} == {"big": 16, "small": 8, "fixed": 8}, out
    assert out.splitlines()[0].split()[:4] == ["job", "priority", "GPUs", "layout"] and "scaling eff." in out
    assert "32 of 32 GPUs allocated" in out
    # "this queue grants me 16 GPUs: which layout?" is one job with gpus = 16: the planner's preferred layout at 16
    path = _jobs_file(tmp_path, [{"name": "granted", "gpus": 16, "overrides": GPT}])
    assert main(["plan", "--hardware", "a100-80gb", "--gpus", "64", "--jobs", str(path)]) == 0
    granted = _rows(capsys.readouterr().out)["granted"]
    assert granted[2] == "16" and "dp=16" in " ".join(granted) and granted[3:] == rows["big"][3:]


def test_bad_jobs_files_are_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        read_jobs(tmp_path / "none.toml")
    (tmp_path / "j.toml").write_text('[[job]]\nname = "a"\nmax_gpu = 3\n')
    with pytest.raises(ConfigError, match="unknown keys"):
        read_jobs(tmp_path / "j.toml")
    (tmp_path / "j.toml").write_text('[[job]]\nname = "a"\nmin_gpus = 4\nmax_gpus = 2\n')
    with pytest.raises(ConfigError, match="min_gpus <= max_gpus"):
        read_jobs(tmp_path / "j.toml")
