"""Cached documents as map-style data sets of windows, for plait's deterministic loader.

``DocStream`` is the training (or validation) documents of a token cache laid end to end: runs of
consecutive selected documents of each file, in file order, never copied (the files stay
memory-mapped). ``StreamWindows`` cuts it into windows like ``plait.data.text.TokenWindows``: with
``epoch_offsets`` every epoch starts its windows at another offset in ``[0, window)``, drawn from the seed
and the epoch alone; packed windows (``seq_len`` tokens) come out as the packed dict, unpacked ones
(``seq_len + 1``) as ``(x, y)``.
"""

from __future__ import annotations

import numpy as np

from plait.data.cache import FileTokens
from plait.data.files import ROW_BITS
from plait.data.packing import PACKED_FIELDS, rows_to_batch
from plait.data.text import EpochWindows


class DocStream:
    """The documents ``select[f]`` (a boolean per document) of every cached file, end to end."""

    def __init__(self, files: list[FileTokens], select: list[np.ndarray]) -> None:
        self.files = files
        span_file, span_start, span_len = [], [], []
        for f, (ft, keep) in enumerate(zip(files, select, strict=True)):
            if not len(keep):
                continue
            # runs of consecutive selected documents: [first, last] doc indices of each run
            edges = np.diff(np.concatenate([[0], keep.astype(np.int8), [0]]))
            firsts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
            starts, stops = ft.doc_starts[firsts], ft.doc_starts[ends]
            span_file.append(np.full(len(firsts), f, dtype=np.int64))
            span_start.append(starts)
            span_len.append(stops - starts)
        cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64)  # noqa: E731
        self.span_file, self.span_start, self.span_len = cat(span_file), cat(span_start), cat(span_len)
        self.cum = np.concatenate([[0], np.cumsum(self.span_len)]).astype(np.int64)
        self.num_tokens = int(self.cum[-1])
        self.num_docs = int(sum(int(k.sum()) for k in select))

    def slice(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens ``[start, start + length)`` of the stream and each one's document id (int64 arrays)."""
        tokens = np.empty(length, dtype=np.int64)
        docs = np.empty(length, dtype=np.int64)
        j = int(np.searchsorted(self.cum, start, side="right")) - 1
        filled = 0
        while filled < length:
            f, s0 = int(self.span_file[j]), int(self.span_start[j])
            off = start + filled - int(self.cum[j])
            take = min(int(self.span_len[j]) - off, length - filled)
            lo = s0 + off
            tokens[filled:filled + take] = self.files[f].tokens[lo:lo + take]
            rows = np.searchsorted(self.files[f].doc_starts, np.arange(lo, lo + take), side="right") - 1
            docs[filled:filled + take] = (f << ROW_BITS) | rows
            filled += take
            j += 1
        return tokens, docs


class StreamWindows(EpochWindows):
    """Windows of a ``DocStream`` (see the module docstring); ``limit`` keeps only the first ones."""

    def __init__(self, stream: DocStream, seq_len: int, *, pack: bool, epoch_offsets: bool = False, seed: int = 0,
                 limit: int | None = None, fields: tuple[str, ...] = PACKED_FIELDS) -> None:
        self.stream, self.seq_len, self.pack, self.seed, self.epoch_offsets = stream, seq_len, pack, seed, epoch_offsets
        self.fields = fields
        self.window = seq_len if pack else seq_len + 1
        stride, n = seq_len, stream.num_tokens
        # with offsets, every offset in [0, stride) must still leave this many whole windows
        count = (n - self.window - stride + 1) // stride + 1 if epoch_offsets else (n - self.window) // stride + 1
        self.num_windows = max(0, min(count, limit) if limit is not None else count)
        self.offset = 0

    def __getitem__(self, i: int) -> object:
        if not 0 <= i < self.num_windows:
            raise IndexError(i)
        tokens, docs = self.stream.slice(self.offset + i * self.seq_len, self.window)
        batch = rows_to_batch(tokens[None], docs[None], self.pack, self.fields)
        if self.pack:
            return {k: v[0] for k, v in batch.items()}  # type: ignore[union-attr]
        x, y = batch  # type: ignore[misc]
        return x[0], y[0]
