"""Which features compose: plait's validation run on every pair of its layout features (``FEATURES``), and the
refusals that remain for a reason of meaning (``MEANING``). docs/layouts.md shows the matrix ``markdown()`` makes;
tests/parallel/test_matrix.py checks the page against it and that no refusal is left outside ``MEANING``.

A feature is a set of config settings; a pair is their union, validated at a world size that gives each of them the
ranks it needs (``world``). Features that set the same key to different values (ZeRO-1 and ZeRO-3, two pipeline
schedules) are alternatives, not a pair.
"""

from __future__ import annotations

import itertools
from typing import Any

from plait.config import ConfigError, load_config
from plait.validate import validate

# name -> (settings, what it is)
FEATURES: dict[str, tuple[dict[str, Any], str]] = {
    "zero1": ({"parallel.zero": 1}, "ZeRO-1"),
    "zero2": ({"parallel.zero": 2}, "ZeRO-2"),
    "zero3": ({"parallel.zero": 3}, "ZeRO-3 (FSDP2)"),
    "hsdp": ({"parallel.zero": 3, "parallel.dp_shard": 2}, "HSDP"),
    "ddp": ({"parallel.impl": "torch"}, "PyTorch DDP"),
    "tp": ({"parallel.tp": 2}, "tensor parallel"),
    "sp": ({"parallel.tp": 2, "parallel.sequence_parallel": True}, "sequence parallel"),
    "1f1b": ({"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}, "pipeline 1F1B"),
    "interleaved": ({"parallel.pp": 2, "parallel.pp_schedule": "interleaved"}, "pipeline interleaved"),
    "zbv": ({"parallel.pp": 2, "parallel.pp_schedule": "zbv"}, "pipeline zero-bubble V"),
    "ep": ({"parallel.ep": 2, "moe.num_experts": 4}, "expert parallel"),
    "cp_ring": ({"parallel.cp": 2, "parallel.cp_impl": "ring"}, "context parallel (ring)"),
    "cp_alltoall": ({"parallel.cp": 2, "parallel.cp_impl": "alltoall"}, "context parallel (all-to-all)"),
    "compile": ({"train.compile": True}, "compile (whole where it can)"),
    "compile_blocks": ({"train.compile": "blocks"}, "compile (blocks)"),
    "ckpt_full": ({"train.activation_checkpointing": "full"}, "activation checkpointing (full)"),
    "ckpt_selective": ({"train.activation_checkpointing": "selective"}, "activation checkpointing (selective)"),
    "offload": ({"train.activation_offload": True}, "activation offload"),
    "bf16": ({"train.precision": "bf16"}, "bf16"),
    "fp8": ({"train.precision": "fp8"}, "fp8"),
    "powersgd": ({"comm.compress": "powersgd"}, "PowerSGD"),
    "diloco": ({"parallel.sync": "diloco"}, "DiLoCo"),
    "replicas": ({"fault.mode": "replicas"}, "torchft replicas"),
    "ps": ({"parallel.mode": "ps"}, "parameter server"),
}

_PS = "a parameter server is data parallelism with its own consistency"
_DDP = "parallel.impl=torch is PyTorch DDP itself"
_RECOMPUTE = "recomputation and offload of the same activations exclude each other"
_FSDP = "FSDP2 reduces its gradients inside itself"
# (feature, feature) -> the reason the pair is refused; the pairs not listed compose
MEANING: dict[frozenset[str], str] = {
    **{frozenset(("ps", f)): _PS for f in ("zero1", "zero2", "zero3", "hsdp", "ddp", "tp", "sp", "1f1b",
                                           "interleaved", "zbv", "ep", "cp_ring", "cp_alltoall", "fp8",
                                           "powersgd", "diloco", "replicas")},
    **{frozenset(("ddp", f)): _DDP for f in ("zero1", "zero2", "zero3", "hsdp", "tp", "sp", "1f1b", "interleaved",
                                             "zbv", "powersgd", "diloco")},
    **{frozenset((c, "offload")): _RECOMPUTE for c in ("ckpt_full", "ckpt_selective")},
    **{frozenset((z, "powersgd")): _FSDP for z in ("zero3", "hsdp")},
}


def alternatives(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` are two choices of one setting (ZeRO-1 and ZeRO-3), or one contains the other (sequence
    parallelism is tensor parallelism's; HSDP is ZeRO-3's)."""
    sa, sb = FEATURES[a][0], FEATURES[b][0]
    clash = any(k in sb and sb[k] != v for k, v in sa.items())
    return clash or sa.items() <= sb.items() or sb.items() <= sa.items()


def settings(names: tuple[str, ...] | list[str]) -> tuple[list[str], int]:
    """The command-line overrides and the world size that give every feature of ``names`` the ranks it needs."""
    d: dict[str, Any] = {}
    for n in names:
        d.update(FEATURES[n][0])
    if d.get("parallel.sync") == "diloco" and d.get("parallel.zero") and d.get("fault.mode") != "replicas":
        d.setdefault("parallel.dp_shard", 2)  # DiLoCo's replicas of 2 ranks each, sharded inside
    tp, pp, cp = d.get("parallel.tp", 1), d.get("parallel.pp", 1), d.get("parallel.cp", 1)
    dp = 4 if d.get("parallel.dp_shard") else 2  # HSDP: 2 shard groups of 2; DiLoCo, ZeRO, ep: 2 ranks
    replicas = d.get("fault.mode") == "replicas"
    if replicas and dp == 2:  # 2 groups of what the layout inside needs (HSDP's 2 shard groups: 2 groups of 2)
        dp *= 2
    world = tp * pp * cp * dp
    over = [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in d.items()]
    over += ["--train.micro_batch_size=4", f"--train.global_batch_size={4 * dp}", "--parallel.microbatches=4"]
    if d.get("parallel.mode") == "ps":
        world = 3  # a server and 2 workers
        over[-2] = "--train.global_batch_size=8"
    if replicas:
        over.append("--parallel.dp_replicate=2")
    return over, world


def refusal(names: tuple[str, ...] | list[str]) -> str | None:
    """The first line of the ``ConfigError`` plait's validation raises for ``names`` together (None: it composes)."""
    over, world = settings(names)
    try:
        validate(load_config(overrides=over), world)
    except ConfigError as e:
        return str(e).splitlines()[0]
    return None


def pairs() -> list[tuple[str, str]]:
    """Every pair of features that are not alternatives."""
    return [(a, b) for a, b in itertools.combinations(FEATURES, 2) if not alternatives(a, b)]


def matrix() -> dict[tuple[str, str], str | None]:
    """Each pair's refusal (None: composes)."""
    return {pair: refusal(pair) for pair in pairs()}


def markdown(found: dict[tuple[str, str], str | None] | None = None) -> str:
    """The matrix as a markdown table (✓ composes; ✗ refused, with the reason's number below the table)."""
    found = matrix() if found is None else found
    names = list(FEATURES)
    reasons: list[str] = []
    head = "| | " + " | ".join(f"`{n}`" for n in names) + " |"
    rows = [head, "|---" * (len(names) + 1) + "|"]
    for a in names:
        cells = []
        for b in names:
            pair = (a, b) if (a, b) in found else (b, a)
            if a == b or pair not in found:
                cells.append("")
                continue
            msg = found[pair]
            if msg is None:
                cells.append("✓")
                continue
            why = MEANING.get(frozenset(pair), msg)
            if why not in reasons:
                reasons.append(why)
            cells.append(f"✗{reasons.index(why) + 1}")
        rows.append(f"| `{a}` | " + " | ".join(cells) + " |")
    legend = [f"{i + 1}. {why}" for i, why in enumerate(reasons)]
    return "\n".join(rows) + "\n\n" + "\n".join(legend) + "\n"
