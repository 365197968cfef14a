"""The held-out split by document (numpy only: the tokenising processes import it).

A document is a validation document when a hash of its text mixed with the seed falls below
``data.val_fraction``: the same on every rank, reader and resume, whatever the file order.
"""

from __future__ import annotations

import hashlib

import numpy as np


def doc_hash(text: str) -> int:
    """A 64-bit hash of a document's text (BLAKE2b): stable across processes and Python runs."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def held_out(hashes: np.ndarray, seed: int, fraction: float) -> np.ndarray:
    """Which documents (by ``doc_hash``) are validation documents for ``seed``: a boolean array."""
    if fraction <= 0:
        return np.zeros(len(hashes), dtype=bool)
    x = hashes.astype(np.uint64) ^ np.uint64(doc_hash(f"plait-val-{seed}"))
    with np.errstate(over="ignore"):  # splitmix64's finaliser: wrap-around multiplication is the point
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53) < fraction
