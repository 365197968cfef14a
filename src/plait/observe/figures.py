"""The report's figures: matplotlib drawings of runs, rendered to inline SVG.

Every function takes runs (``plait.observe.runs.Run``) and returns the figure as an SVG string, or None
when the runs hold nothing to draw (a figure is absent, never empty). Several runs are overlaid, one
colour per run, where that reads well (lines over steps); per-rank heat maps, memory bars and pipeline
timelines are drawn per run. matplotlib's object API is used (no pyplot): no global figure state, no GUI
backend, and the SVG carries no external reference, so the page works offline.
"""

from __future__ import annotations

import io
import statistics
from typing import Any

from matplotlib import rc_context
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from plait.observe.runs import Run

MIB = 2**20
PHASES = (("data_s", "data", "#8c8c8c"), ("forward_s", "forward", "#4c72b0"), ("backward_s", "backward", "#55a868"),
          ("comm_exposed_s", "exposed communication", "#c44e52"), ("optimizer_s", "optimizer", "#dd8452"))
PIPE_COLOURS = {"F": "#4c72b0", "B": "#55a868", "I": "#64b5cd", "W": "#8172b3"}
# Keys the fixed figures draw (or that are not series: the straggler ranks named at a step); any other
# numeric metric is drawn under "also recorded".
DRAWN = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s", "step_s", "data_s", "forward_s",
         "backward_s", "comm_exposed_s", "optimizer_s", "comm_bytes", "comm_wait_s", "val_loss", "val_accuracy",
         "stragglers", "preempted"}
_STYLE = {"svg.fonttype": "none", "svg.hashsalt": "plait", "font.size": 9, "axes.grid": True, "grid.alpha": 0.3,
          "axes.spines.top": False, "axes.spines.right": False}


def colour(i: int) -> str:
    return f"C{i % 10}"


def _figure(width: float = 7.0, height: float = 3.0) -> Figure:
    return Figure(figsize=(width, height), layout="constrained")


def to_svg(fig: Figure) -> str:
    """The figure as an ``<svg>`` element (no XML prolog or doctype, so it can sit inside HTML)."""
    buf = io.StringIO()
    with rc_context(_STYLE):
        fig.savefig(buf, format="svg")
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _xy(records: list[dict[str, Any]], key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
    pairs = [(int(r["step"]), float(r[key]) * scale) for r in records if isinstance(r.get(key), int | float)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _legend(ax: Any, runs: list[Run]) -> None:
    if len(runs) > 1 or ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, frameon=False)


def loss_figure(runs: list[Run]) -> str | None:
    """Training loss per step (lines) and validation loss (dashed, with markers); dotted lines where a run
    resumed from a checkpoint, red dashed ones where it rolled back after a loss spike."""
    if not any(r.steps or r.evals for r in runs):
        return None
    with rc_context(_STYLE):
        fig = _figure()
        ax = fig.add_subplot()
        for i, run in enumerate(runs):
            label = f"{run.name}: " if len(runs) > 1 else ""
            ax.plot(*_xy(run.steps, "loss"), color=colour(i), lw=1.2, label=f"{label}train")
            if run.evals:
                ax.plot(*_xy(run.evals, "val_loss"), color=colour(i), ls="--", marker="o", ms=4,
                        label=f"{label}validation")
            for step in run.resumed_at:
                ax.axvline(step, color=colour(i), ls=":", lw=1)
            for j, (spike, back_to) in enumerate(run.rollbacks):
                ax.axvline(spike, color="#c44e52", ls="--", lw=1, label="rollback" if i == j == 0 else None)
                ax.annotate(f"to {back_to}", (spike, 1), xycoords=("data", "axes fraction"), fontsize=7,
                            color="#c44e52", ha="right", va="top", rotation=90)
        ax.set(xlabel="step", ylabel="loss", title="Loss")
        _legend(ax, runs)
        return to_svg(fig)


def series_figure(runs: list[Run], key: str, title: str, ylabel: str, scale: float = 1.0,
                  logy: bool = False) -> str | None:
    """One metric over steps, one line per run; None when no run logged ``key``."""
    if not any(isinstance(r.get(key), int | float) for run in runs for r in run.steps):
        return None
    with rc_context(_STYLE):
        fig = _figure(width=3.4, height=2.6)
        ax = fig.add_subplot()
        for i, run in enumerate(runs):
            ax.plot(*_xy(run.steps, key, scale), color=colour(i), lw=1.2, label=run.name)
        if logy:
            ax.set_yscale("log")
        ax.set(xlabel="step", ylabel=ylabel, title=title)
        if len(runs) > 1:
            ax.legend(fontsize=7, frameon=False)
        return to_svg(fig)


def step_time_figure(runs: list[Run]) -> str | None:
    """Where each step's milliseconds go: stacked over steps for one run; one stacked bar (steady-state
    mean) per run for several."""
    if not any(run.steps for run in runs):
        return None
    with rc_context(_STYLE):
        if len(runs) == 1:
            fig = _figure(height=3.2)
            ax = fig.add_subplot()
            steps = runs[0].steps
            xs = [int(r["step"]) for r in steps]
            parts = [[1e3 * float(r.get(k) or 0.0) for r in steps] for k, _, _ in PHASES]
            other = [max(0.0, 1e3 * float(r["step_s"]) - sum(p[j] for p in parts)) for j, r in enumerate(steps)]
            ax.stackplot(xs, *parts, other, labels=[n for _, n, _ in PHASES] + ["other"],
                         colors=[c for _, _, c in PHASES] + ["#dddddd"], alpha=0.9)
            ax.set(xlabel="step", ylabel="ms per step", title="Step time breakdown")
        else:
            fig = _figure(height=0.6 + 0.45 * len(runs))
            ax = fig.add_subplot()
            for i, run in enumerate(runs):
                steady = run.steady() or [{}]
                left = 0.0
                for k, name, c in PHASES:
                    width = 1e3 * statistics.fmean(float(r.get(k) or 0.0) for r in steady)
                    ax.barh(i, width, left=left, color=c, label=name if i == 0 else None)
                    left += width
                total = 1e3 * statistics.fmean(float(r.get("step_s") or 0.0) for r in steady)
                ax.barh(i, max(0.0, total - left), left=left, color="#dddddd", label="other" if i == 0 else None)
            ax.set_yticks(range(len(runs)), [r.name for r in runs])
            ax.set(xlabel="ms per step (steady-state mean)", title="Step time breakdown")
        ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        return to_svg(fig)


def comm_figure(runs: list[Run]) -> str | None:
    """Bytes this rank sends per step and the time it waits in collectives, one line per run."""
    if not any(isinstance(r.get("comm_bytes"), int | float) for run in runs for r in run.steps):
        return None
    with rc_context(_STYLE):
        fig = _figure(height=2.6)
        sent, wait = fig.subplots(1, 2)
        for i, run in enumerate(runs):
            sent.plot(*_xy(run.steps, "comm_bytes", 1 / MIB), color=colour(i), lw=1.2, label=run.name)
            wait.plot(*_xy(run.steps, "comm_wait_s", 1e3), color=colour(i), lw=1.2, label=run.name)
        sent.set(xlabel="step", ylabel="MiB sent per step (rank 0)", title="Communication volume", ylim=(0, None))
        wait.set(xlabel="step", ylabel="ms waiting in collectives", title="Communication wait", ylim=(0, None))
        sent.ticklabel_format(axis="y", useOffset=False)
        if len(runs) > 1:
            sent.legend(fontsize=7, frameon=False)
        return to_svg(fig)


def _rank_matrix(run: Run, *keys: str) -> tuple[list[int], list[list[float]]]:
    """Milliseconds of the sum of the ``rank_<key>`` lists, rank against logged step."""
    # Steady state only: the first step's warm-up would set the colour scale and hide the rest.
    rows = [r for r in run.steady() if all(isinstance(r.get(f"rank_{k}"), list) for k in keys)]
    if not rows:
        return [], []
    width = min(len(r[f"rank_{k}"]) for r in rows for k in keys)
    matrix = [[1e3 * sum(float(r[f"rank_{k}"][rank]) for k in keys) for r in rows] for rank in range(width)]
    return [int(r["step"]) for r in rows], matrix


def ranks_figure(run: Run) -> str | None:
    """Heat maps, rank against logged step: forward + backward + data time (a slow device or input
    pipeline is a bright row) and time waiting in collectives (everyone but the straggler waits for it,
    so a straggler is the dark row there). None without per-rank timings."""
    steps, busy = _rank_matrix(run, "compute_s", "data_s")
    _, waits = _rank_matrix(run, "comm_wait_s")
    if not steps:
        return None
    with rc_context(_STYLE):
        fig = _figure(height=1.2 + 0.35 * len(busy))
        axes = fig.subplots(1, 2, sharey=True)
        for ax, matrix, title in ((axes[0], busy, "forward + backward + data (ms)"),
                                  (axes[1], waits, "waiting in collectives (ms)")):
            image = ax.imshow(matrix, aspect="auto", cmap="magma", interpolation="nearest", vmin=0)
            fig.colorbar(image, ax=ax, shrink=0.9)
            every = max(1, -(-len(steps) // 6))  # columns are logged steps; label about six of them
            ax.set_xticks(range(0, len(steps), every), [str(s) for s in steps[::every]])
            ax.set(xlabel="step", title=title)
            ax.grid(False)
        axes[0].set_yticks(range(len(busy)), [f"rank {r}" for r in range(len(busy))])
        return to_svg(fig)


def memory_figure(run: Run) -> str | None:
    """Per rank: model-state bytes predicted against measured, and the peak; None without a summary."""
    mem = run.summary.get("memory") or {}
    predicted, measured = mem.get("predicted_model_state_bytes") or [], mem.get("measured_model_state_bytes") or []
    peak = mem.get("peak_bytes") or []
    if not (predicted or measured or peak):
        return None
    ranks = max(len(predicted), len(measured), len(peak))
    with rc_context(_STYLE):
        fig = _figure(height=2.6)
        state, peaks = fig.subplots(1, 2)
        xs = list(range(ranks))
        for offset, values, name, c in ((-0.2, predicted, "predicted", "#8c8c8c"), (0.2, measured, "measured",
                                                                                      "#4c72b0")):
            if not any(isinstance(v, int | float) for v in values):
                continue  # no prediction for tensor / pipeline layouts: leave the bar and its legend out
            ys = [float(v) / MIB if isinstance(v, int | float) else 0.0 for v in values]
            state.bar([x + offset for x in xs[:len(ys)]], ys, width=0.4, color=c, label=name)
        state.set_xticks(xs, [f"rank {r}" for r in xs])
        state.set(ylabel="MiB", title="Model state per rank")
        state.set_ylim(0, 1.3 * max(state.get_ylim()[1], 1e-9))  # room for the legend above the bars
        state.legend(fontsize=7, frameon=False, loc="upper center", ncol=2)
        peaks.bar(xs[:len(peak)], [float(v) / MIB for v in peak], width=0.5, color="#dd8452")
        peaks.set_xticks(xs, [f"rank {r}" for r in xs])
        peaks.set(ylabel="MiB", title="Peak memory per rank")
        return to_svg(fig)


def pipeline_figure(run: Run) -> str | None:
    """The pipeline timeline of the trace (one row per pipeline rank; F forward, B backward, I input
    gradient, W weight gradient) with each rank's measured bubble; None without a trace."""
    events = [e for e in (run.trace or {}).get("traceEvents", [])
              if e.get("ph") == "X" and e.get("cat") in PIPE_COLOURS and isinstance(e.get("ts"), int | float)]
    if not events:
        return None
    ranks = sorted({int(e.get("pid", 0)) for e in events})
    bubbles = {int(r["rank"]): r.get("bubble_measured") for r in (run.summary.get("pipeline") or {}).get("ranks", [])}
    with rc_context(_STYLE):
        fig = _figure(height=1.0 + 0.5 * len(ranks))
        ax = fig.add_subplot()
        for kind, c in PIPE_COLOURS.items():
            for row, rank in enumerate(ranks):
                spans = [(e["ts"] / 1e3, max(e.get("dur", 0.0), 1.0) / 1e3) for e in events
                         if e["cat"] == kind and int(e.get("pid", 0)) == rank]
                if spans:
                    ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=c, edgecolor="white", linewidth=0.3)
        labels = [f"rank {r}" + (f" (bubble {bubbles[r]:.0%})" if isinstance(bubbles.get(r), float) else "")
                  for r in ranks]
        ax.set_yticks(range(len(ranks)), labels)
        ax.invert_yaxis()
        theory = (run.summary.get("pipeline") or {}).get("bubble_theory")
        title = "Pipeline timeline (last step)" + (f", theory bubble {theory:.0%}" if isinstance(theory, float) else "")
        ax.set(xlabel="ms", title=title)
        drawn = sorted({e["cat"] for e in events}, key=list(PIPE_COLOURS).index)
        ax.legend([Patch(color=PIPE_COLOURS[k]) for k in drawn], drawn, fontsize=7, frameon=False,
                  loc="upper left", bbox_to_anchor=(1.0, 1.0))
        return to_svg(fig)


def scaling_figure(rows: list[dict[str, Any]], unit: str) -> str | None:
    """Throughput against world size with the linear ideal from the smallest world, and efficiency."""
    if len({r["world_size"] for r in rows}) < 2:
        return None
    with rc_context(_STYLE):
        fig = _figure(height=2.8)
        thr, eff = fig.subplots(1, 2)
        xs = [r["world_size"] for r in rows]
        thr.plot(xs, [r["throughput"] for r in rows], "o-", color="C0", label="measured")
        thr.plot(xs, [r["ideal"] for r in rows], "--", color="#8c8c8c", label="linear")
        thr.set(xlabel="world size", ylabel=unit, title="Throughput")
        thr.legend(fontsize=7, frameon=False)
        eff.plot(xs, [100 * r["efficiency"] for r in rows], "o-", color="C1")
        eff.axhline(100, color="#8c8c8c", ls="--")
        eff.set(xlabel="world size", ylabel="% of linear", title="Scaling efficiency", ylim=(0, None))
        for ax in (thr, eff):
            ax.set_xticks(sorted(set(xs)))
        return to_svg(fig)


def goodput_figure(run: Run) -> str | None:
    """Where the wall time went (summary.json's ``goodput``: useful step time and lost time by cause)."""
    g = run.summary.get("goodput")
    if not isinstance(g, dict) or not isinstance(g.get("useful_s"), int | float) or not isinstance(
            g.get("lost_s"), dict):
        return None
    parts = [("useful steps", float(g["useful_s"]))] + [(k.replace("_", " "), float(v)) for k, v in g["lost_s"].items()
                                                        if isinstance(v, int | float) and v > 0]
    with rc_context(_STYLE):
        fig = _figure(height=1.6)
        ax = fig.add_subplot()
        left = 0.0
        for j, (name, seconds) in enumerate(parts):
            ax.barh(0, seconds, left=left, color="#55a868" if j == 0 else colour(j + 2), label=name)
            left += seconds
        share = g.get("goodput")
        ax.set(xlabel="seconds of wall time", yticks=[], title=f"Goodput {share:.0%}" if isinstance(
            share, int | float) else "Goodput")
        ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        return to_svg(fig)


def extra_figures(runs: list[Run]) -> dict[str, str]:
    """What later layouts record, found by shape rather than by name: every numeric metric the fixed
    figures do not draw (goodput, staleness, ...) as a line over steps, and every list-valued one that is
    not per-rank (expert load, ...) as a heat map, index against step."""
    scalars: list[str] = []
    lists: list[str] = []
    for run in runs:
        for r in run.steps:
            for k, v in r.items():
                if k in DRAWN or k.startswith("rank_") or k in scalars or k in lists:
                    continue
                if isinstance(v, int | float) and not isinstance(v, bool):
                    scalars.append(k)
                elif isinstance(v, list) and v and all(isinstance(x, int | float) for x in v):
                    lists.append(k)
    out = {}
    for key in scalars:
        figure = series_figure(runs, key, key.replace("_", " "), key)
        if figure:
            out[key] = figure
    for key in lists:
        for i, run in enumerate(runs):
            rows = [r for r in run.steps if isinstance(r.get(key), list) and r[key]]
            if not rows or len({len(r[key]) for r in rows}) > 1:  # not one value per index at every step
                continue
            width = min(len(r[key]) for r in rows)
            with rc_context(_STYLE):
                fig = _figure(height=1.2 + 0.25 * width)
                ax = fig.add_subplot()
                matrix = [[float(r[key][j]) for r in rows] for j in range(width)]
                image = ax.imshow(matrix, aspect="auto", cmap="viridis", interpolation="nearest")
                fig.colorbar(image, ax=ax)
                every = max(1, -(-len(rows) // 6))
                ax.set_xticks(range(0, len(rows), every), [str(r["step"]) for r in rows[::every]])
                ax.set_yticks(range(width))
                ax.set(xlabel="step", ylabel="index", title=f"{key.replace('_', ' ')} ({run.name})")
                ax.grid(False)
                out[f"{key}-{i}"] = to_svg(fig)
    return out
