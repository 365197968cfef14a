"""The streaming reader (``data.streaming = true``): documents read, shuffled, tokenised and packed on the fly.

It never holds the data set. The units (Parquet row groups, Arrow record batches, whole JSON Lines and
text files; ``plait.data.files``) are the pieces it deals out: each epoch the unit ids are permuted by
``(seed, epoch)`` and dealt round-robin to the ``dp x W`` slots, slot ``s = dp_rank x W + worker`` taking
``order[s::dp x W]`` (``W = max(1, data.num_workers)``). So data-parallel ranks never share a unit, and
every rank's share is fixed by the seed. A slot reads its units in order, drops held-out documents,
passes the rest through a shuffle buffer of ``data.shuffle_buffer`` documents (a full buffer releases a
document chosen by a hash of (seed, epoch, slot, count)), tokenises them, appends the end-of-document
token and packs them into micro-batches (``plait.data.packing.Packer``). With ``data.num_workers > 0``
the slots of a rank run in that many DataLoader worker processes, whose micro-batches the loader takes
in turn (round robin), with ``prefetch_factor`` batches read ahead per worker.

Epoch ends (the rule: wrap). Shards differ in size, so the slots finish an epoch at different steps. A
slot that has read its share of epoch e empties its buffer and goes straight on with its share of epoch
e + 1, packing across the boundary: the stream never ends, every rank runs exactly the steps the run
asks for, and nothing waits at an epoch end. Epoch e is complete, every one of its documents consumed
once, when the last slot has finished its share. In ``doc_ids`` a document carries its epoch's parity.

State: a slot's position is its epoch, its units for that epoch (implicit for a dealt epoch), the unit
and row it reads next, the buffer (as (unit, row) references, read back on resume), the count of
documents released and the packer's carried tokens; ``plait.data.stream_state`` saves it, and re-deals
it when a run resumes with another number of data-parallel ranks or workers.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from plait.data.errors import DataError
from plait.data.files import DataFiles
from plait.data.packing import PACKED_FIELDS, Packer, doc_hash, doc_occurrence, held_out


@dataclass
class StreamSpec:
    """What every slot needs to read its share (picklable: sent to DataLoader workers)."""

    files: DataFiles
    tokenizer: Any
    seq_len: int
    rows: int  # rows (sequences) per micro-batch
    pack: bool
    seed: int
    val_fraction: float  # documents with held_out(...) are skipped (0: keep every document)
    keep_held_out: bool = False  # True: read only the held-out documents (validation)
    shuffle_buffer: int = 1000
    fields: tuple[str, ...] = PACKED_FIELDS  # the packed batch's fields (plait.data.packing.model_fields)


def _mix(*parts: int) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def epoch_order(num_units: int, seed: int, epoch: int) -> np.ndarray:
    """The unit ids of ``epoch`` in their seeded order (the same on every rank)."""
    rng = np.random.Generator(np.random.PCG64(_mix(seed, epoch, 0x5EED)))
    return rng.permutation(num_units)


def dealt_pieces(num_units: int, seed: int, epoch: int, slot: int, num_slots: int) -> list[list[int]]:
    """Slot ``slot``'s units of ``epoch`` as ``[unit, first row]`` pieces."""
    return [[int(u), 0] for u in epoch_order(num_units, seed, epoch)[slot::num_slots]]


def fresh_state(epoch: int = 0) -> dict[str, Any]:
    """A slot at the start of ``epoch`` with the dealt units."""
    return {"epoch": epoch, "pieces": None, "k": 0, "row": -1, "buffer": [], "pops": 0,
            "carry_tokens": [], "carry_docs": [], "queue": []}


class Slot:
    """One slot's reader: ``run()`` yields ``(block, state)``, the state being exact after that block (a
    micro-batch as arrays; ``self.packer.batch(block)`` makes it the batch)."""

    def __init__(self, spec: StreamSpec, slot: int, num_slots: int, state: dict[str, Any]) -> None:
        self.spec, self.slot, self.num_slots = spec, slot, num_slots
        self.st = copy.deepcopy(state)
        self.packer = Packer(spec.seq_len, spec.rows, spec.pack, spec.fields)
        self.packer.restore(np.asarray(self.st["carry_tokens"], dtype=np.int64),
                            np.asarray(self.st["carry_docs"], dtype=np.int64))
        self.buffer: list[tuple[int, int, np.ndarray]] = self._read_back(self.st["buffer"])

    # -- reading ---------------------------------------------------------------------------------
    def _docs(self, unit_id: int, first_row: int, only: set[int] | None = None) -> list[tuple[int, np.ndarray]]:
        """``(row, tokens)`` of the unit's kept documents from ``first_row`` (or just the rows ``only``)."""
        sp = self.spec
        texts = sp.files.read(sp.files.units[unit_id])
        rows = [j for j in range(first_row, len(texts)) if only is None or j in only]
        if sp.val_fraction > 0:
            hashes = np.fromiter((doc_hash(texts[j]) for j in rows), dtype=np.uint64, count=len(rows))
            val = held_out(hashes, sp.seed, sp.val_fraction)
            rows = [j for j, v in zip(rows, val, strict=True) if v == sp.keep_held_out]
        ids = sp.tokenizer.encode_batch([texts[j] for j in rows])
        eos = [sp.tokenizer.eos_id] if sp.tokenizer.eos_id is not None else []
        return [(j, np.asarray(t + eos, dtype=np.int64)) for j, t in zip(rows, ids, strict=True)]

    def _read_back(self, refs: list[list[int]]) -> list[tuple[int, int, np.ndarray]]:
        """The buffer's documents from their (unit, row) references, in the saved order."""
        wanted: dict[int, set[int]] = {}
        for u, r in refs:
            wanted.setdefault(int(u), set()).add(int(r))
        docs = {(u, j): t for u, rows in wanted.items() for j, t in self._docs(u, 0, rows)}
        return [(int(u), int(r), docs[(int(u), int(r))]) for u, r in refs]

    def _pieces(self) -> list[list[int]]:
        st = self.st
        if st["pieces"] is None:
            return dealt_pieces(len(self.spec.files.units), self.spec.seed, st["epoch"], self.slot, self.num_slots)
        return st["pieces"]

    # -- the stream ------------------------------------------------------------------------------
    def _release(self) -> Iterator[tuple[Any, dict[str, Any]]]:
        """Move one buffered document (chosen by hash) into the packer; yield the blocks it completes."""
        st = self.st
        i = _mix(self.spec.seed, st["epoch"], self.slot, st["pops"]) % len(self.buffer)
        u, r, tokens = self.buffer[i]
        self.buffer[i] = self.buffer[-1]
        self.buffer.pop()
        st["pops"] += 1
        unit = self.spec.files.units[u]
        self.packer.add(tokens, doc_occurrence(self.spec.files.doc_id(unit, r), st["epoch"]))
        while self.packer.ready():
            block = self.packer.take()
            yield block, self.snapshot()

    def run(self) -> Iterator[tuple[Any, dict[str, Any]]]:
        st, cap = self.st, max(1, self.spec.shuffle_buffer)
        while True:
            pieces = self._pieces()
            while st["k"] < len(pieces):
                unit_id, first = pieces[st["k"]]
                if st["row"] < first:
                    st["row"] = first
                for j, tokens in self._docs(unit_id, st["row"]):
                    self.buffer.append((unit_id, j, tokens))
                    st["row"] = j + 1
                    while len(self.buffer) > cap:
                        yield from self._release()
                st["k"], st["row"] = st["k"] + 1, -1
            while self.buffer:  # the epoch's share is read: empty the buffer before the next epoch's documents
                yield from self._release()
            self._next_epoch()

    def _next_epoch(self) -> None:
        st = self.st
        if st["queue"]:  # a re-dealt epoch (after a resume at another layout)
            nxt = st["queue"].pop(0)
            st.update(epoch=nxt["epoch"], pieces=nxt["pieces"], k=0, row=-1, pops=0)
            self.buffer = self._read_back(nxt["buffer"])
            tokens, docs = self.packer.carry()
            self.packer.restore(np.concatenate([tokens, np.asarray(nxt["carry_tokens"], dtype=np.int64)]),
                                np.concatenate([docs, np.asarray(nxt["carry_docs"], dtype=np.int64)]))
        else:
            st.update(epoch=st["epoch"] + 1, pieces=None, k=0, row=-1, pops=0)

    def snapshot(self) -> dict[str, Any]:
        """The exact state after the last yielded block (plain lists: safe to save and load)."""
        tokens, docs = self.packer.carry()
        st = dict(self.st)
        st.update(queue=list(st["queue"]), buffer=[[u, r] for u, r, _ in self.buffer], carry_tokens=tokens.tolist(),
                  carry_docs=docs.tolist())
        return st


class _Workers(torch.utils.data.IterableDataset):
    """The DataLoader's view of one rank's slots: worker process w runs logical slot ``(w + offset) % W``, so
    a resumed loader, which always starts with process 0, continues the round robin where it stopped."""

    def __init__(self, spec: StreamSpec, first_slot: int, num_slots: int, states: list[dict], offset: int) -> None:
        super().__init__()
        self.spec, self.first_slot, self.num_slots = spec, first_slot, num_slots
        self.states, self.offset = states, offset

    def __iter__(self) -> Iterator[tuple[int, Any, Any]]:
        import os

        info = torch.utils.data.get_worker_info()
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # forked from a process that may have used its threads
        w = (info.id + self.offset) % info.num_workers if info is not None else 0
        slot = Slot(self.spec, self.first_slot + w, self.num_slots, self.states[w])
        try:
            for block, state in slot.run():
                yield w, block, state
        except DataError as e:  # sent as a value: the DataLoader would wrap the message in a traceback
            yield w, None, {"error": str(e)}


def as_is(item: object) -> object:
    """The DataLoader's collate for the readers' items: arrays stay arrays (sent by value)."""
    return item
