"""Tokenizers: a local Hugging Face tokenizer (``data.tokenizer``), or bytes when it is empty.

``data.tokenizer`` names a directory holding ``tokenizer.json`` (as ``save_pretrained`` writes it) or the
``tokenizer.json`` file itself; it is loaded with the ``tokenizers`` library (the ``data`` extra), never
from a hub. The end-of-document token appended to every document is the one ``tokenizer_config.json``
names as ``eos_token`` when the directory has that file, else the first special token among
``<|endoftext|>``, ``</s>``, ``<eos>``, ``<|end_of_text|>``, ``[EOS]``, ``<|eot_id|>``. Bytes (vocabulary
256) have no such token: documents are packed only with a tokenizer.

``model.vocab_size = 0`` means "the tokenizer's" (its vocabulary with added tokens, or 256 for bytes);
an explicit value must cover it (``resolve_vocab_size``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from plait.config import Config
from plait.data.errors import DataError

BYTE_VOCAB = 256
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[EOS]", "<|eot_id|>")


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255 (today's text corpora); no end-of-document token."""

    vocab_size = BYTE_VOCAB
    eos_id: int | None = None
    fingerprint = "bytes"

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` loaded from a local ``tokenizer.json``.

    Pickles by its file path (DataLoader workers and tokenising processes load their own copy)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.file = tokenizer_file(path)
        self._load()

    def _load(self) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError("data.tokenizer needs the tokenizers library: pip install 'plait[data]' "
                            "(or pip install tokenizers)") from None
        try:
            self.tok = Tokenizer.from_file(str(self.file))
        except Exception as e:
            raise DataError(f"{self.file} is not a tokenizer.json the tokenizers library can load ({e}); save it with "
                            "tokenizer.save(path) or save_pretrained(dir)") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._eos_id()
        self.fingerprint = hashlib.blake2b(self.file.read_bytes(), digest_size=16).hexdigest()

    def _eos_id(self) -> int | None:
        config = self.file.parent / "tokenizer_config.json"
        names: list[str] = []
        if config.is_file():
            try:
                eos = json.loads(config.read_text()).get("eos_token")
            except ValueError:
                eos = None
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str):
                names.append(eos)
        for name in (*names, *EOS_CANDIDATES):
            token_id = self.tok.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = state["path"]
        self.file = tokenizer_file(self.path)
        self._load()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast (tokenizers >= 0.21) skips the character offsets nothing here reads
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


def tokenizer_file(path: str) -> Path:
    """The ``tokenizer.json`` that ``data.tokenizer`` names, or a ``DataError`` saying what to point at."""
    p = Path(path)
    if p.is_dir():
        f = p / "tokenizer.json"
        if not f.is_file():
            found = sorted(x.name for x in p.iterdir())[:8]
            raise DataError(f"data.tokenizer directory {p} holds no tokenizer.json (found: "
                            f"{', '.join(found) or 'nothing'}); save the tokenizer there with save_pretrained(dir), "
                            "or point at the tokenizer.json file")
        return f
    if p.is_file():
        return p
    raise DataError(f"data.tokenizer {p} does not exist; point it at a directory with tokenizer.json or at the file")


def load_tokenizer(path: str) -> ByteTokenizer | HFTokenizer:
    """The tokenizer ``data.tokenizer`` names (bytes when empty)."""
    return HFTokenizer(path) if path else ByteTokenizer()


def resolve_vocab_size(cfg: Config) -> None:
    """Fill ``model.vocab_size = 0`` with the tokenizer's vocabulary (256 for bytes); raise a ``DataError``
    when an explicit ``model.vocab_size`` is smaller than the tokenizer's. Only the built-in data sets
    read ``data.tokenizer``; with ``data.factory`` or another ``data.name`` a zero means 256."""
    m, d = cfg.model, cfg.data
    uses_tokenizer = bool(d.tokenizer) and not d.factory
    if not uses_tokenizer:
        if m.vocab_size == 0:
            m.vocab_size = BYTE_VOCAB
        return
    vocab = load_tokenizer(d.tokenizer).vocab_size
    if m.vocab_size == 0:
        m.vocab_size = vocab
    elif m.vocab_size < vocab:
        raise DataError(f"the tokenizer {d.tokenizer} has {vocab} tokens but model.vocab_size={m.vocab_size}; set "
                        f"model.vocab_size to at least {vocab}, or to 0 to take the tokenizer's")


def check_model_vocab(model: Any, cfg: Config) -> None:
    """A model from ``model.factory`` must embed every token id of ``data.tokenizer``: a ``DataError`` naming
    both sizes otherwise (a model with no ``get_input_embeddings`` is not checked)."""
    d = cfg.data
    get = getattr(model, "get_input_embeddings", None)
    if not d.tokenizer or d.factory or not callable(get):
        return
    rows = getattr(get(), "num_embeddings", None)
    vocab = load_tokenizer(d.tokenizer).vocab_size
    if rows is not None and rows < vocab:
        raise DataError(f"the tokenizer {d.tokenizer} has {vocab} tokens but the model embeds {rows}; build the model "
                        f"with a vocabulary of at least {vocab} (resize_token_embeddings({vocab}))")
