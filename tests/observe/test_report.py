"""The report without training: the bottleneck verdict on constructed metrics, and bad input.

Run directories are written by hand here (metrics.jsonl lines shaped as the trainer writes them), so each
bound can be made to hold exactly: a step of 100 ms whose parts are chosen per case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the report needs matplotlib: pip install 'plait[report]'")

from plait.config import ConfigError  # noqa: E402
from plait.observe.report import build_report, scaling_rows  # noqa: E402
from plait.observe.runs import load_run  # noqa: E402
from plait.observe.verdict import THRESHOLDS, bottleneck  # noqa: E402


def _record(step: int, *, data=0.005, compute=0.080, comm=0.005, optimizer=0.005, ranks=None, **extra) -> dict:
    """One logged step of 100 ms: forward is a third of compute, backward the rest, other the remainder."""
    rec = {"step": step, "loss": 5.0 - 0.01 * step, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0,
           "samples_per_s": 10.0, "step_s": 0.100, "data_s": data, "forward_s": compute / 3,
           "backward_s": compute * 2 / 3, "comm_exposed_s": comm, "optimizer_s": optimizer, "comm_bytes": 4 * 2**20,
           "comm_wait_s": comm}
    if ranks is not None:  # per-rank compute times: rank_compute_s etc. as the trainer gathers them
        rec.update(rank_step_s=[0.1] * len(ranks), rank_data_s=[data] * len(ranks), rank_compute_s=list(ranks),
                   rank_comm_exposed_s=[max(0.0, 0.1 - c - data - optimizer) for c in ranks],
                   rank_comm_wait_s=[comm + max(ranks) - c for c in ranks],  # the others wait for the slowest
                   rank_optimizer_s=[optimizer] * len(ranks))
    rec.update(extra)
    return rec


def _run(tmp: Path, name: str, records: list[dict], *, summary: dict | None = None, config: str = "",
         lines: list[str] | None = None) -> Path:
    d = tmp / name
    d.mkdir(parents=True)
    (d / "config.toml").write_text(config or "[train]\nsteps = 10\n")
    text = [json.dumps(r) for r in records] + (lines or [])
    (d / "metrics.jsonl").write_text("".join(t + "\n" for t in text))
    if summary is not None:
        (d / "summary.json").write_text(json.dumps(summary))
    return d


def _steps(n: int = 6, **kw) -> list[dict]:
    return [_record(s, **kw) for s in range(1, n + 1)]


PIPELINE = {"world_size": 2, "pipeline": {"num_ranks": 2, "microbatches": 4, "virtual_stages": 1, "bubble_theory": 0.2,
                                          "ranks": [{"rank": 0, "bubble_measured": 0.40},
                                                    {"rank": 1, "bubble_measured": 0.36}]}}


@pytest.mark.parametrize(("bound", "kw", "summary", "config", "share", "suggests"), [
    ("compute", {}, None, "", 0.80, "train.precision=bf16"),
    ("communication", {"compute": 0.050, "comm": 0.038}, None, "", 0.38, "comm.compress=powersgd"),
    ("communication", {"compute": 0.050, "comm": 0.038}, None, '[comm]\ncompress = "powersgd"\n', 0.38,
     "train.global_batch_size"),
    ("data", {"data": 0.030, "compute": 0.060}, None, "", 0.30, "data.num_workers=2"),
    ("optimizer", {"optimizer": 0.040, "compute": 0.050}, None, "", 0.40, "optim.fused=true"),
    ("bubble", {}, PIPELINE, "", 0.80 * 0.38, "parallel.microbatches` from 4 to 8"),
    ("straggler", {"ranks": [0.040, 0.040, 0.070, 0.040], "compute": 0.040, "comm": 0.035}, None, "", 0.30,
     "rank 2"),
])
def test_verdict_names_each_bound(tmp_path: Path, bound: str, kw: dict, summary: dict | None, config: str,
                                  share: float, suggests: str) -> None:
    run = load_run(_run(tmp_path, bound, _steps(**kw), summary=summary, config=config))
    v = bottleneck(run)
    assert v.bound == bound, (v.bound, v.shares)
    assert v.share == pytest.approx(share, abs=1e-6)
    assert suggests in v.suggestion, v.suggestion
    assert v.reason and f"{share:.0%}" in v.reason + v.headline
    if bound != "compute":
        assert v.share >= THRESHOLDS[bound]


def test_verdict_straggler_takes_communication_out_of_the_others_wait(tmp_path: Path) -> None:
    """Fast ranks wait for the slow one in the all-reduce: that wait is the straggler's, not the link's.
    Communication counts only what even the slowest rank waits (here 10 ms of 100)."""
    run = load_run(_run(tmp_path, "s", _steps(ranks=[0.045, 0.080], compute=0.045, comm=0.040)))
    v = bottleneck(run)
    assert v.bound == "straggler" and v.detail["straggler_rank"] == 1
    assert v.share == pytest.approx(0.035 / 0.1)
    assert v.shares["communication"] == pytest.approx((0.1 - 0.080 - 0.005 - 0.005) / 0.1)


def test_one_slow_step_is_not_a_straggler(tmp_path: Path) -> None:
    records = _steps(ranks=[0.080, 0.080])
    records[3] = _record(4, ranks=[0.080, 0.300])
    assert bottleneck(load_run(_run(tmp_path, "spike", records))).bound == "compute"


def test_bubble_suggests_interleaving_only_when_not_interleaved(tmp_path: Path) -> None:
    cfg = '[parallel]\npp_schedule = "interleaved"\nmicrobatches = 8\n'
    v = bottleneck(load_run(_run(tmp_path, "i", _steps(), summary=PIPELINE, config=cfg)))
    assert v.bound == "bubble" and "interleaved" not in v.suggestion


def test_not_a_run_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ConfigError, match="not a plait run directory"):
        build_report([tmp_path])
    with pytest.raises(ConfigError, match="does not exist"):
        build_report([tmp_path / "missing"])


def test_run_without_metrics_gives_a_partial_report(tmp_path: Path) -> None:
    d = tmp_path / "fresh"
    d.mkdir()
    (d / "config.toml").write_text("[train]\nsteps = 10\n")
    report = build_report([d])
    assert report.verdicts[0].bound == "unknown"
    assert "no metrics yet" in report.html and "partial" in report.html
    assert report.figures == []


def test_corrupt_metrics_line_is_skipped_and_counted(tmp_path: Path) -> None:
    d = _run(tmp_path, "bad", _steps(4), lines=['{"step": 5, "loss": 4.9, "lr"', "not json", "[1, 2]"])
    report = build_report([d])
    run = report.runs[0]
    assert len(run.steps) == 4 and run.bad_lines == [5, 6, 7]
    assert "3 line(s) could not be read and were skipped" in report.html
    assert "fig-loss" in report.figures


def test_resumed_run_keeps_the_latest_record_per_step(tmp_path: Path) -> None:
    records = _steps(6) + [_record(s, compute=0.070) for s in (5, 6, 7)]
    run = load_run(_run(tmp_path, "resumed", records))
    assert [r["step"] for r in run.steps] == [1, 2, 3, 4, 5, 6, 7] and run.resumed_at == [5]
    assert run.steps[4]["forward_s"] == pytest.approx(0.070 / 3)


def test_later_layouts_figures_present_when_recorded_absent_when_not(tmp_path: Path) -> None:
    """Goodput, staleness, expert load, restarts: drawn or listed when a run has them, and no error when not."""
    extra = [_record(s, goodput=0.9, ps_staleness=s % 3, expert_load=[0.2, 0.3, 0.5]) for s in range(1, 5)]
    d = _run(tmp_path, "extra", extra, summary={"world_size": 1, "restarts": 2, "goodput": {"fraction": 0.91}})
    report = build_report([d])
    for fig in ("fig-extra-goodput", "fig-extra-ps_staleness", "fig-extra-expert_load-0"):
        assert fig in report.figures
    assert "restarts" in report.html and "fraction" in report.html
    plain = build_report([_run(tmp_path, "plain", _steps(4))])
    assert not [f for f in plain.figures if f.startswith("fig-extra")] and 'id="more"' not in plain.html


def test_restarts_rollbacks_and_goodput_from_the_fault_ledger(tmp_path: Path) -> None:
    summary = {"world_size": 2, "rollbacks": 1, "goodput": {"goodput": 0.8, "wall_s": 10.0, "useful_s": 8.0,
                                                            "lost_s": {"restart": 1.5, "rolled_back_steps": 0.5}}}
    d = _run(tmp_path, "faults", _steps(8), summary=summary)
    ledger = [{"event": "failed", "t": 1.0}, {"event": "resume", "step": 4, "t": 2.0},
              {"event": "rollback", "from": 7, "to": 5, "t": 3.0}, "not json"]
    (d / "goodput.jsonl").write_text("\n".join(e if isinstance(e, str) else json.dumps(e) for e in ledger))
    report = build_report([d])
    run = report.runs[0]
    assert run.failures == 1 and run.resumed_at == [4] and run.rollbacks == [(7, 5)]
    assert "fig-goodput-0" in report.figures and "7 to 5" in report.html
    assert "restarts after a failure" in report.html and "rollback" in report.html


def test_scaling_rows_against_the_smallest_world(tmp_path: Path) -> None:
    runs = [load_run(_run(tmp_path, f"w{w}", _steps(3), summary={"world_size": w, "tokens_per_s": t}))
            for w, t in ((4, 3000.0), (1, 1000.0), (2, 1800.0))]
    rows, unit = scaling_rows(runs)
    assert unit == "tokens/s" and [r["world_size"] for r in rows] == [1, 2, 4]
    assert [r["efficiency"] for r in rows] == pytest.approx([1.0, 0.9, 0.75])


def test_without_matplotlib_the_error_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    import importlib.util
    import logging

    from plait.observe.report import report_at_end

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    d = _run(tmp_path, "r", _steps(3))
    with pytest.raises(ConfigError, match=r"pip install 'plait\[report\]'"):
        build_report([d])
    log = logging.getLogger("test-report")
    with caplog.at_level(logging.WARNING, logger="test-report"):
        assert report_at_end(d, log) is None  # a finished run is not failed by its report
    assert "plait[report]" in caplog.text and not (d / "report.html").exists()


def test_report_cli_bad_input_is_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "plait.cli", "report", str(tmp_path)], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "not a plait run directory" in p.stderr
