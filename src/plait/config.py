"""Typed, strict configuration.

One dataclass per section; each field's docstring is the comment above it. A config is built from
defaults, then a TOML file, then ``--section.key=value`` overrides, and validated once. Unknown
sections or keys are errors that name the nearest valid one. The resolved config is written to the
run directory as TOML so that a run can be resumed or reproduced from it.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin


class ConfigError(ValueError):
    """A user-facing configuration error; the message says what to change."""


@dataclass
class RunConfig:
    # Run directory: config, checkpoints, metrics and exported weights go here.
    # Empty means runs/plait-<timestamp>.
    dir: str = ""


@dataclass
class ModelConfig:
    # Number of transformer blocks.
    n_layer: int = 4
    # Width of the residual stream.
    d_model: int = 128
    # Attention heads; d_model must divide by it.
    n_head: int = 4
    # Context length in tokens.
    seq_len: int = 128
    # Vocabulary size; 256 for the byte-level corpora plait ships.
    vocab_size: int = 256
    # Dropout probability on attention and residual branches.
    dropout: float = 0.0


@dataclass
class DataConfig:
    # Training data: empty for the embedded corpus, a UTF-8 text file, or a flat uint16 token file (.bin).
    path: str = ""
    # Fraction of the tokens held out (at the end of the corpus) for validation.
    val_fraction: float = 0.05


@dataclass
class TrainConfig:
    # Optimizer steps to run in total.
    steps: int = 300
    # Sequences per optimizer step, summed over all data-parallel ranks and accumulation micro-steps.
    global_batch_size: int = 32
    # Sequences per forward pass on one rank.
    micro_batch_size: int = 16
    # Seed for weights, data order and dropout.
    seed: int = 1337
    # Compute precision: fp32, bf16 (autocast) or fp16 (autocast with a dynamic loss scaler).
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # Repeatable bit for bit on CPU: deterministic algorithms, one thread order.
    deterministic: bool = False
    # Validate every this many steps (0: only at the end).
    eval_every: int = 100
    # Validation sequences per evaluation (a fixed set, split over data-parallel ranks).
    eval_sequences: int = 128
    # Write a metrics line every this many steps.
    log_every: int = 10
    # Recompute transformer blocks in backward instead of keeping their activations: none, full (every
    # block) or every_k (every checkpoint_every_k-th block).
    activation_checkpointing: Literal["none", "full", "every_k"] = "none"
    # k for activation_checkpointing=every_k.
    checkpoint_every_k: int = 2


@dataclass
class OptimConfig:
    # Peak learning rate of AdamW.
    lr: float = 3e-3
    # Learning rate at the end of the cosine decay, as a fraction of lr.
    min_lr_ratio: float = 0.1
    # Steps of linear warmup from 0 to lr.
    warmup_steps: int = 30
    # Steps over which the cosine decays; 0 means train.steps. Set it to stop early and resume later
    # on the same schedule.
    decay_steps: int = 0
    # Decoupled weight decay on matrices (not on biases, norms or embeddings).
    weight_decay: float = 0.1
    # Clip the global gradient norm to this value (0 disables clipping).
    grad_clip: float = 1.0
    # AdamW beta1.
    beta1: float = 0.9
    # AdamW beta2.
    beta2: float = 0.95
    # Fused AdamW kernel (one pass over each parameter; several times faster on CPU for large models)
    # instead of the per-parameter loop. Both are deterministic; they round differently in the last bit.
    fused: bool = False


@dataclass
class ParallelConfig:
    # Local worker processes started by `plait train` (ignored under torchrun or SLURM).
    nproc: int = 2
    # Data-parallel degree; 0 infers world size / (tp * pp * ep).
    dp: int = 0
    # Tensor-parallel degree.
    tp: int = 1
    # Pipeline-parallel degree.
    pp: int = 1
    # Expert-parallel degree.
    ep: int = 1
    # Data-parallel implementation: plait's bucketed reducer, or PyTorch DDP as the reference.
    impl: Literal["plait", "torch"] = "plait"
    # Gradient bucket size in MiB for the data-parallel all-reduce and the ZeRO reduce-scatter.
    bucket_mb: float = 25.0
    # ZeRO stage: 0 replicates everything; 1 shards optimizer states; 2 also gradients (plait's sharded
    # optimizer); 3 also parameters (FSDP2).
    zero: int = 0
    # Move state to CPU memory: optimizer (the ZeRO-1/2 optimizer shard) or params (zero=3, FSDP2).
    offload: Literal["none", "optimizer", "params"] = "none"
    # zero=3: free each block's gathered parameters after forward (false keeps them until backward).
    reshard_after_forward: bool = True
    # Tensor parallel: shard LayerNorm/dropout regions along the sequence (needs tp > 1).
    sequence_parallel: bool = False
    # Tensor parallel: compute the loss on vocabulary-sharded logits instead of gathering them.
    loss_parallel: bool = True
    # Pipeline schedule: gpipe, 1f1b, interleaved (several stages per rank) or zbv (zero-bubble V).
    pp_schedule: Literal["gpipe", "1f1b", "interleaved", "zbv"] = "1f1b"
    # Pipeline micro-batches per forward/backward of one accumulation micro-batch.
    microbatches: int = 4
    # Pipeline stages per rank; 0 picks the schedule's natural value (1, or 2 for interleaved/zbv).
    pp_virtual_stages: int = 0
    # Pipeline stage split: by per-layer cost measured in a profiling step, or by layer count.
    pp_balance: Literal["cost", "count"] = "cost"


@dataclass
class CommConfig:
    # Process-group backend: auto picks nccl when CUDA is available, gloo otherwise.
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    # Seconds a collective may wait for its peers before the job fails with a named error.
    timeout_s: float = 300.0
    # All-reduce algorithm of the data-parallel reducer: the backend's own, or plait's ring,
    # recursive halving-doubling or hierarchical (reduce in node, all-reduce across nodes, broadcast).
    allreduce: Literal["backend", "ring", "halving_doubling", "hierarchical"] = "backend"
    # Ranks per node for the hierarchical all-reduce (0: LOCAL_WORLD_SIZE from the launcher).
    ranks_per_node: int = 0
    # Gradient compression of the data-parallel reduction; auto measures the first steps and turns it on
    # only when communication is exposed.
    compress: Literal["none", "auto", "fp16", "bf16", "int8", "int4", "topk", "randomk", "powersgd"] = "none"
    # Kept fraction for topk and randomk.
    compress_ratio: float = 0.01
    # Rank of the PowerSGD approximation.
    powersgd_rank: int = 4
    # Keep the compression error per bucket and add it to the next step's gradient.
    error_feedback: bool = True
    # Stochastic rounding for int8/int4 quantization.
    stochastic_rounding: bool = False


@dataclass
class CheckpointConfig:
    # Save a sharded checkpoint every this many steps (0: only at the end).
    every: int = 200
    # Number of most recent checkpoints kept on disk.
    keep: int = 2


@dataclass
class ObserveConfig:
    # Show a progress bar on rank 0.
    progress: bool = True
    # Write TensorBoard event files to the run directory.
    tensorboard: bool = True
    # Count the collectives torch issues (DDP, FSDP2, tensor and pipeline parallelism) into comm_bytes:
    # first_step counts them on the process's first training step and adds that figure to every later
    # step (their pattern is fixed by the layout and batch shape; counting slowed a small tp=2 step
    # by 33-53%), every_step counts each step, off leaves them out of comm_bytes.
    count_torch_collectives: str = "first_step"


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)

    @property
    def grad_accum(self) -> int:
        """Micro-steps per optimizer step on one rank."""
        t = self.train
        return t.global_batch_size // (t.micro_batch_size * self.parallel.dp)


def _nearest(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.0)
    return close[0] if close else choices[0]


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def _coerce(section: str, key: str, value: Any, typ: Any) -> Any:
    """Convert a TOML or command-line value to the field's type, or raise a ConfigError."""
    where = f"{section}.{key}"
    if get_origin(typ) is Literal:
        allowed = get_args(typ)
        if value not in allowed:
            raise ConfigError(f"{where} must be one of {', '.join(map(str, allowed))}; got {value!r}")
        return value
    if get_origin(typ) in (typing.Union, types.UnionType):
        typ = next(a for a in get_args(typ) if a is not type(None))
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where} must be true or false; got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be an integer; got {value!r}")
        try:
            as_float = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be an integer; got {value!r}") from None
        if as_float != int(as_float):
            raise ConfigError(f"{where} must be an integer; got {value!r}")
        return int(as_float)
    if typ is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be a number; got {value!r}") from None
    if typ is str:
        return str(value)
    raise ConfigError(f"{where}: unsupported type {typ}")


def _set(cfg: Config, section: str, key: str, value: Any) -> None:
    sections = _sections()
    if section not in sections:
        raise ConfigError(
            f"unknown config section '{section}'; did you mean '{_nearest(section, list(sections))}'?"
        )
    obj = getattr(cfg, section)
    hints = typing.get_type_hints(type(obj))
    if key not in hints:
        valid = [f"{section}.{k}" for k in hints]
        raise ConfigError(
            f"unknown config key '{section}.{key}'; did you mean '{_nearest(f'{section}.{key}', valid)}'?"
        )
    setattr(obj, key, _coerce(section, key, value, hints[key]))


def apply_mapping(cfg: Config, data: dict[str, Any]) -> None:
    """Apply a nested {section: {key: value}} mapping (parsed TOML) onto cfg, strictly."""
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(
                f"config entry '{section}' must be a [section] table; valid sections: "
                + ", ".join(_sections())
            )
        for key, value in values.items():
            _set(cfg, section, key, value)


def apply_overrides(cfg: Config, overrides: list[str]) -> None:
    """Apply ``section.key=value`` (or ``--section.key=value``) strings onto cfg."""
    for item in overrides:
        text = item[2:] if item.startswith("--") else item
        if "=" not in text or "." not in text.split("=", 1)[0]:
            raise ConfigError(f"override '{item}' must look like --section.key=value")
        dotted, value = text.split("=", 1)
        section, key = dotted.split(".", 1)
        _set(cfg, section, key, value)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the TOML file at ``path``, then overrides; validated."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist; pass the path of a TOML file")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
        apply_mapping(cfg, data)
    apply_overrides(cfg, overrides or [])
    return cfg


def validate(cfg: Config, world_size: int) -> Config:
    """Check cross-field constraints for ``world_size`` workers and fill inferred values (parallel.dp)."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    if cfg.observe.count_torch_collectives not in ("first_step", "every_step", "off"):
        raise ConfigError(f"observe.count_torch_collectives={cfg.observe.count_torch_collectives!r}: choose "
                          "first_step, every_step or off")
    if m.d_model % m.n_head:
        raise ConfigError(f"model.d_model={m.d_model} must divide by model.n_head={m.n_head}")
    for name in ("n_layer", "d_model", "n_head", "seq_len", "vocab_size"):
        if getattr(m, name) < 1:
            raise ConfigError(f"model.{name} must be at least 1")
    for name in ("steps", "global_batch_size", "micro_batch_size"):
        if getattr(t, name) < 1:
            raise ConfigError(f"train.{name} must be at least 1")
    if not 0.0 < cfg.data.val_fraction < 1.0:
        raise ConfigError("data.val_fraction must be between 0 and 1 (exclusive)")
    if cfg.data.path and not Path(cfg.data.path).is_file():
        raise ConfigError(
            f"data file {cfg.data.path} does not exist; set data.path to a UTF-8 text file or a uint16 .bin "
            "token file, or leave it empty for the embedded corpus"
        )
    if p.bucket_mb <= 0:
        raise ConfigError("parallel.bucket_mb must be positive")
    from plait.topology import resolve_degrees  # the topology owns degree arithmetic

    degrees = resolve_degrees(cfg, world_size)
    p.dp = degrees["dp_replicate"] * degrees["dp_shard"]
    if t.checkpoint_every_k < 1:
        raise ConfigError(f"train.checkpoint_every_k must be at least 1; got {t.checkpoint_every_k}")
    from plait.parallel.zero import validate_zero

    try:
        validate_zero(p.zero, p.dp, p.offload, "cuda" if _cuda_available() else "cpu")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _validate_model_parallel(cfg)
    _validate_comm(cfg)
    if p.zero and p.impl == "torch":
        raise ConfigError(
            f"parallel.impl=torch selects PyTorch DDP, which does not shard (parallel.zero={p.zero}); "
            "use parallel.impl=plait with ZeRO"
        )
    per_step = t.micro_batch_size * p.dp
    if t.global_batch_size % per_step:
        lo = max(per_step, t.global_batch_size // per_step * per_step)
        options = sorted({lo, lo + per_step})
        divisors = [d for d in range(1, t.global_batch_size + 1) if t.global_batch_size % (d * p.dp) == 0]
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} must equal micro_batch_size "
            f"({t.micro_batch_size}) x dp ({p.dp}) x accumulation steps; try "
            f"train.global_batch_size={' or '.join(map(str, options))}, or a micro_batch_size in "
            f"{divisors[:8]}"
        )
    return cfg


def _validate_model_parallel(cfg: Config) -> None:
    """Tensor/pipeline/expert settings that cannot work, named before any worker starts."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if p.ep > 1:
        raise ConfigError("parallel.ep > 1 (expert parallelism) is not available in this build; set parallel.ep=1")
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1")
    if p.tp > 1:
        from plait.parallel.tensor import check_tensor_parallel

        check_tensor_parallel(m.n_head, m.d_model, m.vocab_size, m.seq_len, p.tp, p.sequence_parallel)
    if p.pp > 1:
        from plait.parallel.pipeline import NATURAL_VIRTUAL, check_pipeline_layout

        virtual = p.pp_virtual_stages or NATURAL_VIRTUAL.get(p.pp_schedule, 1)
        check_pipeline_layout(p.pp_schedule, p.pp, p.microbatches, virtual)
        if m.n_layer < p.pp * virtual:
            raise ConfigError(
                f"{p.pp * virtual} pipeline stages (pp={p.pp} x {virtual} per rank) but model.n_layer="
                f"{m.n_layer}: every stage needs at least one block; lower parallel.pp or raise model.n_layer"
            )
        if t.micro_batch_size % p.microbatches:
            raise ConfigError(
                f"train.micro_batch_size={t.micro_batch_size} must divide into parallel.microbatches="
                f"{p.microbatches} pipeline micro-batches; make it a multiple of {p.microbatches}"
            )
    if (p.tp > 1 or p.pp > 1) and p.impl == "torch":
        raise ConfigError(f"parallel.tp={p.tp}/pp={p.pp} compose with plait's data-parallel reducer or with "
                          "parallel.zero=3, not with PyTorch DDP; set parallel.impl=plait")
    if p.pp > 1 and p.zero:
        raise ConfigError(f"parallel.pp={p.pp} composes with plait's data-parallel reducer only in this build "
                          f"(parallel.zero={p.zero}); set parallel.zero=0")
    if p.tp > 1 and p.zero in (1, 2):
        raise ConfigError(
            f"parallel.zero={p.zero} (plait's flat-buffer sharded optimizer) does not take tensor-parallel "
            f"parameters; with parallel.tp={p.tp} use parallel.zero=3 (FSDP2 over dp on top of tp: 2-D; add "
            "parallel.reshard_after_forward=false for ZeRO-2's memory, parameters kept whole through backward) or 0"
        )


def _validate_comm(cfg: Config) -> None:
    """Communication settings that cannot work, named before any worker starts."""
    c, p = cfg.comm, cfg.parallel
    if c.timeout_s <= 0:
        raise ConfigError(f"comm.timeout_s must be positive seconds; got {c.timeout_s}")
    if c.ranks_per_node < 0:
        raise ConfigError(f"comm.ranks_per_node must be >= 1, or 0 for LOCAL_WORLD_SIZE; got {c.ranks_per_node}")
    if c.compress in ("topk", "randomk") and not 0.0 < c.compress_ratio <= 1.0:
        raise ConfigError(f"comm.compress_ratio is the kept fraction, in (0, 1]; got {c.compress_ratio}")
    if c.compress in ("powersgd", "auto") and c.powersgd_rank < 1:
        raise ConfigError(f"comm.powersgd_rank must be at least 1; got {c.powersgd_rank}")
    if c.stochastic_rounding and c.compress not in ("int8", "int4"):
        raise ConfigError(f"comm.stochastic_rounding applies to comm.compress=int8 or int4, not {c.compress}; "
                          "set comm.stochastic_rounding=false")
    if p.impl == "torch" and (c.compress != "none" or c.allreduce != "backend"):
        raise ConfigError(
            "parallel.impl=torch (PyTorch DDP) runs its own all-reduce, so comm.compress and comm.allreduce "
            "do not apply to it; set parallel.impl=plait to use them"
        )
    if p.zero == 3 and (c.compress != "none" or c.allreduce != "backend"):
        raise ConfigError(
            "parallel.zero=3 reduces gradients inside FSDP2, which comm.compress and comm.allreduce do not "
            "reach; use parallel.zero=0, 1 or 2 with them"
        )


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def to_toml(cfg: Config) -> str:
    """Render the config as TOML (sections of scalars only, which is all plait's config holds)."""
    lines: list[str] = []
    for f in dataclasses.fields(cfg):
        lines.append(f"[{f.name}]")
        for k, v in dataclasses.asdict(getattr(cfg, f.name)).items():
            if isinstance(v, bool):
                text = "true" if v else "false"
            elif isinstance(v, str):
                text = '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
            else:
                text = repr(v)
            lines.append(f"{k} = {text}")
        lines.append("")
    return "\n".join(lines)


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
