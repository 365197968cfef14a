"""Documents into fixed-length rows: the held-out split, the packer, and the packed batch's fields.

Every document is tokenised and the end-of-document token appended; the documents are then laid end to
end and cut into rows, so no position is padding. Two row formats:

* packed (``data.pack``): rows of ``T = model.seq_len`` tokens, returned as a dict of (B, T) int64
  tensors ``{input_ids, labels, position_ids, doc_ids}``. ``labels`` follow Hugging Face's convention
  (the inputs themselves, shifted by the loss): ``-100`` where a document starts inside a row, so no
  position learns to predict one document from another. ``position_ids`` restart at 0 where a document
  starts and at the start of each row. ``doc_ids`` name each token's document (see ``doc_occurrence``).
* unpacked: windows of ``T + 1`` tokens, returned as ``(x, y)`` with ``y`` the next token of ``x``
  (today's text windows); consecutive windows share one token.

The held-out split is by document: a document is validation when a hash of its text mixed with the seed
falls below ``data.val_fraction``, the same on every rank, reader and resume.
"""

from __future__ import annotations

import numpy as np
import torch

from plait.data.split import doc_hash, held_out

IGNORE_INDEX = -100
EPOCH_BIT = 62  # doc_ids carry the epoch's parity here (streaming), see doc_occurrence
__all__ = ["EPOCH_BIT", "PACKED_FIELDS", "Packer", "doc_hash", "doc_occurrence", "document_causal_mask", "held_out",
           "model_fields", "packed_fields", "rows_to_batch"]


def doc_occurrence(doc_id: int, epoch: int) -> int:
    """The id a streamed document carries in ``doc_ids``: its data-set id (``file << 40 | row``) with the
    epoch's parity in bit 62, so the same document read at the end of one epoch and the start of the next
    is two documents to the attention mask."""
    return doc_id | ((epoch & 1) << EPOCH_BIT)


def document_causal_mask(doc_ids: torch.Tensor, key_doc_ids: torch.Tensor | None = None,
                         query_offset: int = 0) -> torch.Tensor:
    """A boolean attention mask, True where a query may attend a key: same document and not later.

    ``doc_ids``: (B, Tq) the queries' document ids; ``key_doc_ids``: (B, Tk) the keys' (default: the
    queries' own); ``query_offset``: the position of the first query among the keys (a query at position
    ``query_offset + i`` sees keys ``0..query_offset + i``), so a layer or layout holding a slice of the
    queries (a context-parallel rank) builds its part. Returns (B, 1, Tq, Tk), broadcast over heads, as
    ``torch.nn.functional.scaled_dot_product_attention`` takes it.
    """
    keys = doc_ids if key_doc_ids is None else key_doc_ids
    tq, tk = doc_ids.size(1), keys.size(1)
    same = doc_ids[:, :, None] == keys[:, None, :]  # (B, Tq, Tk)
    q_pos = torch.arange(tq, device=doc_ids.device)[:, None] + query_offset
    causal = torch.arange(tk, device=doc_ids.device)[None, :] <= q_pos  # (Tq, Tk)
    return (same & causal)[:, None]


def packed_fields(tokens: torch.Tensor, docs: torch.Tensor) -> dict[str, torch.Tensor]:
    """The packed batch of ``tokens`` and their ``docs``, both (B, T) int64 (see the module docstring)."""
    B, T = tokens.shape
    starts = torch.ones_like(tokens, dtype=torch.bool)  # (B, T): a document starts here (or the row does)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    idx = torch.arange(T).expand(B, T)
    last_start = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    labels = tokens.clone()
    inner = starts.clone()
    inner[:, 0] = False
    labels[inner] = IGNORE_INDEX
    return {"input_ids": tokens, "labels": labels, "position_ids": idx - last_start, "doc_ids": docs}


PACKED_FIELDS = ("input_ids", "labels", "position_ids", "doc_ids")


def rows_to_batch(tokens: np.ndarray, docs: np.ndarray | None, pack: bool,
                  fields: tuple[str, ...] = PACKED_FIELDS) -> object:
    """A (B, L) block of tokens as the loader's batch: the packed ``fields``, or ``(x, y)`` for L = T + 1."""
    t = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))
    if pack:
        out = packed_fields(t, torch.from_numpy(np.ascontiguousarray(docs, dtype=np.int64)))
        if "attention_mask" in fields:
            out["attention_mask"] = document_causal_mask(out["doc_ids"])
        return {k: out[k] for k in fields}
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def model_fields(plait_gpt: bool, document_mask: bool) -> tuple[str, ...]:
    """The packed fields a model takes: plait's GPT all four (it masks by ``doc_ids`` when asked). A Hugging
    Face model never gets ``doc_ids`` (not an argument of its forward); with ``document_mask`` it gets the
    restarting ``position_ids`` and ``attention_mask``, the (B, 1, T, T) boolean ``document_causal_mask``
    (True: attend), which transformers passes as it is to its sdpa attention (the default; not to eager or
    flash-attention-2 kernels); without, neither (positions 0..T-1 and a causal mask, as unpacked text)."""
    if plait_gpt:
        return PACKED_FIELDS
    return ("input_ids", "labels", "position_ids", "attention_mask") if document_mask else ("input_ids", "labels")


class Packer:
    """Lays documents end to end and hands out blocks of ``rows`` rows.

    Packed rows hold ``seq_len`` tokens each; unpacked windows ``seq_len + 1``, the next window starting
    at the last token of the previous one. ``carry()`` / ``restore()`` are the state between documents:
    the tokens laid down but not yet handed out (fewer than one block, plus one long document's rest).
    """

    def __init__(self, seq_len: int, rows: int, pack: bool, fields: tuple[str, ...] = PACKED_FIELDS) -> None:
        self.seq_len, self.rows, self.pack, self.fields = seq_len, rows, pack, fields
        self.window = seq_len if pack else seq_len + 1
        self._tokens: list[np.ndarray] = []
        self._docs: list[np.ndarray] = []
        self._size = 0

    def add(self, tokens: np.ndarray, doc: int) -> None:
        if len(tokens):
            self._tokens.append(np.asarray(tokens, dtype=np.int64))
            self._docs.append(np.full(len(tokens), doc, dtype=np.int64))
            self._size += len(tokens)

    def ready(self) -> bool:
        return self._size >= self._need()

    def _need(self) -> int:
        # unpacked windows overlap by one token: a block needs one token more than it consumes
        return self.rows * self.seq_len + (0 if self.pack else 1)

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """The next block (call when ``ready()``): tokens and their documents, (rows, window) int64 arrays;
        ``batch(block)`` makes it the loader's batch. Arrays, not tensors: a DataLoader worker sends them by
        value, cheaper than a shared-memory segment per small tensor."""
        tokens, docs = np.concatenate(self._tokens), np.concatenate(self._docs)
        n = self.rows * self.seq_len
        if self.pack:
            block = tokens[:n].reshape(self.rows, self.seq_len), docs[:n].reshape(self.rows, self.seq_len)
        else:
            ar = np.arange(self.rows)[:, None] * self.seq_len + np.arange(self.window)[None, :]
            block = tokens[ar], docs[ar]
        self._tokens, self._docs, self._size = [tokens[n:]], [docs[n:]], len(tokens) - n
        return block

    def batch(self, block: tuple[np.ndarray, np.ndarray]) -> object:
        return rows_to_batch(block[0], block[1], self.pack, self.fields)

    def carry(self) -> tuple[np.ndarray, np.ndarray]:
        if not self._tokens:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate(self._tokens), np.concatenate(self._docs)

    def restore(self, tokens: np.ndarray, docs: np.ndarray) -> None:
        self._tokens, self._docs = [np.asarray(tokens, dtype=np.int64)], [np.asarray(docs, dtype=np.int64)]
        self._size = len(tokens)
