"""The token cache (``data.streaming = false``): every file tokenised once, memory-mapped afterwards.

Each data file gets its own cache directory, named by a hash of the file's contents, the tokenizer
(its ``tokenizer.json`` bytes) and the settings that change the tokens (``data.text_field``, the
end-of-document token, this format's version); it lives in ``data.cache_dir`` (empty: ``.plait-cache``
beside the data). A file that did not change is never tokenised again; a changed one gets a new entry.
An entry holds::

    tokens.bin      the file's documents' tokens end to end, each followed by the end-of-document token
                    (uint16 when the vocabulary fits, else uint32), read with numpy.memmap
    doc_starts.npy  int64 (num_docs + 1,): where document i (row i of the file) starts in tokens.bin
    doc_hash.npy    uint64 (num_docs,): ``plait.data.packing.doc_hash`` of each text (the held-out split)
    meta.json       counts and dtype; written last, so an entry with it is complete

Building tokenises the units (row groups, files) in ``data.tokenize_processes`` spawned processes (0: one
per CPU), in order, with a progress bar, into a temporary directory renamed when complete. A lock file
makes the ranks of one machine build once: the others wait and then read it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import multiprocessing as mp
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from plait.data.errors import DataError
from plait.data.files import DataFiles, Unit, file_digest
from plait.data.split import doc_hash

VERSION = 1


@dataclass
class FileTokens:
    """One file's cached tokens (memory-mapped) and document index."""

    tokens: np.ndarray  # (N,) uint16/uint32 memmap
    doc_starts: np.ndarray  # (D + 1,) int64
    doc_hash: np.ndarray  # (D,) uint64


def cache_root(files: DataFiles, cache_dir: str) -> Path:
    if cache_dir:
        return Path(cache_dir)
    common = Path(os.path.commonpath([str(p.resolve().parent) for p in files.paths]))
    return common / ".plait-cache"


def entry_key(digest: str, tokenizer_fp: str, text_field: str, eos: int | None) -> str:
    import hashlib

    text = json.dumps([VERSION, digest, tokenizer_fp, text_field, eos])
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


# -- building (in spawned processes) ----------------------------------------------------------------
_WORKER: dict = {}


def _init_worker(files: DataFiles, tokenizer: object) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per process: the processes are the parallelism
    _WORKER.update(files=files, tokenizer=tokenizer)


def tokenize_unit(files: DataFiles, tokenizer: object, unit: Unit) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tokens, doc_lengths, doc_hashes)`` of one unit, each document followed by the end-of-document
    token when the tokenizer has one; tokens in the cache's dtype (what a tokenising process sends back)."""
    texts = files.read(unit)
    ids = tokenizer.encode_batch(texts)  # type: ignore[attr-defined]
    eos = tokenizer.eos_id  # type: ignore[attr-defined]
    if eos is not None:
        ids = [d + [eos] for d in ids]
    lengths = np.fromiter((len(d) for d in ids), dtype=np.int64, count=len(ids))
    dtype = token_dtype(tokenizer.vocab_size)  # type: ignore[attr-defined]
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum()))
    hashes = np.fromiter((doc_hash(t) for t in texts), dtype=np.uint64, count=len(texts))
    return flat, lengths, hashes


def token_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def _task(unit: Unit) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return tokenize_unit(_WORKER["files"], _WORKER["tokenizer"], unit)


@contextlib.contextmanager
def _lock(root: Path) -> Iterator[None]:
    import fcntl

    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # the ranks of this machine queue here; the first builds
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _results(units: list[Unit], files: DataFiles, tokenizer: object, processes: int) -> Iterator[tuple]:
    if processes <= 1:
        for u in units:
            yield tokenize_unit(files, tokenizer, u)
        return
    ctx = mp.get_context("spawn")  # never fork a process that may hold gloo or tokenizer threads
    with ctx.Pool(processes, initializer=_init_worker, initargs=(files, tokenizer)) as pool:
        yield from pool.imap(_task, units, chunksize=1)


def build_entries(files: DataFiles, tokenizer: object, todo: list[tuple[int, Path]], processes: int,
                  show_progress: bool) -> None:
    """Tokenise the files ``todo`` ((file index, entry dir)) into their cache entries."""
    units = [u for i, _ in todo for u in files.units if u.file == i]
    dtype = token_dtype(tokenizer.vocab_size)  # type: ignore[attr-defined]
    progress = _progress(len(units), show_progress)
    results = _results(units, files, tokenizer, processes)
    for i, entry in todo:
        tmp = entry.with_name(entry.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        lengths, hashes, total = [], [], 0
        with open(tmp / "tokens.bin", "wb") as out:
            for _ in (u for u in units if u.file == i):
                flat, n, h = next(results)
                out.write(flat.astype(dtype).tobytes())
                lengths.append(n)
                hashes.append(h)
                total += len(flat)
                progress.advance()
        n = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
        np.save(tmp / "doc_starts.npy", np.concatenate([[0], np.cumsum(n)]).astype(np.int64))
        np.save(tmp / "doc_hash.npy", np.concatenate(hashes) if hashes else np.zeros(0, dtype=np.uint64))
        meta = {"version": VERSION, "file": str(files.paths[i]), "num_tokens": total, "num_docs": int(len(n)),
                "dtype": np.dtype(dtype).name}
        (tmp / "meta.json").write_text(json.dumps(meta))
        shutil.rmtree(entry, ignore_errors=True)
        os.replace(tmp, entry)
    results.close()  # ends the process pool
    progress.close()


class _progress:
    """A rich progress bar over units (a no-op when not shown)."""

    def __init__(self, total: int, show: bool) -> None:
        self.bar = None
        if show and total:
            from rich.progress import Progress

            self.bar = Progress(transient=True)
            self.bar.start()
            self.task = self.bar.add_task(f"tokenising {total} units into the token cache", total=total)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.advance(self.task)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def load_entry(entry: Path) -> FileTokens:
    meta = json.loads((entry / "meta.json").read_text())
    n = int(meta["num_tokens"])
    tokens = np.memmap(entry / "tokens.bin", dtype=meta["dtype"], mode="r", shape=(n,)) if n else \
        np.zeros(0, dtype=meta["dtype"])
    return FileTokens(tokens, np.load(entry / "doc_starts.npy"), np.load(entry / "doc_hash.npy"))


def cached_tokens(files: DataFiles, tokenizer: object, cache_dir: str, processes: int = 0,
                  show_progress: bool = True) -> list[FileTokens]:
    """Every file's tokens from the cache, building the missing entries first (see the module docstring)."""
    root = cache_root(files, cache_dir)
    fp, eos = tokenizer.fingerprint, tokenizer.eos_id  # type: ignore[attr-defined]
    entries = [root / entry_key(file_digest(p), fp, files.text_field, eos) for p in files.paths]
    missing = [(i, e) for i, e in enumerate(entries) if not (e / "meta.json").is_file()]
    if missing:
        try:
            lock = _lock(root)
            lock.__enter__()
        except OSError as e:
            raise DataError(f"cannot write the token cache in {root} ({e}); set data.cache_dir to a writable "
                            "directory") from None
        try:
            missing = [(i, e) for i, e in missing if not (e / "meta.json").is_file()]  # another rank built them
            if missing:
                n = processes or len(os.sched_getaffinity(0))
                build_entries(files, tokenizer, missing, min(n, len(files.units)), show_progress)
        finally:
            lock.__exit__(None, None, None)
    return [load_entry(e) for e in entries]
