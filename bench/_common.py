"""Helpers shared by the benchmarks: trainers from overrides, groups of spawned ranks (``plait.runtime.spawn``),
process memory readings, and model-state sampling inside a step (``StatePeak`` and what each
implementation holds: plain modules and optimizers, plait's ZeRO buffers, FSDP2's internals, DDP's buckets).

The benchmarks run as scripts (``python bench/<name>.py``), so this module is imported as ``_common``
with ``bench/`` on the path; it puts the repository's ``src`` on the path itself, and spawned ranks
inherit that path.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

import torch  # noqa: E402

from plait.runtime.spawn import spawn_ranks  # noqa: E402

# Overrides every benchmark trainer shares: a long schedule (no decay effects), no I/O, no evaluation.
COMMON = ["--train.steps=100000", "--optim.warmup_steps=1", "--observe.progress=false",
          "--observe.trackers=[]", "--train.eval_every=0"]


def make_trainer(overrides: list[str], run_dir: Path, world: int) -> Any:
    """A ``Trainer`` from ``COMMON + overrides``, validated for ``world`` ranks, writing into ``run_dir``."""
    from plait.recipes import build_trainer, load_recipe_config
    from plait.recipes import validate_config as validate

    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = validate(load_recipe_config(overrides=COMMON + overrides + [f"--run.dir={run_dir}"]), world)
    return build_trainer(cfg)


def run_deepspeed_script(python: str, script: str, args: list[str]) -> dict | str:
    """Run ``bench/<script>`` under ``python`` (an interpreter with DeepSpeed, on CPU) and return the last
    JSON line it printed, or a one-line reason it did not run or failed (with the end of its output)."""
    import json
    import subprocess

    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    cmd = [python, str(Path(__file__).with_name(script)), *args]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"not run: {e}"
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        tail = [ln for ln in (done.stderr or done.stdout).strip().splitlines() if ln.strip()][-6:]
        return f"failed (exit {done.returncode}): {' | '.join(tail)}"
    return json.loads(lines[-1])


def machine_info() -> dict[str, str]:
    return {"backend": "gloo", "torch": torch.__version__,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores"}


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    """Current resident set size of this process (Linux /proc; 0 where unavailable)."""
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else 0


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (VmHWM, else getrusage's ru_maxrss)."""
    kib = _status_kib("VmHWM")
    if kib is None:
        import resource

        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to /proc/self/clear_refs); False if not possible,
    in which case the peak also covers what happened before (imports, process-group start-up)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def spawn_group(fn: Any, world: int, *args: Any, name: str = "group", timeout_s: float = 600) -> list[Any]:
    """``spawn_ranks`` with the benchmarks' limits: ``timeout_s`` for the whole group, 300 s per collective
    (a long measured run on a loaded machine); raises ``plait.runtime.spawn.SpawnError`` when a rank fails."""
    return spawn_ranks(fn, world, *args, timeout_s=timeout_s, pg_timeout_s=300, name=name)


class StatePeak:
    """Model-state bytes (parameters, gradients, optimizer states) sampled at named points of a step.

    ``sources()`` returns ``{"params": [...], "grads": [...], "optimizer": [...]}``, the tensors an
    implementation holds right now (``None`` entries are skipped). Each storage is counted once, in the
    first category that names it, as ``plait.plan.memory.measure_model_state_bytes`` counts, so flat
    buffers and the views into them, or a freed (resized-to-zero) unsharded parameter, count correctly.
    ``result()`` gives the largest total sampled, its breakdown and point, and every point's largest total.
    """

    CATEGORIES = ("params", "grads", "optimizer")

    def __init__(self, sources: Any) -> None:
        self.sources = sources
        self.points: dict[str, dict[str, int]] = {}

    def sample(self, point: str) -> None:
        from plait.observe.memory import _count

        seen: dict[int, int] = {}
        tensors = self.sources()
        rec = {k: _count([t for t in tensors.get(k, []) if t is not None], seen) for k in self.CATEGORIES}
        rec["total"] = sum(rec.values())
        best = self.points.get(point)
        rec["samples"] = (best["samples"] if best else 0) + 1
        if best is None or rec["total"] > best["total"]:
            self.points[point] = rec
        else:
            best["samples"] = rec["samples"]

    def hook_backward(self, params: Any) -> list[Any]:
        """Sample from a post-accumulate-grad hook on each of ``params`` (point ``"backward"``).

        Register after the implementation has registered its own hooks so ours fire after theirs; the
        handles are returned for removal."""
        return [p.register_post_accumulate_grad_hook(lambda _p: self.sample("backward"))
                for p in dict.fromkeys(params) if p.requires_grad]

    def result(self) -> dict[str, Any]:
        if not self.points:
            raise RuntimeError("StatePeak.result() before any sample")
        point, rec = max(self.points.items(), key=lambda kv: kv[1]["total"])
        return {**{k: rec[k] for k in (*self.CATEGORIES, "total")}, "at": point,
                "by_point": {p: {"total": r["total"], "samples": r["samples"]} for p, r in self.points.items()}}


# -- what each implementation holds, for StatePeak -------------------------------------------------------
def fsdp_groups(model: torch.nn.Module) -> list:
    """FSDP2's parameter groups of every ``fully_shard``-ed module in ``model`` (empty without FSDP)."""
    groups = []
    for m in model.modules():
        get = getattr(m, "_get_fsdp_state", None)
        if get is None:
            continue
        state = get()
        found = getattr(state, "_fsdp_param_groups", None)
        if found is None:  # older torch: one group per state
            found = [g for g in (getattr(state, "_fsdp_param_group", None),) if g is not None]
        groups += [g for g in found if g not in groups]
    return groups


def fsdp_tensors(groups: list) -> dict[str, list]:
    """What FSDP2 holds beyond the module's current parameters: sharded parameters (and their gradients),
    unsharded parameters and their all-gather outputs (freed ones have an empty storage and count 0),
    unsharded gradients, and the in-flight all-gather outputs and reduce-scatter inputs."""
    params, grads = [], []
    for g in groups:
        for fp in g.fsdp_params:
            unsharded = getattr(fp, "_unsharded_param", None)
            params += [fp.sharded_param, unsharded, *fp.all_gather_outputs]
            grads += [fp.sharded_param.grad, unsharded.grad if unsharded is not None else None,
                      fp.unsharded_accumulated_grad]
        ctx = g.comm_ctx
        for result in (g._all_gather_result, getattr(ctx.all_gather_state, "all_gather_result", None)):
            params.append(getattr(result, "all_gather_output", None))
        grads += [st.reduce_scatter_input for st in getattr(ctx, "reduce_scatter_states", [])]
        grads.append(getattr(g, "_partial_reduce_output", None))
    return {"params": params, "grads": grads}


def state_sources(model: torch.nn.Module, state_opt: Any, extra_grads: list | None = None) -> Any:
    """``StatePeak`` sources: the model's parameters and gradients, the optimizer's own parameters,
    gradient buffers (``grad_buffers()``, plait's ZeRO) and states, FSDP2's internals, ``extra_grads``."""
    groups = fsdp_groups(model)

    def sources() -> dict[str, list]:
        params = list(model.parameters()) + [p for g in state_opt.param_groups for p in g["params"]]
        grads = [p.grad for p in params] + list(extra_grads or [])
        if callable(getattr(state_opt, "grad_buffers", None)):
            grads += state_opt.grad_buffers()
        fsdp = fsdp_tensors(groups)
        states = [v for st in state_opt.state.values() for v in st.values()]
        return {"params": params + fsdp["params"], "grads": grads + fsdp["grads"], "optimizer": states}
    return sources


def backward_leaves(model: torch.nn.Module) -> list:
    """The tensors autograd accumulates gradients into: FSDP2's unsharded parameters, else the model's."""
    groups = fsdp_groups(model)
    if groups:
        return [fp._unsharded_param for g in groups for fp in g.fsdp_params if hasattr(fp, "_unsharded_param")]
    return list(model.parameters())


def ddp_bucket_buffers(module: Any) -> list:
    """DDP's flat gradient buckets (``gradient_as_bucket_view=False``: copies of the gradients, alive for
    the module's life), collected by an all-reduce comm hook equal to DDP's built-in one. Register
    it only for untimed measurement steps; the list fills in during the first backward."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    buffers: list = []

    def hook(state, bucket):
        if all(b is not bucket.buffer() for b in buffers):
            buffers.append(bucket.buffer())
        return default_hooks.allreduce_hook(state, bucket)
    module.register_comm_hook(None, hook)
    return buffers


def sampled(fn: Any, peak: StatePeak, before: str | None, after: str | None) -> Any:
    """``fn`` wrapped to take ``peak`` samples named ``before`` / ``after`` around each call."""
    def call(*args, **kwargs):
        if before:
            peak.sample(before)
        out = fn(*args, **kwargs)
        if after:
            peak.sample(after)
        return out
    return call
