"""One GPU check: every figure a GPU user asks of plait, in one run of at most five minutes.

    python bench/gpu_check.py [--device cuda|cpu] [--quick] [--only env,tests,gpt,memory,hf,multiprocess,fp8]
                              [--out DIR]

plait is imported from this checkout's ``src/`` by path (nothing is installed); the JSON goes to
``DIR/gpu_check.json`` (default: ``$OUT`` when set, else the working directory) and a short table to stdout.

Sections (each in its own process, so an out-of-memory error or a hang in one does not spoil the others;
a section that cannot run holds ``{"skipped": reason}``, one that failed ``{"error": ...}``):

- ``env``: the device, its memory, driver, torch / CUDA / NCCL versions, the datasheet bf16 peak for the
  GPU name detected (``plait.train.mfu.gpu_peak``) and the bf16 matmul peak measured here (8192^3).
- ``tests``: the suite's GPU-marked tests (``pytest -m gpu`` over the test files that carry the marker),
  with each test's outcome.
- ``gpt``: plait's GPT through ``plait.Trainer`` at world 1 (a one-rank process group, as ``plait train
  --parallel.nproc=1`` runs it), bf16, eager and with ``train.compile``, against the same model in a
  hand-written bf16 loop (the peer: ``torch.compile``d model, autocast, AdamW with plait's settings and
  clipping, random tokens already on the device), for the main job's size and for a 124M-parameter size:
  tokens/s, MFU against the datasheet and the measured peak, plait/peer ratio.
- ``memory``: ``plait plan memory``'s prediction (``simulate_config(..., memory_only=True)``, rank 0's
  total) against ``torch.cuda.max_memory_allocated`` over the training steps, for fp32, bf16, activation
  checkpointing none/full/every_k, and ZeRO-3 with FSDP2's ``CPUOffloadPolicy`` on a 0.6B-parameter GPT
  (9.7 GB of fp32 AdamW states) next to the same model without offload.
- ``hf``: a Hugging Face Llama of about 1B parameters (random weights, from a config) through
  ``plait.Plait`` at world 1, bf16, against the same model in a hand-written loop: step time and MFU.
- ``multiprocess``: NCCL runs one rank per GPU; with one GPU it is skipped and says so.
- ``fp8`` (not in the default run, which must end within five minutes: ``--only fp8``): the 124M GPT through
  ``plait.Trainer``, compiled, 200 steps from one seed at ``train.precision=bf16`` and at ``fp8`` (torchao's
  Float8Linear; needs torchao: ``bench/gpu_check.sh`` installs a wheel found in ``bench/wheels/``): the mean loss
  of the last 10 steps of each (target: fp8 within 1% of bf16) and tokens/s over the last 50 (fp8 / bf16).

``--device cpu --quick`` rehearses every section on the CPU with tiny sizes in under a minute (compile with
``backend="aot_eager"``), so the script cannot rot between GPU days (tests/bench/test_gpu_check.py runs it).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

SECTIONS = ("env", "tests", "gpt", "memory", "hf", "multiprocess", "fp8")
DEFAULT = SECTIONS[:-1]  # fp8 runs when asked (--only fp8): the default run must end within five minutes
# Seconds each section may run before it is stopped (the whole check must end within five minutes on a GPU).
LIMITS = {"env": 40, "tests": 90, "gpt": 180, "memory": 120, "hf": 90, "multiprocess": 15, "fp8": 300}
QUIET = ["--observe.progress=false", "--observe.trackers=[]", "--train.eval_every=0",
         "--checkpoint.every=0", "--optim.warmup_steps=1", "--train.log_every=1000"]


# -- sizes ---------------------------------------------------------------------------------------------
def gpt_sizes(quick: bool) -> dict[str, list[str]]:
    """The GPT sizes of the ``gpt`` section, as ``plait train`` overrides."""
    if quick:
        return {"tiny": ["--model.n_layer=2", "--model.d_model=32", "--model.n_head=2", "--model.seq_len=32",
                         "--train.global_batch_size=4", "--train.micro_batch_size=4"]}
    return {"main_job": [],  # the default config: what `make train` runs (4 layers, d 128, seq 128, batch 32/16)
            "gpt_124m": ["--model.n_layer=12", "--model.d_model=768", "--model.n_head=12", "--model.seq_len=1024",
                         "--train.global_batch_size=16", "--train.micro_batch_size=16"]}


def memory_rows(quick: bool) -> dict[str, list[str]]:
    """The ``memory`` section's runs, as overrides (each at world 1)."""
    if quick:
        base = ["--model.n_layer=2", "--model.d_model=32", "--model.n_head=2", "--model.seq_len=32",
                "--train.global_batch_size=4", "--train.micro_batch_size=4"]
        big = base
    else:
        base = ["--model.n_layer=8", "--model.d_model=1024", "--model.n_head=16", "--model.seq_len=1024",
                "--train.global_batch_size=8", "--train.micro_batch_size=8"]
        # 12 x 12 x 2048^2 + embeddings = 0.6B parameters: 9.7 GB of fp32 parameters, gradients and AdamW states
        big = ["--model.n_layer=12", "--model.d_model=2048", "--model.n_head=16", "--model.seq_len=1024",
               "--train.global_batch_size=4", "--train.micro_batch_size=4"]
    bf16 = ["--train.precision=bf16"]
    return {
        "fp32": base,
        "bf16": base + bf16,
        "bf16_ckpt_full": base + bf16 + ["--train.activation_checkpointing=full"],
        "bf16_ckpt_every_2": base + bf16 + ["--train.activation_checkpointing=every_k", "--train.checkpoint_every_k=2"],
        "big_bf16": big + bf16,
        "big_bf16_zero3_offload": big + bf16 + ["--parallel.zero=3", "--parallel.offload=params"],
    }


def hf_config(quick: bool) -> dict[str, Any]:
    """A Llama of ~1.0B parameters (2048 wide, 18 layers, 32K vocabulary, GQA 16/8), or a tiny one."""
    if quick:
        return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=512, max_position_embeddings=64, seq=32, batch=2)
    return dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=18, num_attention_heads=16,
                num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048, seq=2048, batch=4)


# -- shared pieces -------------------------------------------------------------------------------------
def emit(partial: dict[str, Any]) -> None:
    """Print a section's results so far (the driver keeps the last line if the section runs out of time)."""
    print(json.dumps(partial, default=str), flush=True)


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def datasheet_peak(device: Any) -> dict[str, Any]:
    """bf16 dense datasheet peak of the GPU detected (None on a CPU or an unknown GPU, with the reason)."""
    import torch

    from plait.train.mfu import gpu_peak

    if device.type != "cuda":
        return {"flops": None, "source": "no datasheet peak for a CPU"}
    peak = gpu_peak(torch.cuda.get_device_name(device), "bf16")
    return {"flops": peak.flops, "source": peak.source}


def measured_matmul_peak(device: Any, quick: bool) -> dict[str, Any]:
    """bf16 matmul FLOP/s: the median of timed ``n x n x n`` products after warm-up, on random data."""
    import torch

    n = 512 if quick else 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    times = []
    for i in range(13 if not quick else 5):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(10):
            a @ b
        sync(device)
        if i >= 3 or quick:
            times.append((time.perf_counter() - t0) / 10)
    times.sort()
    median = times[len(times) // 2]
    return {"n": n, "flops": 2 * n**3 / median, "seconds": median}


def init_one_rank(device: Any) -> None:
    """A one-rank process group (NCCL on a GPU, gloo on the CPU), as ``plait train --parallel.nproc=1`` has."""
    import torch.distributed as dist

    from plait.runtime.spawn import free_port

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def make_trainer(overrides: list[str], run_dir: Path) -> Any:
    from plait.recipes import build_trainer, load_recipe_config
    from plait.recipes import validate_config as validate

    cfg = validate(load_recipe_config(overrides=QUIET + overrides + ["--parallel.nproc=1", f"--run.dir={run_dir}"]), 1)
    return build_trainer(cfg)


def release() -> None:
    """Collect what the caller has dropped (``del`` its names first) and return the cached device memory."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timed_steps(step: Any, device: Any, warmup: int, steps: int) -> float:
    """Seconds per step over ``steps`` steps after ``warmup`` (the device synchronised around them)."""
    for _ in range(warmup):
        step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return (time.perf_counter() - t0) / steps


def utilisation(flops_per_token: float, tokens_per_s: float, peaks: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name in ("datasheet", "measured"):
        flops = (peaks.get(name) or {}).get("flops")
        out[f"mfu_{name}"] = flops_per_token * tokens_per_s / flops if flops else None
    return out


# -- sections ------------------------------------------------------------------------------------------
def section_env(device: Any, quick: bool) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"device": str(device), "torch": torch.__version__, "python": platform.python_version(),
                           "cuda": torch.version.cuda, "cpu": platform.processor() or platform.machine(),
                           "cpu_count": os.cpu_count()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(gpu=props.name, gpu_memory_bytes=props.total_memory, multiprocessors=props.multi_processor_count,
                   gpu_count=torch.cuda.device_count(), nccl=".".join(map(str, torch.cuda.nccl.version())))
        try:
            out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            out["driver"] = f"unknown ({e})"
    out["datasheet_peak_bf16"] = datasheet_peak(device)
    out["measured_peak_bf16"] = measured_matmul_peak(device, quick)
    return out


def section_tests(device: Any, quick: bool) -> dict[str, Any]:
    """``pytest -m gpu`` over the test files that carry the marker; each test's outcome from JUnit XML."""
    import xml.etree.ElementTree as ET

    files = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").glob("test_*.py")
                   if "mark.gpu" in f.read_text())
    if not files:
        return {"skipped": "no test file carries the gpu marker"}
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                               f"--junitxml={xml}", *files], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=LIMITS["tests"] - 10)
        if not xml.is_file():
            return {"error": f"pytest exit {done.returncode}: {(done.stdout + done.stderr)[-1500:]}"}
        results = {}
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            outcome, detail = "passed", ""
            for tag in ("failure", "error", "skipped"):
                node = case.find(tag)
                if node is not None:
                    outcome = {"failure": "failed"}.get(tag, tag)
                    detail = (node.get("message") or "")[:400]
            results[name] = {"outcome": outcome, "seconds": float(case.get("time", 0)), **({"detail": detail}
                                                                                         if detail else {})}
    counts = {k: sum(r["outcome"] == k for r in results.values()) for k in ("passed", "failed", "error", "skipped")}
    return {"files": files, "exit_code": done.returncode, "counts": counts, "tests": results}


def _peer_gpt(overrides: list[str], device: Any, compiled: bool, quick: bool) -> tuple[float, int, float]:
    """The hand-written loop: (seconds per step, tokens per step, FLOPs per token)."""
    import torch

    from plait.data.tokenize import resolve_vocab_size
    from plait.models.gpt import GPT
    from plait.recipes import load_recipe_config
    from plait.train.mfu import formula_flops_per_token

    cfg = load_recipe_config(overrides=QUIET + overrides)
    resolve_vocab_size(cfg)  # model.vocab_size = 0: the tokenizer's, as plait train resolves it
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model).to(device)
    o = cfg.optim
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.beta1, o.beta2))
    flops = formula_flops_per_token(model)
    run = torch.compile(model, backend="aot_eager" if quick else "inductor") if compiled else model
    b, t, v = cfg.train.micro_batch_size, cfg.model.seq_len, cfg.model.vocab_size
    accumulation = cfg.train.global_batch_size // b
    data = torch.randint(0, v, (accumulation, b, t + 1), device=device)

    def step() -> None:
        for i in range(accumulation):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = run(data[i, :, :-1])
                loss = torch.nn.functional.cross_entropy(logits.float().view(-1, v), data[i, :, 1:].reshape(-1))
            (loss / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    warmup, steps = (2, 3) if quick else (8 if compiled else 4, 20)
    seconds = timed_steps(step, device, warmup, steps)
    model = opt = run = data = None  # dropped (the step closure holds the same cells)
    release()
    return seconds, cfg.train.global_batch_size * t, flops


def host_profile(step: Any, steps: int = 3) -> list[dict[str, Any]]:
    """The host operators that took the most of ``steps`` steps' time (self CPU time, torch.profiler): where
    a host-bound step goes (kernel launches, device synchronisations, Python-side work)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    return [{"op": e.key, "calls": e.count, "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / steps}
            for e in rows]


def _plait_gpt(overrides: list[str], device: Any, tmp: Path, quick: bool,
               profile_host: bool = False) -> tuple[float, int, float, list | None]:
    """plait's Trainer (the main job's path): (seconds per step, tokens per step, FLOPs per token, host profile)."""
    from plait.train.mfu import formula_flops_per_token

    trainer = make_trainer(overrides, tmp)
    flops = formula_flops_per_token(trainer.model)
    compiled = any(o == "--train.compile=true" for o in overrides)
    warmup, steps = (2, 3) if quick else (8 if compiled else 4, 20)
    seconds = timed_steps(trainer.train_step, device, warmup, steps)
    hosts = host_profile(trainer.train_step) if profile_host else None
    tokens = trainer.cfg.train.global_batch_size * trainer.cfg.model.seq_len
    trainer.p.close()
    del trainer
    release()
    return seconds, tokens, flops, hosts


def section_gpt(device: Any, quick: bool, peaks: dict[str, Any]) -> dict[str, Any]:
    init_one_rank(device)
    backend = ["--train.compile_backend=aot_eager"] if quick else []
    out: dict[str, Any] = {"precision": "bf16", "world": 1, "timing": "median-free: mean over 20 steps after warm-up "
                           "(3 in quick mode), device synchronised around them"}
    last = list(gpt_sizes(quick))[-1]
    for size, sizes in gpt_sizes(quick).items():
        row: dict[str, Any] = {"overrides": sizes}
        for mode in ("eager", "compiled"):
            extra = ["--train.precision=bf16"] + (["--train.compile=true", *backend] if mode == "compiled" else [])
            with tempfile.TemporaryDirectory() as tmp:
                s_plait, tokens, flops, hosts = _plait_gpt(sizes + extra, device, Path(tmp), quick,
                                                           profile_host=size == last and mode == "eager")
            if hosts is not None:
                out["plait_host_profile"] = {"size": size, "mode": mode, "top_self_cpu": hosts}
            s_peer, _, _ = _peer_gpt(sizes + extra, device, mode == "compiled", quick)
            plait_tps, peer_tps = tokens / s_plait, tokens / s_peer
            row[mode] = {"plait_tokens_per_s": plait_tps, "peer_tokens_per_s": peer_tps,
                         "ratio_plait_over_peer": plait_tps / peer_tps, "plait_step_s": s_plait, "peer_step_s": s_peer,
                         "flops_per_token": flops,
                         "plait": utilisation(flops, plait_tps, peaks), "peer": utilisation(flops, peer_tps, peaks)}
            out[size] = row
            emit(out)
    return out


def _allocated_peak(device: Any) -> int | None:
    import torch

    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def _memory_row(overrides: list[str], device: Any) -> dict[str, Any]:
    """One world-1 run: device memory after setup and the peak over 3 training steps. The trainer is local to
    this function, so it is gone (and its memory free) before the next row is measured."""
    import torch

    row: dict[str, Any] = {"allocated_before_bytes": torch.cuda.memory_allocated(device) if device.type == "cuda"
                           else None}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = make_trainer(overrides, Path(tmp))
        row["setup_peak_bytes"] = _allocated_peak(device)
        if device.type == "cuda":
            row["allocated_after_setup_bytes"] = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(3):
            trainer.train_step()
        sync(device)
        row["measured_bytes"] = _allocated_peak(device)
        row["measured_model_state_bytes"] = trainer.memory.get("total")
        trainer.p.close()
    return row


def section_memory(device: Any, quick: bool) -> dict[str, Any]:
    """Predicted (``plait plan memory``) against measured peak device memory per world-1 run."""
    from plait.plan.configured import simulate_config
    from plait.plan.hardware import load_profile
    from plait.recipes import load_recipe_config

    init_one_rank(device)
    profile = load_profile("h100-sxm")
    out: dict[str, Any] = {"measured": "torch.cuda.max_memory_allocated over 3 training steps after setup (peak "
                           "stats reset after setup); setup's own peak reported beside it"}
    for name, overrides in memory_rows(quick).items():
        if "--parallel.offload=params" in overrides and device.type != "cuda":
            out[name] = {"skipped": "FSDP2's CPUOffloadPolicy moves state from accelerator memory to the host; on "
                                    "the CPU there is no device memory to offload from"}
            continue
        row: dict[str, Any] = {"overrides": overrides}
        try:
            cfg = load_recipe_config(overrides=QUIET + overrides + ["--parallel.nproc=1"])
            sim = simulate_config(cfg, profile, derive_tp=False, memory_only=True)
            predicted = sim.memory[0].as_dict()
            row.update(params=sim.work.shape.param_count(), predicted_bytes=predicted["total"], predicted=predicted)
            row.update(_memory_row(overrides, device))
        except Exception as e:  # this row's error in the JSON; the other rows still run
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            row["traceback"] = traceback.format_exc()[-1500:]
        release()
        if row.get("measured_bytes") is None and "error" not in row:
            row["measured_skipped"] = "no device allocator on the CPU (its RSS counts the interpreter too)"
        elif "error" not in row:
            row["error_vs_measured"] = row["predicted_bytes"] / row["measured_bytes"] - 1
        out[name] = row
        emit(out)
    return out


def _llama(quick: bool, device: Any) -> tuple[Any, dict[str, Any]]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    c = hf_config(quick)
    cfg = LlamaConfig(**{k: v for k, v in c.items() if k not in ("seq", "batch")}, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it trains: a 1B model's init on the host takes longer
        return LlamaForCausalLM(cfg), c


def _hf_flops_per_token(model: Any, c: dict[str, Any]) -> float:
    """Forward + backward FLOPs per token counted by ``FlopCounterMode`` on a meta copy of the model."""
    import torch

    from plait.train.mfu import counted_flops

    batch = {"input_ids": torch.zeros(1, c["seq"], dtype=torch.long)}
    return counted_flops(model, lambda m, b: m(input_ids=b["input_ids"], labels=b["input_ids"]).loss, batch) / c["seq"]


def section_hf(device: Any, quick: bool, peaks: dict[str, Any]) -> dict[str, Any]:
    import torch

    try:
        import transformers
    except ImportError as e:
        return {"skipped": f"transformers is not installed ({e})"}
    from plait import Plait

    init_one_rank(device)
    warmup, steps = (1, 2) if quick else (2, 8)
    model, c = _llama(quick, device)
    params = sum(p.numel() for p in model.parameters())
    flops = _hf_flops_per_token(model, c)
    data = torch.randint(0, c["vocab_size"], (c["batch"], c["seq"]), device=device)
    tokens = c["batch"] * c["seq"]
    out: dict[str, Any] = {"transformers": transformers.__version__, "params": params, "config": c,
                           "precision": "bf16 autocast, fp32 weights and AdamW", "flops_per_token": flops}
    with tempfile.TemporaryDirectory() as tmp:
        p = Plait(train={"precision": "bf16", "global_batch_size": c["batch"], "micro_batch_size": c["batch"]},
                  optim={"grad_clip": 0.0}, observe={"progress": False, "trackers": []}, run={"dir": tmp})
        model, opt = p.setup(model, optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4))

        def plait_step() -> None:
            p.backward(model(input_ids=data, labels=data).loss)
            p.step()

        s_plait = timed_steps(plait_step, device, warmup, steps)
        p.close()
    model = opt = p = None  # dropped before the peer's copy is built
    release()
    model, _ = _llama(quick, device)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def peer_step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=data, labels=data).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    s_peer = timed_steps(peer_step, device, warmup, steps)
    model = opt = None
    release()
    out.update(plait_step_s=s_plait, peer_step_s=s_peer, ratio_plait_over_peer_time=s_plait / s_peer,
               plait=utilisation(flops, tokens / s_plait, peaks), peer=utilisation(flops, tokens / s_peer, peaks))
    return out


def section_multiprocess(device: Any, quick: bool) -> dict[str, Any]:
    import torch

    count = torch.cuda.device_count() if device.type == "cuda" else 0
    if count < 2:
        return {"skipped": f"{count} GPU(s): NCCL runs one rank per GPU, so multi-process training (data parallelism, "
                           "ZeRO, tensor and pipeline parallelism over NCCL) needs at least 2 GPUs; not faked by "
                           "several ranks on one GPU. The CPU suite covers them over gloo."}
    return {"skipped": f"{count} GPUs: the NCCL tests run in the 'tests' section (tests/test_gpu.py)"}


# -- driver --------------------------------------------------------------------------------------------
def section_fp8(device: Any, quick: bool) -> dict[str, Any]:
    """bf16 against fp8 on the 124M GPT: the loss after the same steps, and tokens/s."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return {"skipped": "torchao is not installed (pip install 'plait[fp8]'; on the GPU machine put its wheel in "
                           "bench/wheels/)"}
    import torch

    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return {"skipped": f"{torch.cuda.get_device_name(device)} has no float8 tensor cores (compute capability "
                           "8.9+ needed)"}
    init_one_rank(device)
    size = list(gpt_sizes(quick))[-1]
    steps, timed, tail = (6, 3, 2) if quick else (200, 50, 10)
    backend = ["--train.compile_backend=aot_eager"] if quick else []
    out: dict[str, Any] = {"size": size, "steps": steps, "compile": True}
    for precision in ("bf16", "fp8"):
        with tempfile.TemporaryDirectory() as tmp:
            trainer = make_trainer(gpt_sizes(quick)[size] + [f"--train.precision={precision}", "--train.compile=true",
                                                              *backend], Path(tmp))
            losses = []
            for i in range(steps):
                if i == steps - timed:
                    sync(device)
                    t0 = time.perf_counter()
                rec = trainer.train_step(log=i >= steps - tail)
                if i >= steps - tail:
                    losses.append(float(rec["global_loss"]))
            sync(device)
            seconds = (time.perf_counter() - t0) / timed
            tokens = trainer.cfg.train.global_batch_size * trainer.cfg.model.seq_len
            trainer.p.close()
            del trainer
            release()
        out[precision] = {"loss_last": sum(losses) / len(losses), "tokens_per_s": tokens / seconds}
        emit(out)
    out["loss_ratio_fp8_over_bf16"] = out["fp8"]["loss_last"] / out["bf16"]["loss_last"]
    out["speedup_fp8_over_bf16"] = out["fp8"]["tokens_per_s"] / out["bf16"]["tokens_per_s"]
    out["loss_within_1pct"] = abs(out["loss_ratio_fp8_over_bf16"] - 1) <= 0.01
    return out


def run_section(name: str, device_name: str, quick: bool, peaks: dict[str, Any]) -> dict[str, Any]:
    """One section in this process (``--worker``)."""
    import torch

    device = torch.device("cuda", 0) if device_name == "cuda" else torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not peaks:  # the env section did not run: the datasheet peak still applies, the measured one is absent
        peaks = {"datasheet": datasheet_peak(device)}
    fn = globals()[f"section_{name}"]
    return fn(device, quick, peaks) if name in ("gpt", "hf") else fn(device, quick)


def spawn_section(name: str, args: argparse.Namespace, peaks: dict[str, Any]) -> dict[str, Any]:
    """Run a section in a child process with its time limit; its last stdout line is the JSON result."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, __file__, "--worker", name, "--device", args.device, "--peaks", json.dumps(peaks)]
    if args.quick:
        cmd.append("--quick")
    limit = LIMITS[name] if not args.quick else 120
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        text = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        partial = [ln for ln in text.splitlines() if ln.startswith("{")]
        tail = e.stderr.decode()[-1000:] if isinstance(e.stderr, bytes) else (e.stderr or "")[-1000:]
        body = json.loads(partial[-1]) if partial else {}
        return {**body, "error": f"stopped after its {limit} s limit (rows above finished); stderr tail: {tail}"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        return {"error": f"exit {done.returncode}: {done.stderr[-2000:]}"}
    return json.loads(lines[-1])


def worker(name: str, device: str, quick: bool, peaks: dict[str, Any]) -> None:
    try:
        result = run_section(name, device, quick, peaks)
    except Exception as e:  # reported in the JSON; the driver goes on with the next section
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    print(json.dumps(result, default=str))


def _fmt(x: Any, pct: bool = False) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.1f}%" if pct else (f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}")


def table(result: dict[str, Any]) -> str:
    """The short table printed last."""
    s = result["sections"]
    lines = [f"plait GPU check ({result['device']}, {'quick' if result['quick'] else 'full'}), "
             f"{result['seconds']:.0f} s"]
    env = s.get("env", {})
    if "measured_peak_bf16" in env:
        lines.append(f"env: {env.get('gpu', env.get('cpu'))}, torch {env['torch']}, CUDA {env.get('cuda')}, "
                     f"NCCL {env.get('nccl', '-')}, driver {env.get('driver', '-')}; bf16 matmul "
                     f"{_fmt(env['measured_peak_bf16']['flops'] / 1e12)} TFLOP/s measured, datasheet "
                     f"{_fmt((env['datasheet_peak_bf16']['flops'] or 0) / 1e12)}")
    for name, body in s.items():
        if "skipped" in body or "error" in body:
            lines.append(f"{name}: {'SKIPPED' if 'skipped' in body else 'ERROR'}: "
                         f"{str(body.get('skipped') or body.get('error')).splitlines()[0][:150]}")
    if "counts" in s.get("tests", {}):
        lines.append(f"tests: {s['tests']['counts']}")
    for size, row in s.get("gpt", {}).items():
        if isinstance(row, dict) and "eager" in row:
            for mode in ("eager", "compiled"):
                r = row[mode]
                lines.append(f"gpt {size} {mode}: plait {_fmt(r['plait_tokens_per_s'])} tok/s, peer "
                             f"{_fmt(r['peer_tokens_per_s'])} tok/s, plait/peer {r['ratio_plait_over_peer']:.3f}, MFU "
                             f"plait {_fmt(r['plait']['mfu_datasheet'], True)} (datasheet) "
                             f"{_fmt(r['plait']['mfu_measured'], True)} (measured peak)")
    for name, row in s.get("memory", {}).items():
        if isinstance(row, dict) and "predicted_bytes" in row:
            meas = row.get("measured_bytes")
            lines.append(f"memory {name}: predicted {row['predicted_bytes'] / 2**20:,.0f} MiB, measured "
                         f"{'-' if meas is None else f'{meas / 2**20:,.0f} MiB'}, error "
                         f"{_fmt(row.get('error_vs_measured'), True)}" + (f" [{row['error']}]" if "error" in row
                                                                             else ""))
    hf = s.get("hf", {})
    if "plait_step_s" in hf:
        lines.append(f"hf llama {hf['params'] / 1e9:.2f}B: step plait {hf['plait_step_s']:.3f} s, peer "
                     f"{hf['peer_step_s']:.3f} s (plait/peer time {hf['ratio_plait_over_peer_time']:.3f}), MFU plait "
                     f"{_fmt(hf['plait']['mfu_datasheet'], True)} / peer {_fmt(hf['peer']['mfu_datasheet'], True)}")
    fp8 = s.get("fp8", {})
    if "speedup_fp8_over_bf16" in fp8:
        lines.append(f"fp8 {fp8['size']} ({fp8['steps']} steps): loss fp8/bf16 {fp8['loss_ratio_fp8_over_bf16']:.4f}, "
                     f"tokens/s fp8/bf16 {fp8['speedup_fp8_over_bf16']:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the CPU rehearsal)")
    ap.add_argument("--only", default="", help="comma-separated sections to run: " + ",".join(SECTIONS))
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for gpu_check.json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--peaks", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.device, args.quick, json.loads(args.peaks))
        return 0
    chosen = [s.strip() for s in args.only.split(",") if s.strip()] or list(DEFAULT)
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        ap.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here; run with --device cpu --quick for the CPU rehearsal",
                  file=sys.stderr)
            return 2
    start = time.perf_counter()
    result: dict[str, Any] = {"device": args.device, "quick": args.quick, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "sections": {}, "section_seconds": {}}
    peaks: dict[str, Any] = {}
    for name in chosen:
        t0 = time.perf_counter()
        body = spawn_section(name, args, peaks)
        result["sections"][name] = body
        result["section_seconds"][name] = time.perf_counter() - t0
        if name == "env" and "measured_peak_bf16" in body:
            peaks = {"datasheet": body["datasheet_peak_bf16"], "measured": body["measured_peak_bf16"]}
        print(f"gpu_check: {name} done in {result['section_seconds'][name]:.1f} s", file=sys.stderr, flush=True)
    result["seconds"] = time.perf_counter() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str))
    print(table(result))
    print(f"wrote {out / 'gpu_check.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
