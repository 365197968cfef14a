"""Checks of a config against a world size: everything ``config.check_values`` cannot know alone.

Each check lives with the code that knows the rule (the topology owns degree arithmetic, ZeRO its
stages and offload, the pipeline its schedules, a registered model its shape) and is gathered here, so
``plait train`` names every impossible setting before any worker starts and ``Plait`` does the same
when it is built.
"""

from __future__ import annotations

from plait.config import Config, ConfigError, check_values
from plait.parallel.pipeline import NATURAL_VIRTUAL, check_pipeline_layout
from plait.parallel.zero import validate_zero
from plait.topology import resolve_degrees


def validate(cfg: Config, world_size: int, *, model_checks: bool = True) -> Config:
    """Check ``cfg`` for ``world_size`` workers and fill inferred values (``parallel.dp``); returns cfg.

    ``model_checks=False`` leaves out the registered model's and data set's own checks (for a model
    passed to ``Plait.setup`` rather than named in the config).
    """
    check_values(cfg)
    from plait.data.tokenize import resolve_vocab_size

    resolve_vocab_size(cfg)  # model.vocab_size = 0: the tokenizer's
    t, p = cfg.train, cfg.parallel
    if p.mode == "ps":  # the workers are the data-parallel ranks; the servers hold no batch
        from plait.ps.roles import check_ps

        degrees = {"pp": 1, "dp_replicate": check_ps(cfg, world_size), "dp_shard": 1, "ep": 1, "tp": 1}
    else:
        degrees = resolve_degrees(cfg, world_size)
    p.dp = degrees["dp_replicate"] * degrees["dp_shard"] * degrees["ep"]
    try:
        validate_zero(p.zero, p.dp, p.offload, "cuda" if _cuda_available() else "cpu")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_composition(cfg)
    if model_checks:
        from plait.recipes import check_recipe

        check_recipe(cfg, degrees)
    per_step = t.micro_batch_size * p.dp
    if t.global_batch_size % per_step:
        lo = max(per_step, t.global_batch_size // per_step * per_step)
        options = sorted({lo, lo + per_step})
        divisors = [d for d in range(1, t.global_batch_size + 1) if t.global_batch_size % (d * p.dp) == 0]
        model_parallel = p.tp * p.pp
        worlds = [d * model_parallel for d in range(1, t.global_batch_size // t.micro_batch_size + 1)
                  if t.global_batch_size % (t.micro_batch_size * d) == 0]
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} must equal micro_batch_size "
            f"({t.micro_batch_size}) x dp ({p.dp}) x accumulation steps; try "
            f"train.global_batch_size={' or '.join(map(str, options))}, or a micro_batch_size in "
            f"{divisors[:8]}; world sizes that keep this global and micro batch: {worlds[:12]}"
        )
    return cfg


def _check_composition(cfg: Config) -> None:
    """Layout combinations that cannot work, whatever the model."""
    p, t, c = cfg.parallel, cfg.train, cfg.comm
    from plait.parallel.expert import check_expert_layout

    check_expert_layout(cfg)
    from plait.parallel.compile import check_compile

    check_compile(cfg)
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1")
    if p.pp > 1:
        virtual = p.pp_virtual_stages or NATURAL_VIRTUAL.get(p.pp_schedule, 1)
        try:
            check_pipeline_layout(p.pp_schedule, p.pp, p.microbatches, virtual)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if t.micro_batch_size % p.microbatches:
            raise ConfigError(
                f"train.micro_batch_size={t.micro_batch_size} must divide into parallel.microbatches="
                f"{p.microbatches} pipeline micro-batches; make it a multiple of {p.microbatches}"
            )
    if p.zero and p.impl == "torch":
        raise ConfigError(
            f"parallel.impl=torch selects PyTorch DDP, which does not shard (parallel.zero={p.zero}); "
            "use parallel.impl=plait with ZeRO"
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
    if p.sync_batchnorm and (p.tp > 1 or p.pp > 1):
        raise ConfigError("parallel.sync_batchnorm applies to data parallelism and ZeRO; set it false with tp/pp")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
