"""Float8 training (``train.precision = "fp8"``): torchao's ``Float8Linear`` for the model's matmuls.

``fp8`` is bf16 mixed precision (autocast, float32 parameters and optimizer states, as ``bf16``) in which the
Linears of the model multiply in float8: torchao's ``convert_to_float8_training`` swaps each eligible
``nn.Linear`` for a ``Float8Linear`` that casts its input and weight to ``float8_e4m3`` and the output gradient to
``float8_e5m2`` with dynamic per-tensor scales and calls ``torch._scaled_mm``. The swap keeps the module's own
``weight`` and ``bias`` parameters (names, objects, ties), so checkpoints, exports and optimizer states are those of
the bf16 model.

Which Linears: both dimensions divisible by 16 (what the float8 matmul needs), never the output head (a Linear
named ``lm_head``, ``output`` or ``head``, or one whose weight is shared with another module, e.g. an embedding),
as torchtitan leaves it: the logits are the precision-sensitive end of the model; and never an MoE router (a Linear
named ``router`` or ``gate``, as torchtitan filters ``router.gate``): which experts a token goes to should not turn
on a float8 rounding. Matmuls outside an ``nn.Linear`` (attention, the grouped weights of plait's MoE experts) run
in bf16; the log names what stays in bf16.

The conversion is the first step of the composition (``plait.parallel.compose.parallelize``), before any layout,
so every dimension sees the Float8Linears: tensor and sequence parallelism shard them with torchao's float8 styles
(``plait.parallel.tensor.float8``: scales over the whole tensor, float8 all-gathers), a pipeline splits the
converted model into stages (under the zero-bubble schedule its input pass and its weight pass each run torchao's
backward whole, as a Python autograd Function computes all its gradients in one call: the same gradients, the
float8 Linears' backward matmuls twice), expert parallelism places the experts, which are not Linears,
context parallelism routes the attention, which is not a Linear (each rank's Linears then scale their own sequence
shard, as a data-parallel rank its own micro-batch), activation offload moves what the Linears save for backward
(torchao's float8 tensors by their inner tensors), and under ZeRO-3 (FSDP2) the weights are all-gathered in float8
(torchao's ``enable_fsdp_float8_all_gather``), halving the gather's bytes.

Where: NVIDIA GPUs of compute capability 8.9 or newer (H100, H200, L40S, RTX 4090) run the float8 matmuls in their
tensor cores, which is where the speed-up is; older GPUs have none and are refused. On a CPU torch computes the
same float8 arithmetic without a speed-up (it is there to test and to check a run's numerics before renting a GPU;
the log says so). Layouts: every one but the parameter server (data parallelism with its own consistency, composed
with nothing).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from plait.config import Config, ConfigError
from plait.parallel.units import tied_uses

HEAD_NAMES = ("lm_head", "output", "head")
ROUTER_NAMES = ("router", "gate")


def check_config(cfg: Config) -> None:
    """The one layout float8 does not compose with: a parameter server (data parallelism with its own consistency,
    composed with nothing)."""
    if cfg.train.precision == "fp8" and cfg.parallel.mode == "ps":
        raise ConfigError("train.precision=fp8 does not run under parallel.mode=ps (a parameter server is data "
                          "parallelism with its own consistency); use train.precision=bf16 or parallel.mode=collective")


def check_device(device: torch.device) -> None:
    """Refuse a GPU without float8 tensor cores; name what is needed."""
    # torchao announces at import each of its CUDA kernel libraries that does not load (on a CPU, or built for
    # another torch) and torch each Enum it registers: neither concerns Float8Linear, so neither is shown
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        raise ConfigError("train.precision=fp8 needs torchao: pip install 'plait[fp8]'") from e
    finally:
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            name = torch.cuda.get_device_name(device)
            raise ConfigError(f"train.precision=fp8 needs an NVIDIA GPU of compute capability 8.9 or newer (H100, "
                              f"H200, L40S, RTX 4090); {name} is sm_{major}{minor}, without float8 tensor cores: use "
                              "train.precision=bf16")
    elif device.type != "cpu":
        raise ConfigError(f"train.precision=fp8 runs on NVIDIA GPUs (compute capability 8.9+) and, without a "
                          f"speed-up, on the CPU; not on {device.type}: use train.precision=bf16")


def eligible(model: nn.Module) -> list[str]:
    """The names of the Linears that are converted (see the module docstring)."""
    tied = {name for uses in tied_uses(model) for name, _ in uses}  # every name of a tied parameter
    out = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        if name.rsplit(".", 1)[-1] in HEAD_NAMES + ROUTER_NAMES or f"{name}.weight" in tied:
            continue
        if module.in_features % 16 or module.out_features % 16:
            continue
        out.append(name)
    return out


def convert(model: nn.Module, device: torch.device, fsdp: bool, logger: logging.Logger | None = None) -> list[str]:
    """Swap the eligible Linears of ``model`` for torchao's ``Float8Linear`` in place; returns their names."""
    check_device(device)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = set(eligible(model))
    kept = [n for n, m in model.named_modules() if type(m) is nn.Linear and n not in names]
    if not names:
        raise ConfigError("train.precision=fp8: no Linear of this model can multiply in float8 (each needs both "
                          "dimensions divisible by 16, and the output head stays in bf16); use train.precision=bf16")
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, fqn: fqn in names)
    if logger is not None:
        logger.info("fp8: %d Linears multiply in float8 (torchao Float8Linear, dynamic per-tensor scales%s); in bf16: "
                    "%s every matmul outside a Linear (attention, grouped MoE experts)%s", len(names),
                    ", float8 all-gather" if fsdp else "",
                    f"{len(kept)} Linears ({', '.join(kept[:3])}{', ...' if len(kept) > 3 else ''}: head, routers, "
                    "widths not divisible by 16) and" if kept else "",
                    "; on the CPU float8 computes without a speed-up" if device.type == "cpu" else "")
    return sorted(names)
