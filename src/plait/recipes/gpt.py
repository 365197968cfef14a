"""The ``gpt`` recipe: plait's GPT on a token corpus.

Registered as model ``gpt`` (built from ``[model]``'s n_layer, d_model, ...; loss ``causal_lm``; data
``text``) and data ``text`` (the embedded corpus, a UTF-8 file or a uint16 ``.bin`` token file, cut
into ``model.seq_len`` windows). What plait knows of the GPT class (its Megatron tensor-parallel layout,
its pipeline stages, its context-parallel routing, its shape and FLOPs) lives in its folder,
``plait.models.gpt``, registered once as one spec (``plait.models.gpt.spec``). The engine and the trainer
know nothing of it; they find it through the registry (``plait.parallel.train_spec.spec_for``).
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

    return GPT(cfg.model, cfg.moe, document_mask=cfg.data.document_mask)


def check_model(cfg: Config, degrees: dict[str, int]) -> None:
    """The GPT's shape against the layout, before any worker starts."""
    from plait.models.gpt.parallelize import check_tensor_parallel
    from plait.plan.schedule import NATURAL_VIRTUAL

    m, p = cfg.model, cfg.parallel
    if m.d_model % m.n_head:
        raise ConfigError(f"model.d_model={m.d_model} must divide by model.n_head={m.n_head}")
    if degrees["tp"] > 1:
        check_tensor_parallel(m.n_head, m.d_model, m.vocab_size, m.seq_len, degrees["tp"], p.sequence_parallel)
    if packed_documents(cfg) and (degrees["pp"] > 1 or p.sequence_parallel):
        raise ConfigError("packed documents (data.pack) carry per-token position ids, which the GPT's pipeline stages "
                          "and sequence-parallel position embedding do not take; use parallel.pp=1 and "
                          "parallel.sequence_parallel=false, or data.pack=false")
    cp = degrees.get("cp", 1)
    if cp > 1:
        from plait.parallel.context.sharding import check_length

        check_length(m.seq_len, cp, "model.seq_len")
        if p.cp_impl == "alltoall":
            from plait.parallel.context.alltoall import check_heads

            check_heads(m.n_head, cp, "heads (model.n_head)")
        if m.dropout > 0:
            raise ConfigError(f"parallel.cp={cp} computes attention without dropout, but model.dropout={m.dropout}; "
                              "set model.dropout=0 or parallel.cp=1")
    if degrees["pp"] > 1:
        virtual = p.pp_virtual_stages or NATURAL_VIRTUAL.get(p.pp_schedule, 1)
        if m.n_layer < degrees["pp"] * virtual:
            raise ConfigError(
                f"{degrees['pp'] * virtual} pipeline stages (pp={degrees['pp']} x {virtual} per rank) but "
                f"model.n_layer={m.n_layer}: every stage needs at least one block; lower parallel.pp or raise "
                "model.n_layer"
            )


def packed_documents(cfg: Config) -> bool:
    from plait.data.build import packs, reads_documents

    return reads_documents(cfg.data) and packs(cfg.data)


def build_text(cfg: Config) -> tuple[Any, Any]:
    """``text``: training windows with a new offset every epoch, and the fixed validation windows; documents
    (files with a tokenizer, cached or streamed) through ``plait.data.build``."""
    from plait.data.build import build_documents, reads_documents
    from plait.data.corpus import load_splits
    from plait.data.text import TokenWindows

    if reads_documents(cfg.data):
        import torch.distributed as dist

        return build_documents(cfg, show_progress=not dist.is_initialized() or dist.get_rank() == 0)
    m = cfg.model
    splits = load_splits(cfg.data.path, m.vocab_size, cfg.data.val_fraction, m.seq_len)
    train = TokenWindows(splits.train, m.seq_len, epoch_offsets=True, seed=cfg.train.seed)
    val = TokenWindows(splits.val, m.seq_len, limit=cfg.train.eval_sequences)
    train.source = splits.source  # type: ignore[attr-defined]
    return train, val


def check_text(cfg: Config) -> None:
    from plait.data.build import check_documents, reads_documents

    if reads_documents(cfg.data):
        check_documents(cfg)
        return
    if cfg.data.path and not Path(cfg.data.path).is_file():
        raise ConfigError(
            f"data file {cfg.data.path} does not exist; set data.path to a UTF-8 text file or a uint16 .bin token "
            "file, or leave it empty for the embedded corpus"
        )
