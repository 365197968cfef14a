"""The simulator against measured plait runs on this machine; JSON with the errors (MAPE, Spearman, planner).

    .venv/bin/python bench/simulate.py [--profile PATH | --quick] [--steps N] [--only NAME,...] [--reuse]
                                       [--max-wait SECONDS] [--predict-only MEASURED_JSON]

1. Calibrates this machine (``plait calibrate``; ``--quick`` for the coarse one) unless ``--profile`` is given.
2. For each layout (world 1-4: data parallel, ZeRO 1-3, tp=2, pp=2 with each schedule, 2-D mixes), waits
   until the machine is quiet (1-minute load below ``MAX_LOAD`` and no other Python process computing;
   at most ``--max-wait`` seconds, after which it measures anyway and records the load it saw),
   runs ``plait train`` for ``--steps`` steps and compares ``plait simulate --compare`` with it: step time
   (median of the logged steps after the first 20%), model-state bytes per rank (the trainer's own
   measurement). It also measures each rank's activation memory in spawned ranks running the same
   trainer: the peak of the live bytes autograd saved for backward during one step (parameters excluded).
3. ``plait plan`` on the calibrated profile for 4 devices: its pick is measured too and compared with the
   best measured world-4 layout.

A probe (a small GPT at world 1, one thread) is timed right after calibrating and before and after each
measured run: each layout reports ``probe_vs_calibration`` (how much slower the machine ran than when it was
calibrated) and, as a diagnostic only, its step error with the prediction scaled by that ratio.

Output: per layout predicted / measured / error, the median absolute percentage error of step time per
world size and for worlds 1-2 and 3-4 (the targets: 10% and 20%), model-state and activation memory
errors, Spearman of the ranking by step time, the planner's pick against the best measured world-4
layout, and the machine load seen before each measurement.

``--predict-only MEASURED_JSON`` measures nothing: it predicts every layout of a previous run's JSON output
again (with its profile unless ``--profile`` is given) against the step times, activation peaks and
planner pick that run measured, so the model can be iterated on without the noise of a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import weakref
from pathlib import Path

from _common import SRC, spawn_group  # noqa: F401 - puts src on the path

ROOT = Path(__file__).resolve().parents[1]
MAX_LOAD = 0.7
MODEL = ["--model.n_layer=4", "--model.d_model=128", "--model.n_head=4", "--model.seq_len=128"]
RUN = ["--train.eval_every=0", "--checkpoint.every=0", "--observe.progress=false", "--observe.trackers=[]",
       "--train.log_every=1", "--optim.warmup_steps=1"]
B32 = ["--train.global_batch_size=32", "--train.micro_batch_size=8"]
PP = ["--parallel.pp=2", "--parallel.microbatches=4"]
# --quick: one layout per world band with the pipeline and tensor paths (activation peaks per stage), three
# for the Spearman ranking, a world-4 one for the planner's comparison.
QUICK_LAYOUTS = ("w1", "w2-pp2-1f1b", "w4-dp2-tp2")
LAYOUTS = {
    "w1": ["--parallel.nproc=1", *B32],
    "w2-dp": ["--parallel.nproc=2", *B32],
    "w2-zero1": ["--parallel.nproc=2", "--parallel.zero=1", *B32],
    "w2-zero2": ["--parallel.nproc=2", "--parallel.zero=2", *B32],
    "w2-zero3": ["--parallel.nproc=2", "--parallel.zero=3", *B32],
    "w2-tp2": ["--parallel.nproc=2", "--parallel.tp=2", *B32],
    "w2-pp2-gpipe": ["--parallel.nproc=2", *PP, "--parallel.pp_schedule=gpipe", *B32],
    "w2-pp2-1f1b": ["--parallel.nproc=2", *PP, "--parallel.pp_schedule=1f1b", *B32],
    "w2-pp2-interleaved": ["--parallel.nproc=2", *PP, "--parallel.pp_schedule=interleaved", *B32],
    "w2-pp2-zbv": ["--parallel.nproc=2", *PP, "--parallel.pp_schedule=zbv", *B32],
    "w3-dp": ["--parallel.nproc=3", "--train.global_batch_size=48", "--train.micro_batch_size=8"],
    "w4-dp": ["--parallel.nproc=4", *B32],
    "w4-dp2-tp2": ["--parallel.nproc=4", "--parallel.tp=2", *B32],
    "w4-dp2-pp2": ["--parallel.nproc=4", *PP, *B32],
}


# -- a quiet machine ------------------------------------------------------------------------------------
def _foreign_python() -> int:
    """Python processes computing that are not this benchmark or its children."""
    mine = {os.getpid()}
    busy = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) in mine:
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = (proc / "stat").read_text().split()
        except OSError:
            continue
        if "python" in cmd and "bench/simulate.py" not in cmd and stat[2] == "R":
            busy += 1
    return busy


def wait_quiet(log: list, what: str, timeout_s: float = 4 * 3600) -> float:
    """Wait until the 1-minute load is below ``MAX_LOAD`` and no other Python process runs; returns the load."""
    start = time.time()
    while True:
        load = float(Path("/proc/loadavg").read_text().split()[0])
        if load < MAX_LOAD and _foreign_python() == 0:
            log.append({"before": what, "load": load, "waited_s": round(time.time() - start)})
            return load
        if time.time() - start > timeout_s:
            log.append({"before": what, "load": load, "waited_s": round(time.time() - start), "quiet": False})
            return load
        time.sleep(15)


# -- measurements ---------------------------------------------------------------------------------------
def probe() -> float:
    """The machine's speed now: the median step of the calibration's tiny GPT widened to d_model 96 and
    sequence 96 (compute-bound: repeated probes agree within about 5%, the d=32 run's within 20%) at world
    1, one thread (about 6 s with its start). Taken right after calibrating and before and
    after each measured run, it shows how far the machine drifted from the speed it was calibrated at (a
    shared or virtual machine's speed moves with its neighbours). ``step_error_at_probed_speed`` scales the
    prediction by that ratio: a diagnostic of how much of an error is drift, never the reported error."""
    from plait.plan.calibrate_paths import TINY, WORLD1, measure_step, one_thread
    from plait.recipes import build_trainer

    with one_thread():
        return measure_step(TINY + ["--model.d_model=96", "--model.seq_len=96"] + WORLD1, build_trainer=build_trainer)


def run_train(name: str, overrides: list[str], steps: int, out_dir: Path) -> Path:
    run_dir = out_dir / name
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    cmd = [sys.executable, "-m", "plait.cli", "train", *MODEL, *RUN, f"--train.steps={steps}", *overrides,
           f"--run.dir={run_dir}"]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    return run_dir


class LiveSaved:
    """Peak bytes of tensors autograd holds for backward, counted by storage. Parameters and views of them
    (a linear keeps ``weight.t()``; nn.Parameter covers FSDP2's gathered and DTensor parameters too) are
    excluded; a pipeline stage's received input, a leaf that requires grad, is an activation and counts."""

    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}
        self.bytes = self.peak = 0

    def _release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.bytes -= entry[0]
            del self.live[ptr]

    def pack(self, t):  # noqa: ANN001, ANN201 - autograd's hook signature
        import torch

        if not isinstance(t, torch.Tensor) or isinstance(t, torch.nn.Parameter) \
                or isinstance(t._base, torch.nn.Parameter):
            return t
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0:
            return t
        holder = _Holder(t)
        entry = self.live.setdefault(ptr, [storage.nbytes(), 0])
        if entry[1] == 0:
            self.bytes += entry[0]
            self.peak = max(self.peak, self.bytes)
        entry[1] += 1
        weakref.finalize(holder, self._release, ptr)
        return holder

    @staticmethod
    def unpack(h):  # noqa: ANN001, ANN205
        return h.t if isinstance(h, _Holder) else h


class _Holder:
    def __init__(self, t) -> None:  # noqa: ANN001
        self.t = t


def _activation_worker(rank: int, world: int, overrides: list[str], run_dir: str) -> dict:
    import torch
    from _common import make_trainer

    trainer = make_trainer(MODEL + overrides + ["--checkpoint.every=0"], Path(run_dir), world)
    trainer.train_step()
    trainer.train_step()
    live = LiveSaved()
    with torch.autograd.graph.saved_tensors_hooks(live.pack, live.unpack):
        trainer.train_step()
    return {"activation_peak": live.peak, "model_states": trainer.memory}


def measure_activations(name: str, overrides: list[str], out_dir: Path) -> list[dict]:
    world = int(next(o for o in overrides if o.startswith("--parallel.nproc=")).split("=")[1])
    return spawn_group(_activation_worker, world, overrides, str(out_dir / f"{name}-act"), name=name)


# -- comparison -----------------------------------------------------------------------------------------
def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for pos, i in enumerate(order):
            r[i] = float(pos)
        return r

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry, strict=True)) / (n * (n * n - 1))


def simulate_run(name: str, overrides: list[str], profile: object, run_dir: Path) -> dict:
    from plait.plan.compare import compare_run
    from plait.plan.configured import simulate_config
    from plait.recipes import load_recipe_config

    cfg = load_recipe_config(None, MODEL + RUN + overrides)
    os.environ.pop("OMP_NUM_THREADS", None)
    sim = simulate_config(cfg, profile)
    return {"sim": sim, "compare": compare_run(sim, run_dir)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", help="a calibrated profile (default: calibrate now)")
    ap.add_argument("--quick", action="store_true",
                    help=f"coarse calibration, 12 steps per run, layouts {','.join(QUICK_LAYOUTS)} and the planner's "
                         "pick, no waiting for a quiet machine: checks that it runs")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--only", default="", help="comma-separated layout names")
    ap.add_argument("--max-wait", type=float, default=4 * 3600,
                    help="seconds to wait for a quiet machine before each measurement (then measure anyway)")
    ap.add_argument("--reuse", action="store_true",
                    help="re-simulate the runs and activation measurements a previous invocation left")
    ap.add_argument("--predict-only", metavar="MEASURED_JSON",
                    help="measure nothing: predict again against a previous run's JSON output")
    if ap.parse_args().quick:
        ap.set_defaults(max_wait=0.0)  # quick figures are not timings worth waiting for; --max-wait still wins
    args = ap.parse_args()
    from plait.plan.hardware import load_profile

    if args.predict_only:
        print(json.dumps(predict_only(Path(args.predict_only), args.profile, args.only), indent=1))
        return

    out_dir = Path("/tmp/plait-bench-simulate")
    out_dir.mkdir(parents=True, exist_ok=True)
    loads: list = []
    profile_path = args.profile
    if not profile_path:
        wait_quiet(loads, "calibrate", args.max_wait)
        from plait.plan.calibrate import calibrate
        from plait.recipes import build_trainer

        profile_path = str(calibrate(out_dir / "profile.toml", quick=args.quick,
                                     log=lambda s: print(s, file=sys.stderr), build_trainer=build_trainer))
    profile = load_profile(profile_path)
    steps = 12 if args.quick else args.steps
    only = args.only.split(",") if args.only else QUICK_LAYOUTS if args.quick else []
    names = [n for n in LAYOUTS if not only or n in only]
    rows = {}
    reference = probe() if not args.reuse else None  # the machine's speed right after calibrating
    for name in names:
        overrides = LAYOUTS[name]
        run_dir, act_file = out_dir / name, out_dir / f"{name}-act.json"
        if not (args.reuse and (run_dir / "summary.json").is_file()):
            wait_quiet(loads, name, args.max_wait)  # timings need a quiet machine; memory does not
            speed = probe()
            run_dir = run_train(name, overrides, steps, out_dir)
            (out_dir / f"{name}-probe.json").write_text(json.dumps({"before": speed, "after": probe()}))
            act_file.unlink(missing_ok=True)
        if not act_file.is_file():
            act_file.write_text(json.dumps(measure_activations(name, overrides, out_dir)))
        res = simulate_run(name, overrides, profile, run_dir)
        acts = json.loads(act_file.read_text())
        sim, cmp = res["sim"], res["compare"]
        per_pp = sim.work.layout.dp * sim.work.layout.tp
        act_err = [(sim.memory[r // per_pp].activations - a["activation_peak"]) / a["activation_peak"]
                   for r, a in enumerate(acts)]
        rows[name] = {"world": sim.world, "predicted_step_s": sim.step_s, "measured_step_s": cmp["step_s"]["measured"],
                      "step_error": cmp["step_s"]["error"],
                      "model_state_error": [e["error"] for e in cmp.get("model_state_bytes", [])],
                      "activation_predicted": [int(sim.memory[r // per_pp].activations) for r in range(len(acts))],
                      "activation_measured": [a["activation_peak"] for a in acts],
                      "activation_error": [round(e, 4) for e in act_err]}
        probe_file = out_dir / f"{name}-probe.json"
        if reference and probe_file.is_file():
            seen = json.loads(probe_file.read_text())
            slower = statistics.mean([seen["before"], seen["after"]]) / reference
            rows[name]["probe_vs_calibration"] = round(slower, 3)
            rows[name]["step_error_at_probed_speed"] = round(sim.step_s * slower / cmp["step_s"]["measured"] - 1, 4)
        print(json.dumps({name: rows[name]}), file=sys.stderr)
    result = summarise(rows, loads, profile_path)
    if reference:
        result["probe_reference_s"] = round(reference, 5)
        result["probe_vs_calibration_range"] = [min(r.get("probe_vs_calibration", 1.0) for r in rows.values()),
                                                max(r.get("probe_vs_calibration", 1.0) for r in rows.values())]
        adjusted = {}
        for r in rows.values():
            if "step_error_at_probed_speed" in r:
                band = "1-2" if r["world"] <= 2 else "3-4"
                adjusted.setdefault(band, []).append(abs(r["step_error_at_probed_speed"]))
        result["diagnostic_step_mape_at_probed_speed"] = {b: round(statistics.median(v), 4)
                                                          for b, v in sorted(adjusted.items())}
    if not args.only:
        result["planner"] = planner_pick(profile, rows, loads, steps, out_dir, args.reuse, args.max_wait)
    print(json.dumps(result, indent=1))


def predict_only(measured_json: Path, profile_path: str | None, only: str) -> dict:
    """Predictions of the current model against the measurements a previous run saved (see the docstring)."""
    from plait.plan.configured import simulate_config
    from plait.plan.hardware import load_profile
    from plait.recipes import load_recipe_config

    old = json.loads(measured_json.read_text())
    profile_path = profile_path or old["profile"]
    profile = load_profile(profile_path)
    os.environ.pop("OMP_NUM_THREADS", None)
    rows, described = {}, {}
    for name, was in old["layouts"].items():
        if only and name not in only.split(","):
            continue
        sim = simulate_config(load_recipe_config(None, MODEL + RUN + LAYOUTS[name]), profile)
        per_pp = sim.work.layout.dp * sim.work.layout.tp
        described[sim.work.layout.describe()] = was["measured_step_s"] if sim.world == 4 else None
        acts = [int(sim.memory[r // per_pp].activations) for r in range(len(was["activation_measured"]))]
        meas = was["measured_step_s"]
        rows[name] = {"world": sim.world, "predicted_step_s": sim.step_s, "measured_step_s": meas,
                      "step_error": round((sim.step_s - meas) / meas, 4),
                      "model_state_error": was["model_state_error"], "activation_predicted": acts,
                      "activation_measured": was["activation_measured"],
                      "activation_error": [round((p - m) / m, 4) for p, m in zip(acts, was["activation_measured"],
                                                                                   strict=True)]}
    result = summarise(rows, [{"predict_only": str(measured_json)}], profile_path)
    if not only and "planner" in old:
        result["planner"] = planner_predicted(profile, described, old["planner"])
    return result


def planner_predicted(profile: object, described: dict, old: dict) -> dict:
    """The planner's pick now, measured only when it is a layout the previous run measured."""
    from plait.plan.planner import plan
    from plait.plan.record import optimizer_traffic, shape_from_config
    from plait.plan.workload import Layout, Workload
    from plait.recipes import load_recipe_config

    cfg = load_recipe_config(None, MODEL + B32)
    shape = shape_from_config(cfg)
    result = plan(shape, profile, 4, 32, base=Workload(shape, Layout(), 32), top=5, traffic=optimizer_traffic(cfg))
    pick = result.best.work.layout.describe()
    measured = {**described, old["pick"]: old["pick_measured_s"]}.get(pick)
    best = old["best_measured_s"]
    return {"pick": pick, "pick_predicted_s": result.best.step_s, "pick_measured_s": measured,
            "best_measured_world4": old["best_measured_world4"], "best_measured_s": best,
            "pick_vs_best": round(measured / min(best, measured) - 1, 4) if measured else None,
            "ranked": [s.work.layout.describe() for s in result.ranked]}


def layout_overrides(lay: object, batch: int) -> list[str]:
    """``plait train`` overrides that run a planner's layout."""
    out = [f"--parallel.nproc={lay.world}", f"--parallel.tp={lay.tp}", f"--parallel.pp={lay.pp}",
           f"--parallel.zero={lay.zero}", f"--parallel.sequence_parallel={str(lay.sp).lower()}",
           f"--train.global_batch_size={batch}", f"--train.micro_batch_size={lay.micro_batch_size}",
           f"--train.activation_checkpointing={'full' if lay.recompute == 'full' else 'none'}"]
    if lay.pp > 1:
        out += [f"--parallel.pp_schedule={lay.schedule}", f"--parallel.microbatches={lay.microbatches}",
                f"--parallel.pp_virtual_stages={lay.virtual if lay.schedule in ('interleaved', 'zbv') else 0}"]
    return out


def planner_pick(profile: object, rows: dict, loads: list, steps: int, out_dir: Path, reuse: bool,
                 max_wait: float) -> dict:
    """``plait plan`` for 4 devices: its pick measured against the best measured world-4 layout."""
    from plait.plan.planner import plan
    from plait.plan.record import optimizer_traffic, shape_from_config
    from plait.plan.workload import Layout, Workload
    from plait.recipes import load_recipe_config

    cfg = load_recipe_config(None, MODEL + B32)
    shape = shape_from_config(cfg)
    result = plan(shape, profile, 4, 32, base=Workload(shape, Layout(), 32), top=5, traffic=optimizer_traffic(cfg))
    pick = result.best.work.layout
    overrides = layout_overrides(pick, 32)
    run_dir = out_dir / "planner-pick"
    if not (reuse and (run_dir / "summary.json").is_file() and (run_dir / "overrides.json").is_file()
            and json.loads((run_dir / "overrides.json").read_text()) == overrides):
        wait_quiet(loads, "planner pick", max_wait)
        run_dir = run_train("planner-pick", overrides, steps, out_dir)
        (run_dir / "overrides.json").write_text(json.dumps(overrides))
    measured = simulate_run("planner-pick", overrides, profile, run_dir)["compare"]["step_s"]["measured"]
    world4 = {n: r["measured_step_s"] for n, r in rows.items() if r["world"] == 4}
    best = min(world4.values()) if world4 else measured
    return {"pick": pick.describe(), "pick_predicted_s": result.best.step_s, "pick_measured_s": measured,
            "best_measured_world4": min(world4, key=world4.get) if world4 else None, "best_measured_s": best,
            "pick_vs_best": round(measured / min(best, measured) - 1, 4),
            "ranked": [s.work.layout.describe() for s in result.ranked]}


def summarise(rows: dict, loads: list, profile_path: str) -> dict:
    by_world: dict[str, list[float]] = {}
    by_band: dict[str, list[float]] = {}
    for r in rows.values():
        by_world.setdefault(str(r["world"]), []).append(abs(r["step_error"]))
        by_band.setdefault("1-2" if r["world"] <= 2 else "3-4", []).append(abs(r["step_error"]))
    names = list(rows)
    pred = [rows[n]["predicted_step_s"] for n in names]
    meas = [rows[n]["measured_step_s"] for n in names]
    return {"profile": profile_path, "layouts": rows,
            "step_mape_by_world": {w: round(statistics.median(v), 4) for w, v in sorted(by_world.items())},
            "step_mape_worlds": {b: round(statistics.median(v), 4) for b, v in sorted(by_band.items())},
            "step_mape_targets": {"1-2": 0.10, "3-4": 0.20},
            "model_state_max_error": max((abs(e) for r in rows.values() for e in r["model_state_error"]), default=None),
            "activation_max_error": max((abs(e) for r in rows.values() for e in r["activation_error"]), default=None),
            "spearman": round(spearman(pred, meas), 4) if len(names) > 2 else None, "loads": loads}


if __name__ == "__main__":
    main()
