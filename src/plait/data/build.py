"""The ``text`` data set from ``[data]``: today's token sources, or documents cached or streamed.

``data.path`` is read as documents (``plait.data.files``) when ``data.tokenizer`` is set, when
``data.streaming`` is set, or when it names a directory, a glob, or a ``.parquet`` / ``.jsonl`` / ``.json``
/ ``.arrow`` file. Otherwise (empty, one UTF-8 text file or any other single file, a ``.bin`` token
file, no tokenizer) it is today's byte or token stream (``plait.data.corpus``), unchanged.

Documents give training data and a fixed validation set of ``train.eval_sequences`` windows:

* cached (``data.streaming = false``): the token cache (``plait.data.cache``), training windows over the
  training documents with a new offset every epoch (``plait.data.windows``), for plait's loader.
* streamed: a ``plait.data.stream.StreamingDataset``; the validation windows are read once at the start
  from the held-out documents, in file order, as many as needed.

Validation documents come from ``data.val_path``, else the ``data.val_fraction`` of documents that
``plait.data.packing.held_out`` picks by a hash of their text and ``train.seed``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from plait.config import Config, DataConfig
from plait.data.errors import DataError
from plait.data.files import FORMATS, DataFiles
from plait.data.packing import Packer, held_out, model_fields
from plait.data.tokenize import load_tokenizer

DOCUMENT_SUFFIXES = {s for s in FORMATS if s != ".txt"}


def reads_documents(d: DataConfig) -> bool:
    """Whether ``data.path`` is read as documents (see the module docstring)."""
    if d.tokenizer or d.streaming:
        return True
    if not d.path:
        return False
    p = Path(d.path)
    if p.is_dir() or any(c in d.path for c in "*?["):
        return True
    return p.suffix in DOCUMENT_SUFFIXES  # a missing .txt/.bin keeps today's message


def packs(d: DataConfig) -> bool:
    return d.pack if isinstance(d.pack, bool) else bool(d.tokenizer)


def check_documents(cfg: Config) -> DataFiles:
    """Everything about the documents that can be known before training: files, columns, tokenizer."""
    d = cfg.data
    if not d.path:
        raise DataError("data.tokenizer and data.streaming read documents from data.path; set data.path to a file, "
                        "directory or glob of .parquet, .jsonl, .arrow or .txt files")
    if Path(d.path).suffix == ".bin":
        raise DataError(f"{d.path} is a token file (.bin): it is read without data.tokenizer and data.streaming; "
                        "unset them, or point data.path at the documents")
    files = DataFiles(d.path, d.text_field)
    if d.val_path:
        DataFiles(d.val_path, d.text_field)
    load_tokenizer(d.tokenizer)
    readers = max(1, cfg.parallel.dp) * max(1, d.num_workers)
    if d.streaming and readers > len(files.units):
        raise DataError(f"{files.describe()} hold {len(files.units)} units (Parquet row groups, Arrow record batches, "
                        f"other files), fewer than the {readers} stream readers (data-parallel ranks x "
                        "data.num_workers); write more (smaller) row groups or shards, or lower data.num_workers")
    return files


def _fields(cfg: Config) -> tuple[str, ...]:
    plait_gpt = not cfg.model.factory and cfg.model.name == "gpt"
    return model_fields(plait_gpt, cfg.data.document_mask)


def build_documents(cfg: Config, show_progress: bool = True) -> tuple[Any, Any]:
    """``(train, eval)`` of the documents ``[data]`` names (see the module docstring)."""
    from plait.data.cache import cached_tokens
    from plait.data.stream_state import StreamingDataset, StreamSpec
    from plait.data.windows import DocStream, StreamWindows

    d, m, t = cfg.data, cfg.model, cfg.train
    files = check_documents(cfg)
    tok = load_tokenizer(d.tokenizer)
    val_files = DataFiles(d.val_path, d.text_field) if d.val_path else None
    fraction = 0.0 if val_files is not None else d.val_fraction
    pack, fields = packs(d), _fields(cfg)
    source = files.describe() + (f", tokenizer {d.tokenizer}" if d.tokenizer else ", bytes")
    if d.streaming:
        spec = StreamSpec(files, tok, m.seq_len, t.micro_batch_size, pack, t.seed, fraction,
                          shuffle_buffer=d.shuffle_buffer, fields=fields)
        train: Any = StreamingDataset(spec, source + ", streamed")
        val = eval_windows(val_files or files, tok, cfg, keep_held_out=val_files is None, fraction=fraction)
        return train, val
    cached = cached_tokens(files, tok, d.cache_dir, d.tokenize_processes, show_progress)
    val_masks = [held_out(f.doc_hash, t.seed, fraction) for f in cached]
    train_stream = DocStream(cached, [~v for v in val_masks])
    if val_files is not None:
        vcached = cached_tokens(val_files, tok, d.cache_dir, d.tokenize_processes, show_progress)
        val_stream = DocStream(vcached, [np.ones(len(f.doc_hash), dtype=bool) for f in vcached])
    else:
        val_stream = DocStream(cached, val_masks)
    train = StreamWindows(train_stream, m.seq_len, pack=pack, epoch_offsets=True, seed=t.seed, fields=fields)
    val = StreamWindows(val_stream, m.seq_len, pack=pack, limit=t.eval_sequences, fields=fields)
    if len(val) == 0:
        raise DataError(f"the validation documents hold {val_stream.num_tokens} tokens, not one window of "
                        f"model.seq_len={m.seq_len}; raise data.val_fraction or give data.val_path")
    train.source = f"{source}, {train_stream.num_docs} training documents cached"  # type: ignore[attr-defined]
    return train, val


def eval_windows(files: DataFiles, tok: Any, cfg: Config, *, keep_held_out: bool, fraction: float) -> list[Any]:
    """The first ``train.eval_sequences`` windows of the validation documents, read in file order."""
    m, t = cfg.model, cfg.train
    packer = Packer(m.seq_len, 1, packs(cfg.data), _fields(cfg))
    out: list[Any] = []
    eos = [tok.eos_id] if tok.eos_id is not None else []
    for unit in files.units:
        texts = files.read(unit)
        if fraction > 0:
            from plait.data.packing import doc_hash

            val = held_out(np.fromiter((doc_hash(x) for x in texts), dtype=np.uint64, count=len(texts)), t.seed,
                           fraction)
            rows = [j for j in range(len(texts)) if val[j] == keep_held_out]
        else:
            rows = list(range(len(texts)))
        for j, ids in zip(rows, tok.encode_batch([texts[j] for j in rows]), strict=True):
            packer.add(np.asarray(ids + eos, dtype=np.int64), files.doc_id(unit, j))
            while packer.ready() and len(out) < t.eval_sequences:
                batch = packer.batch(packer.take())
                out.append({k: v[0] for k, v in batch.items()} if isinstance(batch, dict)
                           else (batch[0][0], batch[1][0]))
        if len(out) >= t.eval_sequences:
            return out
    if not out:
        raise DataError(f"the validation documents hold less than one window of model.seq_len={m.seq_len} tokens; "
                        "raise data.val_fraction or give data.val_path")
    return out
