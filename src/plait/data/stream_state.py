"""One rank's streaming loader, its checkpointed state, and the re-deal for a resume at another layout.

``StreamingLoader.state_dict()`` is this rank's state: every slot's position (``plait.data.stream.Slot``)
after the last micro-batch handed to the caller (batches that workers read ahead are not counted), and
which worker's batch comes next. A checkpoint holds every rank's (``Plait.save`` gathers them).

Resume at the same data-parallel degree and ``data.num_workers``: each slot continues exactly where it
stopped, and the loader takes the workers' batches in the same turn, so the micro-batches, and a
deterministic run's losses, are the same bit for bit as without the interruption.

Resume at another degree (or another number of workers), the rule: the work every old slot had left
in the epochs it had begun is pooled per epoch (the unread rest of its current unit, its unread units,
the documents in its buffer, the tokens its packer carried; for a slot that was still in an earlier
epoch, all its units of the later one), and dealt round robin to the new slots, which finish those
epochs before the regular deal of the later epochs begins. Each document of an epoch that was under way
is so consumed exactly once in that epoch, whatever the new layout.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from plait.data.errors import DataError
from plait.data.packing import Packer
from plait.data.stream import Slot, StreamSpec, _Workers, as_is, dealt_pieces, fresh_state

KIND, VERSION = "plait-stream", 1
_ORDER_KEYS = ("num_units", "seed", "seq_len", "pack")


class StreamingLoader:
    """This rank's micro-batches of the stream (endless; see ``plait.data.stream``)."""

    per_rank_state = True  # Plait.save gathers every rank's state_dict into the checkpoint

    def __init__(self, spec: StreamSpec, *, dp_rank: int, dp_size: int, num_workers: int,
                 prefetch_factor: int | None = None, pin_memory: bool = False) -> None:
        self.spec, self.dp_rank, self.dp_size, self.num_workers = spec, dp_rank, dp_size, num_workers
        self.W = max(1, num_workers)
        if self.num_slots > len(spec.files.units):
            raise DataError(f"{spec.files.describe()} hold {len(spec.files.units)} units, fewer than the "
                            f"{self.num_slots} readers (data-parallel ranks x data.num_workers), some of which would "
                            "read nothing: write more (smaller) row groups or shards, or lower data.num_workers")
        self.prefetch_factor, self.pin_memory = prefetch_factor, pin_memory
        self.states = [fresh_state() for _ in range(self.W)]
        self.next_worker = 0

    @property
    def num_slots(self) -> int:
        return self.dp_size * self.W

    def __iter__(self) -> Iterator[Any]:
        first = self.dp_rank * self.W
        packer = Packer(self.spec.seq_len, self.spec.rows, self.spec.pack, self.spec.fields)
        if self.num_workers == 0:
            for block, state in Slot(self.spec, first, self.num_slots, self.states[0]).run():
                self.states[0] = state
                yield packer.batch(block)
            return
        from torch.utils.data import DataLoader

        workers = _Workers(self.spec, first, self.num_slots, self.states, self.next_worker)
        kwargs = {"prefetch_factor": self.prefetch_factor} if self.prefetch_factor else {}
        loader = DataLoader(workers, batch_size=None, num_workers=self.num_workers, collate_fn=as_is, **kwargs)
        for w, block, state in loader:
            if block is None:
                raise DataError(state["error"])
            self.states[w] = state
            self.next_worker = (w + 1) % self.W
            batch = packer.batch(block)
            yield _pinned(batch) if self.pin_memory else batch

    def advance(self, micro_batches: int) -> None:
        """Skip this rank's next ``micro_batches`` (read and dropped: a stream has no index to jump to)."""
        it = iter(self)
        for _ in range(micro_batches):
            next(it)

    def set_shares(self, shares: list[int] | None) -> None:
        if shares is not None:
            raise DataError("fault.rebalance deals uneven shares of each global batch, which a streamed data set "
                            "cannot; set fault.rebalance=false or data.streaming=false")

    def state_dict(self) -> dict[str, Any]:
        sp = self.spec
        return {"kind": KIND, "version": VERSION, "dp_rank": self.dp_rank, "dp_size": self.dp_size,
                "num_workers": self.W, "next_worker": self.next_worker, "num_units": len(sp.files.units),
                "seed": sp.seed, "seq_len": sp.seq_len, "pack": int(sp.pack), "slots": [dict(s) for s in self.states]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's state: exactly at the same layout, re-dealt at another (module docs)."""
        entries = state.get("per_rank", [state])
        mine = self.state_dict()
        for e in entries:
            if e.get("kind") != KIND or int(e.get("version", 0)) != VERSION:
                raise DataError("the checkpoint's data-loader state is not a streaming reader's; resume with the "
                                "settings the run was saved with (data.streaming)")
            differ = [k for k in _ORDER_KEYS if int(e[k]) != int(mine[k])]
            if differ:
                raise DataError(f"the checkpoint's stream was read with other {', '.join(differ)} "
                                f"({', '.join(f'{k}={e[k]}' for k in differ)}); resume with the same data files, "
                                "train.seed, model.seq_len and data.pack")
        by_rank = {int(e["dp_rank"]): e for e in entries}
        old_dp, old_w = int(entries[0]["dp_size"]), int(entries[0]["num_workers"])
        if old_dp == self.dp_size and old_w == self.W and self.dp_rank in by_rank:
            e = by_rank[self.dp_rank]
            self.states, self.next_worker = [dict(s) for s in e["slots"]], int(e["next_worker"])
            return
        if sorted(by_rank) != list(range(old_dp)):
            raise DataError(f"the checkpoint holds the stream state of ranks {sorted(by_rank)} of {old_dp}; it is "
                            "incomplete, resume from another checkpoint")
        old = [(r * old_w + w, s) for r, e in sorted(by_rank.items()) for w, s in enumerate(e["slots"])]
        new = redeal(old, old_dp * old_w, self.num_slots, len(self.spec.files.units), self.spec.seed)
        first = self.dp_rank * self.W
        self.states, self.next_worker = new[first:first + self.W], 0


def _pinned(batch: Any) -> Any:
    """Tensors of a batch in page-locked memory, for an asynchronous copy to the GPU."""
    if isinstance(batch, dict):
        return {k: v.pin_memory() for k, v in batch.items()}
    return tuple(v.pin_memory() for v in batch)


def _rest(state: dict[str, Any], slot: int, num_slots: int, num_units: int, seed: int) -> list[list[int]]:
    """The pieces a slot had not read yet in its current epoch."""
    pieces = state["pieces"] if state["pieces"] is not None else dealt_pieces(num_units, seed, state["epoch"], slot,
                                                                             num_slots)
    k, row = int(state["k"]), int(state["row"])
    if k >= len(pieces):
        return []
    u, first = pieces[k]
    return [[int(u), max(int(first), row)], *[[int(a), int(b)] for a, b in pieces[k + 1:]]]


def redeal(old: list[tuple[int, dict[str, Any]]], old_slots: int, new_slots: int, num_units: int,
           seed: int) -> list[dict[str, Any]]:
    """New slots' states that finish the epochs the ``old`` (slot, state) pairs had begun (module docs)."""
    last = {s: int(st["epoch"]) + len(st["queue"]) for s, st in old}
    first_epoch, last_epoch = min(int(st["epoch"]) for _, st in old), max(last.values())
    pool = {e: {"pieces": [], "buffer": [], "carries": []} for e in range(first_epoch, last_epoch + 1)}
    for s, st in old:
        e = int(st["epoch"])
        pool[e]["pieces"] += _rest(st, s, old_slots, num_units, seed)
        pool[e]["buffer"] += [[int(u), int(r)] for u, r in st["buffer"]]
        pool[e]["carries"].append((list(st["carry_tokens"]), list(st["carry_docs"])))
        for q in st["queue"]:  # epochs re-dealt to this slot by an earlier resume, not begun yet
            p = pool[int(q["epoch"])]
            p["pieces"] += [[int(a), int(b)] for a, b in q["pieces"]]
            p["buffer"] += [[int(u), int(r)] for u, r in q["buffer"]]
            p["carries"].append((list(q["carry_tokens"]), list(q["carry_docs"])))
        for later in range(last[s] + 1, last_epoch + 1):  # epochs this slot had not begun: all its units
            pool[later]["pieces"] += dealt_pieces(num_units, seed, later, s, old_slots)
    out = []
    for t in range(new_slots):
        plans = []
        for e in range(first_epoch, last_epoch + 1):
            p = pool[e]
            carries = p["carries"][t::new_slots]
            plans.append({"epoch": e, "pieces": p["pieces"][t::new_slots], "buffer": p["buffer"][t::new_slots],
                          "carry_tokens": [x for c in carries for x in c[0]],
                          "carry_docs": [x for c in carries for x in c[1]]})
        head = plans[0]
        state = fresh_state(first_epoch)
        state.update(pieces=head["pieces"], buffer=head["buffer"], carry_tokens=head["carry_tokens"],
                     carry_docs=head["carry_docs"], queue=plans[1:])
        out.append(state)
    return out


class StreamingDataset:
    """What the ``text`` recipe returns with ``data.streaming = true``: ``Plait.setup_dataloader`` turns it
    into this rank's ``StreamingLoader`` (it has no length: the stream is endless, see the module docs)."""

    def __init__(self, spec: StreamSpec, source: str) -> None:
        self.spec, self.source = spec, source

    def loader(self, *, dp_rank: int, dp_size: int, batch_size: int, num_workers: int,
               prefetch_factor: int | None = None, pin_memory: bool = False) -> Any:
        spec = copy.copy(self.spec)
        spec.rows = batch_size
        return StreamingLoader(spec, dp_rank=dp_rank, dp_size=dp_size, num_workers=num_workers,
                               prefetch_factor=prefetch_factor, pin_memory=pin_memory)
