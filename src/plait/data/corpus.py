"""Token sources: the embedded corpus, UTF-8 text files, and flat uint16 token files.

The embedded default is the Python documentation text that ships with CPython
(``pydoc_data.topics``, about 465 KB), tokenized as bytes (vocabulary 256), so that ``plait train``
needs no download. The last ``val_fraction`` of the tokens is held out for validation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from plait.data.errors import DataError

__all__ = ["DataError", "TokenSplits", "embedded_corpus_bytes", "load_splits"]


def embedded_corpus_bytes() -> bytes:
    """The pydoc topics text, joined in sorted key order so it is the same on every rank and run."""
    from pydoc_data import topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics)).encode("utf-8")


@dataclass
class TokenSplits:
    train: torch.Tensor  # (N_train,) int64 token ids
    val: torch.Tensor  # (N_val,) int64 token ids
    source: str


def _load_tokens(path: str, vocab_size: int) -> tuple[np.ndarray, str]:
    if not path:
        return np.frombuffer(embedded_corpus_bytes(), dtype=np.uint8), "embedded pydoc_data.topics"
    p = Path(path)
    if not p.is_file():
        raise DataError(
            f"data file {p} does not exist; set data.path to a UTF-8 text file or a uint16 .bin token "
            "file, or leave it empty for the embedded corpus"
        )
    if p.suffix == ".bin":
        if p.stat().st_size % 2:
            raise DataError(f"{p} has an odd number of bytes; a .bin token file must hold uint16 tokens")
        tokens = np.fromfile(p, dtype=np.uint16)
        if tokens.size and int(tokens.max()) >= vocab_size:
            raise DataError(
                f"{p} holds token id {int(tokens.max())} but model.vocab_size={vocab_size}; "
                f"set model.vocab_size to at least {int(tokens.max()) + 1}"
            )
        return tokens, str(p)
    raw = p.read_bytes()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{p} is not UTF-8 text ({e.reason} at byte {e.start}); convert it, or pass a uint16 .bin "
            "token file"
        ) from None
    if vocab_size < 256:
        raise DataError(f"byte-level text needs model.vocab_size >= 256; got {vocab_size}")
    return np.frombuffer(raw, dtype=np.uint8), str(p)


def load_splits(path: str, vocab_size: int, val_fraction: float, seq_len: int) -> TokenSplits:
    """Load tokens and split them into train and validation parts, each long enough for one sequence."""
    tokens, source = _load_tokens(path, vocab_size)
    n_val = int(len(tokens) * val_fraction)
    if n_val < seq_len + 1 or len(tokens) - n_val < 2 * seq_len + 1:
        raise DataError(
            f"{source} has {len(tokens)} tokens: too few for model.seq_len={seq_len} with "
            f"data.val_fraction={val_fraction}; use more data or a shorter model.seq_len"
        )
    t = torch.from_numpy(tokens.astype(np.int64))
    return TokenSplits(train=t[: len(t) - n_val], val=t[len(t) - n_val:], source=source)
