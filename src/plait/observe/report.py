"""``plait report RUN_DIR [RUN_DIR ...] [-o report.html]``: one self-contained HTML page per report.

The page holds a bottleneck verdict per run at the top (``plait.observe.verdict``), then the figures
(``plait.observe.figures``): loss, learning rate, gradient norm, throughput, the step-time breakdown,
communication, per-rank heat maps, memory predicted against measured, the pipeline timeline, whatever
else the runs recorded, and, for runs of different world sizes, a scaling table and plot. Figures are
inline SVG and the styles inline CSS; the page loads nothing, runs no script and opens offline.

A run without metrics yet gives a partial report that says so; unreadable lines are skipped and counted.
"""

from __future__ import annotations

import html
import importlib.util
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.config import ConfigError
from plait.observe.runs import Run, load_run
from plait.observe.verdict import NAMES, Verdict, bottleneck

INSTALL_HINT = "pip install 'plait[report]'"
# summary.json keys the fixed sections show; any other is listed under "also recorded".
SHOWN_SUMMARY = {"final_train_loss", "final_val_loss", "final_val_accuracy", "steps", "tokens_per_s",
                 "samples_per_s", "total_seconds", "world_size", "dp", "skipped_steps", "num_params", "precision",
                 "zero", "loss", "memory", "comm", "pipeline"}
_CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:0 auto;max-width:1180px;padding:0 18px 40px;
color:#222}
h1{font-size:22px;margin:18px 0 2px}h2{font-size:17px;margin:26px 0 8px;border-bottom:1px solid #ddd;padding-bottom:3px}
.meta{color:#666;margin:0 0 12px}
.verdict{border-left:5px solid #c44e52;background:#fbf3f3;padding:8px 14px;margin:8px 0}
.verdict[data-bound=compute]{border-color:#55a868;background:#f2f8f3}.verdict[data-bound=unknown]{border-color:#999;
background:#f5f5f5}.verdict h3{margin:2px 0 4px;font-size:16px}.verdict p{margin:3px 0}
.notes{background:#fff8e1;border-left:5px solid #e0a800;padding:6px 14px;margin:8px 0}
table{border-collapse:collapse;margin:6px 0 10px}td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
th{background:#f5f5f5}td:first-child,th:first-child,.recorded td{text-align:left}
.grid{display:flex;flex-wrap:wrap;gap:10px}figure{margin:6px 0}figure svg{max-width:100%;height:auto}
figcaption{color:#555;font-size:12px;max-width:700px}.absent{color:#777;font-style:italic}code{background:#f3f3f3;
padding:0 3px;border-radius:3px}
"""


def require_plotting() -> None:
    """Raise the one-line install hint when the plotting library is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError(f"the report needs matplotlib, which is not installed: {INSTALL_HINT}")


@dataclass
class Report:
    """What ``build_report`` made: the page, the runs, their verdicts and the ids of the figures drawn."""

    html: str
    runs: list[Run]
    verdicts: list[Verdict]
    figures: list[str]


def scaling_rows(runs: list[Run]) -> tuple[list[dict[str, Any]], str]:
    """One row per run, by world size: throughput, the linear ideal from the smallest world
    (throughput_base * world / world_base), speedup and efficiency (throughput / ideal). Tokens/s when
    every run has them, else samples/s."""
    unit = "tokens/s" if all(r.has_tokens for r in runs) else "samples/s"
    ordered = sorted(runs, key=lambda r: r.world_size)
    base = ordered[0]
    base_thr = base.throughput(unit)[0]
    rows = []
    for run in ordered:
        thr = run.throughput(unit)[0]
        ideal = base_thr * run.world_size / base.world_size
        rows.append({"run": run.name, "world_size": run.world_size, "throughput": thr, "ideal": ideal,
                     "speedup": thr / base_thr if base_thr else 0.0, "efficiency": thr / ideal if ideal else 0.0})
    return rows, unit


def _esc(value: Any) -> str:
    return html.escape(str(value))


def _code(text: str) -> str:
    """Escape, then show `backticked` config keys as code."""
    parts = _esc(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


def _table(head: list[str], rows: list[list[Any]], cls: str = "") -> str:
    cls_attr = f' class="{cls}"' if cls else ""
    out = [f"<table{cls_attr}><tr>" + "".join(f"<th>{_esc(h)}</th>" for h in head) + "</tr>"]
    out += ["<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in row) + "</tr>" for row in rows]
    return "".join(out) + "</table>"


def _fmt(value: Any, spec: str = ",.4g") -> str:
    return format(value, spec) if isinstance(value, int | float) and not isinstance(value, bool) else "-"


def _verdict_html(run: Run, v: Verdict, several: bool) -> str:
    who = f"{_esc(run.name)}: " if several else ""
    shares = [[NAMES.get(k, k), f"{s:.1%}"] for k, s in sorted(v.shares.items(), key=lambda kv: -kv[1]) if s > 0]
    step = f" (steady-state step {v.detail['step_ms']:.1f} ms)" if "step_ms" in v.detail else ""
    return (f'<div class="verdict" data-bound="{v.bound}" data-run="{_esc(run.name)}"><h3>{who}{_esc(v.headline)}'
            f'</h3><p><b>Suggestion:</b> {_code(v.suggestion)}</p><p><b>Why:</b> {_code(v.reason)}{step}.</p>'
            + (_table(["part of the step", "share"], shares) if shares else "") + "</div>")


def _runs_table(runs: list[Run]) -> str:
    rows = []
    for run in runs:
        s, (thr, unit) = run.summary, run.throughput()
        layout = ", ".join(f"{k}={run.setting('parallel', k)}" for k, plain in (("tp", 1), ("pp", 1), ("zero", 0))
                           if run.setting("parallel", k, plain) != plain)
        last = run.steps[-1] if run.steps else {}
        rows.append([run.name, run.world_size, layout or "data parallel", s.get("steps", last.get("step", "-")),
                     _fmt(s.get("final_train_loss", last.get("loss"))), _fmt(s.get("final_val_loss")),
                     f"{thr:,.0f} {unit}" if thr else "-", _fmt(s.get("total_seconds"), ",.1f")])
    return _table(["run", "world", "layout", "steps", "train loss", "val loss", "throughput", "seconds"], rows)


class _Page:
    """Collects sections and the ids of the figures placed in them."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.figures: list[str] = []

    def section(self, anchor: str, title: str) -> None:
        self.parts.append(f'<h2 id="{anchor}">{_esc(title)}</h2>')

    def figure(self, fig_id: str, svg: str | None, caption: str, absent: str = "") -> None:
        if svg is None:
            if absent:
                self.parts.append(f'<p class="absent" data-absent="{fig_id}">{_code(absent)}</p>')
            return
        self.figures.append(fig_id)
        self.parts.append(f'<figure class="plot" id="{fig_id}">{svg}<figcaption>{_code(caption)}</figcaption>'
                          "</figure>")

    def html(self, text: str) -> None:
        self.parts.append(text)


def _figures(page: _Page, runs: list[Run]) -> None:
    from plait.observe import figures as F

    page.section("training", "Training")
    page.figure("fig-loss", F.loss_figure(runs), "Training loss at every logged step (mean over data-parallel "
                "ranks); validation loss dashed; dotted lines mark a resume at an earlier step.",
                "no loss logged yet")
    page.html('<div class="grid">')
    page.figure("fig-lr", F.series_figure(runs, "lr", "Learning rate", "lr"), "Learning rate.")
    page.figure("fig-grad-norm", F.series_figure(runs, "grad_norm", "Gradient norm", "norm"),
                "Global gradient norm before clipping.")
    tokens = all(r.has_tokens for r in runs)
    key, unit = ("tokens_per_s", "tokens/s") if tokens else ("samples_per_s", "samples/s")
    page.figure("fig-throughput", F.series_figure(runs, key, "Throughput", unit), f"Throughput ({unit}) per step.")
    page.html("</div>")
    page.section("step-time", "Where the step's time goes")
    page.figure("fig-step-time", F.step_time_figure(runs), "Data loading, forward, backward, exposed communication "
                "(waiting for gradients after backward) and the optimizer, per step (rank 0); other is the rest.",
                "no step timings logged yet")
    page.figure("fig-comm", F.comm_figure(runs), "Bytes rank 0 sends per step (its own collectives and those torch "
                "issues) and the time it waits in collectives.")
    page.section("ranks", "Ranks")
    for i, run in enumerate(runs):
        page.figure(f"fig-ranks-{i}", F.ranks_figure(run), f"{run.name}: every rank's step, gathered at log steps "
                    "(`rank_*` in metrics.jsonl). A slow device or input pipeline is a bright row on the left; every "
                    "rank waits in collectives for the slowest, so a straggler is the dark row on the right.",
                    f"{run.name}: no per-rank timings (recorded by plait's trainer at log steps since this version)")
    page.section("memory", "Memory")
    for i, run in enumerate(runs):
        page.figure(f"fig-memory-{i}", F.memory_figure(run), f"{run.name}: model-state bytes (parameters, gradients, "
                    "optimizer states) predicted by plait's memory model against measured on each rank; peak memory "
                    "per rank (allocated CUDA memory on a GPU; on CPU the process's resident set, which also holds "
                    "the interpreter and libraries).", f"{run.name}: no memory figures (they are in summary.json when "
                    "a run finishes)")
        setup = _setup_rows(run)
        if setup:
            page.html(f"<p>{_esc(run.name)}: peak memory of setup on each rank, measured against plait's prediction "
                      "(the whole model given on every rank, rank 0's weights broadcast, the layout applied). On CPU "
                      "the host peak is the resident set, interpreter included: compare the increase over setup. "
                      "MiB.</p>" + _table(["rank", "host peak", "increase", "predicted increase", "predicted peak "
                                           "(model bytes)", "device peak", "device increase"], setup, cls="setup"))
    timelines = {i: F.pipeline_figure(run) for i, run in enumerate(runs)}
    if any(timelines.values()):
        page.section("pipeline", "Pipeline")
    for i, run in enumerate(runs):
        svg = timelines[i]
        if svg is not None:
            page.figure(f"fig-pipeline-{i}", svg, f"{run.name}: every forward and backward of every micro-batch "
                        "on every pipeline rank in the last step (pipeline_trace.json; open it in Perfetto for "
                        "detail); idle gaps are the bubble.")


def _setup_rows(run: Run) -> list[list[str]]:
    """Per rank: the peak memory of setup measured (summary.json ``memory.setup``) and predicted, in MiB."""
    setup = (run.summary.get("memory") or {}).get("setup") or {}
    keys = ("host_peak_bytes", "host_increase_bytes", "predicted_increase_bytes", "predicted_peak_bytes",
            "device_peak_bytes", "device_increase_bytes")
    columns = [setup.get(k) or [] for k in keys]
    ranks = max((len(c) for c in columns), default=0)
    if not any(isinstance(v, int | float) for c in columns for v in c):
        return []
    mib = 2**20
    return [[str(r)] + [_fmt(c[r] / mib, ",.1f") if r < len(c) and isinstance(c[r], int | float) else "-"
                        for c in columns] for r in range(ranks)]


def _scaling(page: _Page, runs: list[Run]) -> None:
    from plait.observe.figures import scaling_figure

    if len(runs) < 2 or len({r.world_size for r in runs}) < 2:
        return
    rows, unit = scaling_rows(runs)
    page.section("scaling", "Scaling")
    page.html(_table(["run", "world size", f"throughput ({unit})", "linear", "speedup", "efficiency"],
                     [[r["run"], r["world_size"], f"{r['throughput']:,.1f}", f"{r['ideal']:,.1f}",
                       f"{r['speedup']:.2f}x", f"{r['efficiency']:.1%}"] for r in rows], cls="scaling"))
    page.figure("fig-scaling", scaling_figure(rows, unit), "Throughput against world size; linear is the "
                "smallest world's throughput times the world-size ratio; efficiency = measured / linear.")


def _more(page: _Page, runs: list[Run]) -> None:
    from plait.observe.figures import extra_figures, goodput_figure

    extras = extra_figures(runs)
    goodput = {i: goodput_figure(run) for i, run in enumerate(runs)}
    recorded = [[run.name, k, json.dumps(v)[:160]] for run in runs for k, v in run.summary.items()
                if k not in SHOWN_SUMMARY]
    events = []
    for run in runs:
        if run.failures:
            events.append([run.name, "restarts after a failure", run.failures])
        if run.resumed_at:
            events.append([run.name, "resumed from a checkpoint at step", ", ".join(map(str, run.resumed_at))])
        if run.rollbacks:
            events.append([run.name, "rolled back (spike step to checkpoint step)",
                           ", ".join(f"{a} to {b}" for a, b in run.rollbacks)])
    if not (extras or recorded or events or any(goodput.values())):
        return
    page.section("more", "Also recorded")
    for i, run in enumerate(runs):
        page.figure(f"fig-goodput-{i}", goodput[i], f"{run.name}: wall time spent on steps that ended in the final "
                    "model, and the time lost by cause (summary.json, from the run's goodput.jsonl ledger).")
    for key, svg in extras.items():
        page.figure(f"fig-extra-{key}", svg, f"{key} as the run recorded it in metrics.jsonl.")
    if recorded or events:
        page.html(_table(["run", "figure", "value"], events + recorded, cls="recorded"))


def build_report(run_dirs: list[str | Path]) -> Report:
    """Read the runs and make the page (raises ``ConfigError`` for a directory that is not a run)."""
    require_plotting()
    if not run_dirs:
        raise ConfigError("plait report needs at least one run directory: plait report RUN_DIR [RUN_DIR ...]")
    runs = [load_run(d) for d in run_dirs]
    if len({r.name for r in runs}) < len(runs):  # same directory name under different parents
        for r in runs:
            r.name = str(r.path)
    verdicts = [bottleneck(r) for r in runs]
    page = _Page()
    names = ", ".join(r.name for r in runs)
    page.html(f"<h1>plait report: {_esc(names)}</h1><p class=\"meta\">made {time.strftime('%Y-%m-%d %H:%M')} "
              f"from {len(runs)} run director{'y' if len(runs) == 1 else 'ies'}</p>")
    page.html('<section id="verdict">' + "".join(_verdict_html(r, v, len(runs) > 1) for r, v in zip(runs, verdicts,
                                                                                                     strict=True))
              + "</section>")
    notes = [f"{r.name}: {n}" if len(runs) > 1 else n for r in runs for n in r.notes]
    if notes:
        page.html('<div class="notes" id="notes">' + "".join(f"<p>{_esc(n)}</p>" for n in notes) + "</div>")
    page.html(_runs_table(runs))
    _figures(page, runs)
    _scaling(page, runs)
    _more(page, runs)
    body = "\n".join(page.parts)
    text = (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><meta name="viewport" '
            f'content="width=device-width,initial-scale=1"><title>plait report: {_esc(names)}</title>'
            f"<style>{_CSS}</style></head><body>\n{body}\n</body></html>\n")
    return Report(text, runs, verdicts, page.figures)


def default_output(run_dirs: list[str | Path]) -> Path:
    """RUN_DIR/report.html for one run; plait-report.html here for several."""
    return Path(run_dirs[0]) / "report.html" if len(run_dirs) == 1 else Path("plait-report.html")


def write_report(run_dirs: list[str | Path], out: str | Path | None = None) -> tuple[Path, Report]:
    """Make the report of ``run_dirs`` and write it to ``out`` (``default_output`` when None)."""
    report = build_report(run_dirs)
    path = Path(out) if out is not None else default_output(run_dirs)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report.html, encoding="utf-8")
    return path, report


def report_at_end(run_dir: Path, logger: Any) -> Path | None:
    """``observe.report = true``: the run's own report when it ends. The run has finished and saved by
    then, so a report that cannot be made is a warning, not a failed run."""
    try:
        path, report = write_report([run_dir], run_dir / "report.html")
    except Exception as e:  # noqa: BLE001 - the training result must survive a plotting failure
        logger.warning("report not written: %s", e)
        return None
    logger.info("report: %s (%s)", path, report.verdicts[0].headline)
    return path


def cli_report(argv: list[str]) -> int:
    """``plait report RUN_DIR [RUN_DIR ...] [-o report.html]``: write the page, print where and the verdicts."""
    import argparse

    ap = argparse.ArgumentParser(prog="plait report", description="An HTML report of one or more runs.")
    ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    ap.add_argument("-o", "--output", default=None, help="the HTML file (default: RUN_DIR/report.html for one "
                    "run, plait-report.html for several)")
    args = ap.parse_args(argv)
    path, report = write_report(args.run_dirs, args.output)
    lines = [f"plait: wrote {path} ({len(report.figures)} figures); open it in a browser: {path.resolve().as_uri()}"]
    for run, v in zip(report.runs, report.verdicts, strict=True):
        lines.append(f"  {run.name}: {v.headline}")
        lines.append(f"    suggestion: {v.suggestion}")
        lines.extend(f"    note: {n}" for n in run.notes)
    print("\n".join(lines))
    return 0
