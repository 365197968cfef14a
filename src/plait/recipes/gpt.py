"""The ``gpt`` recipe: plait's GPT on a token corpus.

Registered as model ``gpt`` (built from ``[model]``'s n_layer, d_model, ...; loss ``causal_lm``; data
``text``) and data ``text`` (the embedded corpus, a UTF-8 file or a uint16 ``.bin`` token file, cut
into ``model.seq_len`` windows). The GPT class gets two parallelization hooks
(``plait.parallel.plans``, which registers them): its Megatron tensor-parallel layout and its pipeline
stages. The engine and the trainer know nothing of either; they find them through the registry.

The tensor-parallel plan and the pipeline stages of the GPT live in ``plait.parallel.gpt_plans``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from plait.config import Config, ConfigError

if TYPE_CHECKING:
    from plait.models.gpt import GPT


# -- recipe ----------------------------------------------------------------------------------------
def build_model(cfg: Config) -> GPT:
    from plait.models.gpt import GPT

    return GPT(cfg.model, cfg.moe)


def check_model(cfg: Config, degrees: dict[str, int]) -> None:
    """The GPT's shape against the layout, before any worker starts."""
    from plait.parallel.gpt_plans import check_tensor_parallel
    from plait.plan.schedule import NATURAL_VIRTUAL

    m, p = cfg.model, cfg.parallel
    if m.d_model % m.n_head:
        raise ConfigError(f"model.d_model={m.d_model} must divide by model.n_head={m.n_head}")
    if degrees["tp"] > 1:
        check_tensor_parallel(m.n_head, m.d_model, m.vocab_size, m.seq_len, degrees["tp"], p.sequence_parallel)
    if degrees["pp"] > 1:
        virtual = p.pp_virtual_stages or NATURAL_VIRTUAL.get(p.pp_schedule, 1)
        if m.n_layer < degrees["pp"] * virtual:
            raise ConfigError(
                f"{degrees['pp'] * virtual} pipeline stages (pp={degrees['pp']} x {virtual} per rank) but "
                f"model.n_layer={m.n_layer}: every stage needs at least one block; lower parallel.pp or raise "
                "model.n_layer"
            )


def build_text(cfg: Config) -> tuple[Any, Any]:
    """``text``: training windows with a new offset every epoch, and the fixed validation windows."""
    from plait.data.corpus import load_splits
    from plait.data.text import TokenWindows

    m = cfg.model
    splits = load_splits(cfg.data.path, m.vocab_size, cfg.data.val_fraction, m.seq_len)
    train = TokenWindows(splits.train, m.seq_len, epoch_offsets=True, seed=cfg.train.seed)
    val = TokenWindows(splits.val, m.seq_len, limit=cfg.train.eval_sequences)
    train.source = splits.source  # type: ignore[attr-defined]
    return train, val


def check_text(cfg: Config) -> None:
    if cfg.data.path and not Path(cfg.data.path).is_file():
        raise ConfigError(
            f"data file {cfg.data.path} does not exist; set data.path to a UTF-8 text file or a uint16 .bin token "
            "file, or leave it empty for the embedded corpus"
        )
