"""Per-rank memory model for data parallelism and ZeRO stages 0-3, and the measurement to check it.

Model states (Psi = trainable parameter count, N = data-parallel size, k = optimizer state tensors
per parameter: AdamW 2, SGD with momentum 1). What plait really holds, in bytes, at the point
right after backward (gradients reduced, optimizer states initialised):

=========  =====================  ===========================  =============
stage      parameters             gradients                    optimizer
=========  =====================  ===========================  =============
0          4 Psi                  4 Psi                        4k Psi
1          4 Psi                  4 Psi (local, reduced in place) 4k Psi / N
2          4 Psi                  4 Psi / N                    4k Psi / N
3 (FSDP2)  4 Psi / N              4 Psi / N                    4k Psi / N
=========  =====================  ===========================  =============

Stage 1 keeps the full local gradient buffers and all-reduces them in place at step time; its
shard is a slice of that buffer. Stages 1-2 pad each bucket to a multiple of N (a few elements). plait's
bf16 is autocast: parameters, gradients and optimizer states stay fp32 and the bf16 copies are
transient (they live with the activations), so the bf16 row equals the fp32 row; with FSDP2's
bf16 ``param_dtype`` the unsharded bf16 parameters exist only around each block's compute.

Setup (``predict_setup_bytes``): the peak of ``Plait.setup`` on the memory the model lives in, for the
data-parallel layouts. Setup runs in phases, each freeing its transients before the next, on top of what the rank
holds when it starts (``given``): the weights are made equal on every rank (``broadcast``: rank 0's weights sent as
one flat copy per dtype, the whole model again, when the whole model is given on every rank; ``loading``: a model
built on the meta device and read from a checkpoint shard by shard instead, the loader's own peak, on top of
``allocated``: what setup allocates for that model, the whole of it on every rank at ZeRO 0-2, its shard (the
``layout`` term) at ZeRO-3), then the layout is applied (``layout``: plait's reducer and DDP allocate their
gradient buckets, the size of the parameters; ZeRO-1 its full local gradient buffers (and, for a moment, the shard
buffers it replaces with views of them); ZeRO-2 one flat bucket beside the parameters moving into it and the
gradient shards (``/ dp``); ZeRO-3 and HSDP the parameter shards (``/ shard``) while the whole parameters are
released unit by unit; the parameters moving into ZeRO's flat buffers free their own). So ``peak = given +
allocated + max(broadcast, loading, layout)``; the optimizer states appear at the first step, not in setup. A
process's resident set measured over setup sees ``peak - given`` (``increase``) when freed memory is returned to
the system, less when the allocator reuses it.

The ZeRO paper's accounting (``accounting="paper"``) is also available: mixed-precision Adam holds
2 Psi bf16 parameters, 2 Psi bf16 gradients and K Psi = 12 Psi of fp32 master weights plus two
states; fp32 Adam holds 4 Psi + 4 Psi + 8 Psi. Stage 1 shards the K term, stage 2 also the
gradients, stage 3 also the parameters. Its total is the same 16 Psi at stage 0.

Activations (plait's GPT, fp32, no dropout): the tensors autograd saves by the end of forward are
exactly, per block, 16 BTC + 4 BT + B H T elements (LayerNorm inputs/outputs and statistics, q, k,
v, attention output and its log-sum-exp, the projection input, MLP hidden before/after GELU), and
for the head 2 BTC + 2 BT + BTV elements (final norm, logits' log-softmax) plus the int64 token ids
and targets (16 BT bytes). A checkpointed block saves only its input (BTC) and adds one block's
activations transiently while it is recomputed in backward; under selective checkpointing it keeps its input
and its matmuls' and attention's outputs, 11 BTC + B H T elements. Under bf16 autocast the fp32 formula
is an upper bound (matmul inputs are saved in bf16); it is calibrated for fp32 only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Precision = Literal["fp32", "bf16"]
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1}


@dataclass(frozen=True)
class GPTShape:
    """What the activation formula needs: per-rank micro-batch and the model's sizes."""

    micro_batch: int
    seq_len: int
    d_model: int
    n_head: int
    n_layer: int
    vocab_size: int


def gpt_num_params(n_layer: int, d_model: int, vocab_size: int, seq_len: int) -> int:
    """Trainable parameters of plait's GPT (tied head counted once)."""
    per_block = 12 * d_model * d_model + 13 * d_model  # q,k,v,proj,fc,proj weights+biases, 2 norms
    return vocab_size * d_model + seq_len * d_model + n_layer * per_block + 2 * d_model


def predict_model_state_bytes(num_params: int, *, stage: int, dp: int, precision: Precision = "fp32",
                              optimizer: str = "adamw",
                              accounting: Literal["plait", "paper"] = "plait") -> dict[str, int]:
    """Per-rank bytes of parameters, gradients and optimizer states; keys ``params``, ``grads``,
    ``optimizer``, ``total``. See the module docstring for the table it implements.
    Raises ValueError for an unknown stage, optimizer or precision.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0..3; got {stage}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}; got {optimizer!r}")
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be fp32 or bf16 for the memory model; got {precision!r}")
    n, psi, k = max(dp, 1), num_params, OPTIMIZER_STATES[optimizer]
    shard = math.ceil(psi / n)
    if accounting == "paper" and precision == "bf16":
        p_b, g_b, s_b = 2 * psi, 2 * psi, (4 + 4 * k) * psi  # K = 12 for Adam
        sharded = {"params": 2 * shard, "grads": 2 * shard, "optimizer": (4 + 4 * k) * shard}
    else:
        p_b, g_b, s_b = 4 * psi, 4 * psi, 4 * k * psi
        sharded = {"params": 4 * shard, "grads": 4 * shard, "optimizer": 4 * k * shard}
    out = {"params": p_b, "grads": g_b, "optimizer": s_b}
    if stage >= 1:
        out["optimizer"] = sharded["optimizer"]
    if stage >= 2:
        out["grads"] = sharded["grads"]
    if stage == 3:
        out["params"] = sharded["params"]
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def predict_setup_bytes(param_bytes: int, buffer_bytes: int, *, world: int, zero: int, dp: int, shard: int,
                        bucket_mb: float = 25.0, source: str = "whole", loading_bytes: int = 0) -> dict[str, int]:
    """Per-rank bytes of ``Plait.setup`` for a data-parallel layout (ZeRO 0-3, HSDP; see the module docstring):
    keys ``given``, ``allocated``, ``broadcast``, ``loading``, ``layout``, ``peak``, ``increase`` (``peak - given``).

    ``param_bytes``: the trainable parameters (fp32, whole model); ``buffer_bytes``: its buffers. ``source``:
    ``"whole"`` (the whole model materialised on every rank, rank 0's weights broadcast: today's path) or
    ``"shards"`` (a meta-device model, each rank loading only its part: nothing given, nothing broadcast, the
    loader's peak ``loading_bytes``). ``shard``: the ranks ZeRO-3 shards over (dp, or dp_shard under HSDP).
    Raises ValueError for an unknown source or ZeRO stage."""
    if source not in ("whole", "shards"):
        raise ValueError(f"source must be 'whole' or 'shards'; got {source!r}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0..3; got {zero}")
    whole = source == "whole"
    given = param_bytes + buffer_bytes if whole else 0
    broadcast = param_bytes + buffer_bytes if whole and world > 1 else 0
    allocated = param_bytes + buffer_bytes if not whole and zero < 3 else 0  # a meta model, allocated whole
    bucket = min(param_bytes, int(bucket_mb * 2**20))
    if dp < 2 and zero < 3:
        layout = 0  # one data-parallel rank: no gradient buckets, nothing to shard
    elif zero == 0:
        layout = param_bytes  # the reducer's (or DDP's) gradient buckets
    elif zero == 1:  # the full local gradient buffers, and the shard buffers each bucket makes before stage 1
        layout = param_bytes + math.ceil(param_bytes / dp)  # replaces them with views of the full ones
    elif zero == 2:  # one flat bucket beside the parameters moving into it, the other buckets' gradient shards
        layout = bucket + math.ceil((param_bytes - bucket) / dp)
    else:
        layout = math.ceil(param_bytes / max(shard, 1))  # the parameter shards
    peak = given + allocated + max(broadcast, loading_bytes, layout)
    return {"given": given, "allocated": allocated, "broadcast": broadcast, "loading": loading_bytes,
            "layout": layout, "peak": peak, "increase": peak - given}


def predict_activation_bytes(shape: GPTShape, *, checkpointing: str = "none", k: int = 1,
                             precision: Precision = "fp32") -> dict[str, int]:
    """Activation bytes saved by the end of forward (``saved``) and the transient recompute peak
    added in backward (``recompute``), per rank, for plait's GPT. fp32-calibrated; an upper bound
    under bf16 autocast (see the module docstring)."""
    B, T, C, H = shape.micro_batch, shape.seq_len, shape.d_model, shape.n_head
    block = 4 * (16 * B * T * C + 4 * B * T + B * H * T)
    head = 4 * (2 * B * T * C + 2 * B * T + B * T * shape.vocab_size) + 16 * B * T
    if checkpointing == "none":
        wrapped = 0
    elif checkpointing == "full":
        wrapped = shape.n_layer
    elif checkpointing == "every_k":
        wrapped = len(range(0, shape.n_layer, max(k, 1)))
    elif checkpointing == "selective":  # the block's input and its matmuls' and attention's outputs (q, k, v,
        kept = 4 * (11 * B * T * C + B * H * T)  # the attention output and log-sum-exp, proj, fc, MLP proj)
        return {"saved": shape.n_layer * kept + head, "recompute": block}
    else:
        raise ValueError(f"checkpointing must be none, full, every_k or selective; got {checkpointing!r}")
    saved = (shape.n_layer - wrapped) * block + wrapped * 4 * B * T * C + head
    return {"saved": saved, "recompute": block if wrapped else 0}


def format_memory_table(num_params: int, *, dp: int, stage: int, precision: Precision = "fp32",
                        optimizer: str = "adamw", shape: GPTShape | None = None,
                        checkpointing: str = "none", k: int = 1, dp_shard: int = 0) -> str:
    """Plain-text breakdown for ``plait plan memory``: plait's prediction and the paper's, in MiB. ``dp_shard``
    (HSDP, ZeRO-3): the states are sharded over that many ranks instead of ``dp``."""
    n = dp_shard or dp
    ours = predict_model_state_bytes(num_params, stage=stage, dp=n, precision=precision, optimizer=optimizer)
    paper = predict_model_state_bytes(num_params, stage=stage, dp=n, precision=precision,
                                      optimizer=optimizer, accounting="paper")
    rows = [(name, ours[key], paper[key]) for name, key in
            (("parameters", "params"), ("gradients", "grads"), ("optimizer states", "optimizer"))]
    total_ours, total_paper = ours["total"], paper["total"]
    if shape is not None:
        act = predict_activation_bytes(shape, checkpointing=checkpointing, k=k, precision=precision)
        rows.append(("activations (saved)", act["saved"], act["saved"]))
        rows.append(("activations (recompute)", act["recompute"], act["recompute"]))
        total_ours += act["saved"] + act["recompute"]
        total_paper += act["saved"] + act["recompute"]
    rows.append(("total", total_ours, total_paper))
    mib = 2**20
    head = (f"per-rank memory: {num_params:,} params, zero={stage}, dp={dp}"
            f"{f', dp_shard={dp_shard}' if dp_shard else ''}, {precision}, {optimizer}, "
            f"checkpointing={checkpointing}")
    lines = [head, f"{'':<26}{'plait (MiB)':>14}{'ZeRO paper (MiB)':>18}"]
    lines += [f"{name:<26}{a / mib:>14.3f}{b / mib:>18.3f}" for name, a, b in rows]
    return "\n".join(lines)
