"""Model FLOPs utilisation (MFU) of a run: the model's FLOPs per token times tokens per second, over the
peak FLOP/s of the devices the run uses.

    mfu = flops_per_item x items_per_s / (world_size x peak_per_device)

``items`` are tokens for token models ((B, T) integer inputs), samples otherwise.

FLOPs per item (``model_flops_per_item``), by the first method that applies (named in ``source``):

* ``formula``: the ``flops`` of the spec registered for the model's class (``plait.parallel.train_spec``). plait's
  dense GPT's (``plait.models.gpt.shape``) is PaLM's count (Chowdhery et al. 2022, appendix B), the one
  ``plait.plan.flops.model_flops`` implements: ``6 N_mm + 12 L d T`` per token, ``N_mm`` the matmul
  weights including the (tied) head, ``L`` layers, ``d`` width, ``T`` sequence length; forward =
  ``2 N_mm + 4 L d T`` (attention's ``Q K^T`` and ``A V`` over the full ``T x T`` square), backward =
  2 x forward. Recomputation (activation checkpointing) is not model FLOPs and is not counted.
* ``flop_counter``: any other model, counted by ``torch.utils.flop_counter.FlopCounterMode`` over one
  forward and backward of a sample micro-batch on the meta device (a copy of the module whose
  parameters are meta tensors: no memory, no compute), divided by the micro-batch's items.
* ``6N``: where that count fails (a model that needs real data, e.g. ``.item()`` in forward): ``6 N``
  per item, N the parameter count (Kaplan et al. 2020), for token models only.

Peak per device (``device_peak``):

* CUDA: the datasheet's dense peak for the step's matmul dtype (bf16 for bf16/fp16 training, fp32
  otherwise; sparsity not counted): the shipped hardware profiles (``plait.plan.profiles``) for A100
  and H100 SXM, ``GPU_PEAKS`` for the others; an unknown GPU gives no MFU (``None``, with the reason).
* CPU: the matmul peak measured on this machine: the fastest ``torch.mm`` of ``PEAK_SIZES`` square
  matrices in the training dtype at this process's thread count (``plait.runtime.timing.timed``: the
  fastest of repeated samples, the least disturbed by other processes), cached in
  ``~/.cache/plait/peak.json`` keyed by CPU model, thread count, dtype and torch version, so it is
  measured once per machine and setting (about a second).
"""

from __future__ import annotations

import copy
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

PEAK_SIZES = (512, 1024)
# Dense datasheet peaks in FLOP/s per GPU, (bf16, fp32) without sparsity, for GPUs the shipped profiles
# do not cover; matched against torch.cuda.get_device_name() in order (first substring that matches).
GPU_PEAKS: list[tuple[str, float, float]] = [
    ("H200", 989.4e12, 67e12),         # NVIDIA H200 datasheet (SXM)
    ("H100 PCIe", 756.5e12, 51.2e12),  # NVIDIA H100 datasheet, PCIe
    ("H100", 989.4e12, 67e12),         # SXM (the h100-sxm profile agrees)
    ("A100", 312e12, 19.5e12),         # NVIDIA A100 datasheet (a100-80gb profile agrees)
    ("L40S", 362.05e12, 91.6e12),      # NVIDIA L40S datasheet
    ("L4", 121e12, 30.3e12),           # NVIDIA L4 datasheet
]
PROFILE_FOR = {"A100": "a100-80gb", "H100": "h100-sxm"}


@dataclass(frozen=True)
class Peak:
    """Peak FLOP/s of one device, and where the figure comes from."""

    flops: float | None
    source: str


@dataclass(frozen=True)
class ModelFlops:
    """FLOPs per item (token or sample) of one optimizer step's forward and backward."""

    per_item: float | None
    item: str  # "token" or "sample"
    source: str  # formula, flop_counter, 6N or the reason there is none


def formula_flops_per_token(model: nn.Module) -> float | None:
    """FLOPs per token by the formula of the spec registered for ``model``'s class (plait's dense GPT: ``6 N_mm +
    12 L d T``); None where there is none (no spec, no ``flops``, or a model it does not cover: an MoE GPT)."""
    from plait.parallel.model_specs import spec_for

    flops = getattr(spec_for(model), "flops", None)
    return flops(model) if flops is not None else None


def _to_meta(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to("meta")
    if isinstance(batch, dict):
        return {k: _to_meta(v) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(_to_meta(v) for v in batch)
    return batch


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors (the real ones are not copied)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def counted_flops(model: nn.Module, loss: Any, batch: Any) -> float:
    """FLOPs of forward and backward of ``loss(model, batch)`` counted by ``FlopCounterMode`` on a meta copy."""
    from torch.utils.flop_counter import FlopCounterMode

    meta = meta_copy(model)
    with FlopCounterMode(display=False) as counter:
        loss(meta, _to_meta(batch)).backward()
    return float(counter.get_total_flops())


def model_flops_per_item(model: nn.Module, loss: Any = None, batch: Any = None, tokens: int = 0,
                         samples: int = 0) -> ModelFlops:
    """FLOPs per token (or per sample for models without token inputs) of the user's full model; see the
    module docstring for the methods. ``batch`` is one micro-batch of ``tokens`` tokens / ``samples``
    samples (0 tokens: not a token model)."""
    item, n = ("token", tokens) if tokens else ("sample", samples)
    formula = formula_flops_per_token(model)
    if formula is not None:
        return ModelFlops(formula, "token", "formula")
    if loss is not None and batch is not None and n:
        try:
            return ModelFlops(counted_flops(model, loss, batch) / n, item, "flop_counter")
        except Exception as e:  # noqa: BLE001 - any failure of the meta pass falls back to 6N, named
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
            if tokens:
                return ModelFlops(6.0 * sum(p.numel() for p in model.parameters()), "token", f"6N ({reason})")
            return ModelFlops(None, item, f"not counted ({reason})")
    if tokens:
        return ModelFlops(6.0 * sum(p.numel() for p in model.parameters()), "token", "6N")
    return ModelFlops(None, item, "not counted (no sample batch)")


# -- peaks --------------------------------------------------------------------------------------------
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else ``platform.processor()``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def peak_cache_path() -> Path:
    return Path(os.environ.get("PLAIT_CACHE_DIR", Path.home() / ".cache" / "plait")) / "peak.json"


def measure_cpu_matmul_peak(dtype: torch.dtype, threads: int, min_time: float = 0.05) -> float:
    """FLOP/s of the fastest ``torch.mm`` of ``PEAK_SIZES`` square matrices at ``threads`` threads."""
    from plait.runtime.timing import timed

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = 0.0
        for n in PEAK_SIZES:
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            best = max(best, 2.0 * n ** 3 / timed(lambda a=a, b=b: torch.mm(a, b), min_time, repeats=3))
        return best
    finally:
        torch.set_num_threads(saved)


def cpu_peak(dtype: torch.dtype, threads: int | None = None, cache: Path | None = None) -> Peak:
    """This machine's measured matmul peak for ``dtype`` at ``threads`` (default: torch's), cached."""
    threads = threads or torch.get_num_threads()
    path = cache or peak_cache_path()
    key = f"{cpu_model()} | threads={threads} | {str(dtype).removeprefix('torch.')} | torch {torch.__version__}"
    table: dict[str, float] = {}
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    if key not in table:
        table[key] = measure_cpu_matmul_peak(dtype, threads)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table, indent=1))
            tmp.replace(path)  # atomic: a concurrent reader sees the old or the new table
        except OSError:
            pass  # a read-only home: measured again next time
        return Peak(table[key], f"measured torch.mm peak ({key})")
    return Peak(table[key], f"measured torch.mm peak, cached in {path} ({key})")


def gpu_peak(name: str, dtype: str) -> Peak:
    """Datasheet dense peak of the GPU called ``name`` for ``dtype`` ("bf16" or "fp32")."""
    for pattern, profile in PROFILE_FOR.items():
        if pattern in name and not any(p in name for p in ("PCIe", "H200")):
            from plait.plan.hardware import load_profile

            prof = load_profile(profile)
            return Peak(prof.peak(dtype), f"datasheet {dtype} dense peak ({profile} profile)")
    for pattern, bf16, fp32 in GPU_PEAKS:
        if pattern in name:
            return Peak(bf16 if dtype == "bf16" else fp32, f"datasheet {dtype} dense peak ({pattern})")
    return Peak(None, f"no datasheet peak known for {name!r}: add it to plait.train.mfu.GPU_PEAKS")


def device_peak(device: torch.device, precision: str) -> Peak:
    """Peak FLOP/s of one ``device`` for the matmul dtype ``precision`` trains in (see the module docstring)."""
    low = precision in ("bf16", "fp16")
    if device.type == "cuda":
        return gpu_peak(torch.cuda.get_device_name(device), "bf16" if low else "fp32")
    return cpu_peak(torch.bfloat16 if precision == "bf16" else torch.float32)


def mfu(flops_per_item: float | None, items_per_s: float, devices: int, peak: float | None) -> float | None:
    """``flops_per_item x items_per_s / (devices x peak)``; None when a factor is unknown."""
    if not flops_per_item or not peak or devices < 1:
        return None
    return flops_per_item * items_per_s / (devices * peak)
