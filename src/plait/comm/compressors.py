"""Every compressor by name: ``build_compressor`` (``comm.compress``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from plait.comm.compress import (
    COMPRESSORS,
    CastCompressor,
    CompressConfigError,
    Compressor,
    QuantCompressor,
    RandomKCompressor,
    TopKCompressor,
)
from plait.comm.powersgd import PowerSGDCompressor


def build_compressor(name: str, *, ratio: float = 0.01, powersgd_rank: int = 4,
                     error_feedback: bool = True, stochastic_rounding: bool = False,
                     seed: int = 0, quant_block: int = 128,
                     allreduce: Callable[[torch.Tensor, dist.ProcessGroup | None], None] | None = None,
                     ) -> Compressor:
    """The compressor called ``name`` (one of ``COMPRESSORS``), configured and validated.

    ``ratio`` is the kept fraction for topk/randomk, ``powersgd_rank`` the rank r of PowerSGD,
    ``stochastic_rounding`` applies to int8/int4 only, ``quant_block`` is the elements per scale
    for int8/int4, and ``seed`` must be the same on every rank (randomk indices and PowerSGD's
    initial Q depend on it). Error feedback is ignored for ``none``, which loses nothing.
    ``allreduce`` (e.g. ``plait.comm.algorithms.get_allreduce(comm.allreduce)``) carries the fp32
    all-reduces of none/randomk/powersgd; None means the backend's.
    """
    if name not in COMPRESSORS:
        raise CompressConfigError(f"unknown compressor {name!r}; choose one of {', '.join(COMPRESSORS)}")
    if name in ("topk", "randomk") and not 0.0 < ratio <= 1.0:
        raise CompressConfigError(f"compress ratio must be in (0, 1] (kept fraction); got {ratio}")
    if name == "powersgd" and powersgd_rank < 1:
        raise CompressConfigError(f"powersgd rank must be at least 1; got {powersgd_rank}")
    if stochastic_rounding and name not in ("int8", "int4"):
        raise CompressConfigError(
            f"stochastic rounding applies to int8/int4 quantization, not {name!r}; turn it off"
        )
    kw = {"error_feedback": error_feedback and name != "none", "seed": seed, "allreduce": allreduce}
    if name == "none":
        return Compressor(**kw)
    if name in ("fp16", "bf16"):
        return CastCompressor(torch.float16 if name == "fp16" else torch.bfloat16, **kw)
    if name in ("int8", "int4"):
        return QuantCompressor(int(name[3:]), block=quant_block, stochastic_rounding=stochastic_rounding,
                               **kw)
    if name == "topk":
        return TopKCompressor(ratio, **kw)
    if name == "randomk":
        return RandomKCompressor(ratio, **kw)
    return PowerSGDCompressor(powersgd_rank, **kw)
