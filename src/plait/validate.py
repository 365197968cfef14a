"""Checks of a config against a world size: everything ``config.check_values`` cannot know alone.

Each check lives with the code that knows the rule (the topology owns degree arithmetic, each registered
strategy its own settings, a registered model its shape) and is gathered here, so ``plait train`` names
every impossible setting before any worker starts and ``Plait`` does the same when it is built.
"""

from __future__ import annotations

from collections.abc import Callable

from plait.components.precision import check_skip
from plait.config import Config, ConfigError, check_values
from plait.data.tokenize import resolve_vocab_size
from plait.observe.prometheus import check_prometheus
from plait.observe.trackers import check_trackers
from plait.parallel import float8
from plait.parallel.activation_checkpoint import check_checkpointing
from plait.parallel.compile import compile_unit
from plait.parallel.compose import check_layout, compile_blocks_because, resolve


def validate(cfg: Config, world_size: int, model_check: Callable[[Config, dict[str, int]], None] | None = None
             ) -> Config:
    """Check ``cfg`` for ``world_size`` workers and fill inferred values (``parallel.dp``, and
    ``train.micro_batch_size`` when 0: global batch / dp); returns cfg.

    The degrees come from ``plait.parallel.compose.resolve``; then every dimension, policy and driver checks the
    settings it owns (``plait.parallel.compose.check_layout``), and ``model_check(cfg, degrees)`` the model's and
    data's own (``plait.recipes.validate_config`` passes the registered model's; a model given to ``Plait.setup`` is
    checked there).
    """
    check_values(cfg)
    check_trackers(cfg.observe.trackers)  # a missing extra is named before any worker starts
    check_prometheus(cfg.observe.prometheus_port)
    resolve_vocab_size(cfg)  # model.vocab_size = 0: the tokenizer's
    t, p = cfg.train, cfg.parallel
    degrees = resolve(cfg, world_size)
    p.dp = degrees["dp_replicate"] * degrees["dp_shard"] * degrees["ep"]
    if t.micro_batch_size == 0:  # one micro-step per optimizer step (a loader's own batch size may change it)
        if t.global_batch_size % p.dp:
            raise ConfigError(f"train.global_batch_size={t.global_batch_size} must divide over dp={p.dp} "
                              f"data-parallel ranks; choose a multiple of {p.dp}")
        t.micro_batch_size = t.global_batch_size // p.dp
    check_layout(cfg, degrees)
    check_checkpointing(t.activation_checkpointing, t.checkpoint_every_k, t.checkpoint_save_ops, t.activation_offload)
    float8.check_config(cfg)
    check_skip(t.precision, cfg.optim.skip_nonfinite)
    compile_unit(cfg, compile_blocks_because(cfg))  # train.compile=model where the layout needs blocks: refused here
    if model_check is not None:
        model_check(cfg, degrees)
    per_step = t.micro_batch_size * p.dp
    if t.global_batch_size % per_step:
        lo = max(per_step, t.global_batch_size // per_step * per_step)
        options = sorted({lo, lo + per_step})
        divisors = [d for d in range(1, t.global_batch_size + 1) if t.global_batch_size % (d * p.dp) == 0]
        model_parallel = p.tp * p.pp * p.cp
        worlds = [d * model_parallel for d in range(1, t.global_batch_size // t.micro_batch_size + 1)
                  if t.global_batch_size % (t.micro_batch_size * d) == 0]
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} must equal micro_batch_size "
            f"({t.micro_batch_size}) x dp ({p.dp}) x accumulation steps; try "
            f"train.global_batch_size={' or '.join(map(str, options))}, or a micro_batch_size in "
            f"{divisors[:8]}; world sizes that keep this global and micro batch: {worlds[:12]}"
        )
    return cfg
