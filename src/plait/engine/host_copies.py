"""``fault.memory_checkpoint`` on a worker's side: which holders (``plait.fault.holder``) this rank's in-memory
checkpoint copies go to, and finding every rank's copy again at a load.

One machine: the holder ``plait train`` started beside the workers (its address and token in the environment).
Several machines (the agent's ``GROUP_WORLD_SIZE`` > 1): every rank also learns every other machine's holder, in
one all-gather of ``ENDPOINT_BYTES`` bytes per rank when the engine is built (once per attempt, never on a
training step), and puts a second copy into the next machine's holder (``Holders.of_ranks``).

At a load every rank looks for its copy (its own machine's holder, then the peer's, then any other machine's),
and the ranks agree in one all-reduce: memory only when every rank found a whole copy of the same step that fits
its layout; otherwise every rank reads the disk.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from plait.fault.holder import Client, Holders

ENDPOINT_BYTES = 256  # "host:port token" of one holder, UTF-8, zero-padded (an IPv6 address and a 32-digit token fit)
SOURCES = ("own", "peer", "other")  # where a rank's copy came from (Holders.sources), counted over the ranks


class HeldCopy(NamedTuple):
    """An in-memory checkpoint every rank found (``find_copies``): its step, this rank's decoded copy (for
    ``Plait.load(memory=...)``), where this rank's came from, and how many ranks took theirs from each source."""

    step: int
    decoded: Any
    where: str
    ranks_from: dict[str, int]


def several_machines() -> bool:
    """True when the elastic agents of several machines formed this job (the same answer on every rank)."""
    return int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1


def _exchange(endpoint: str, group: Any, world_size: int, device: torch.device) -> list[str]:
    """Every rank's ``endpoint`` by global rank (one all-gather of ``ENDPOINT_BYTES`` bytes per rank; "" for a rank
    with no holder). Raw bytes, not ``all_gather_object``: nothing received is unpickled."""
    raw = endpoint.encode()
    if len(raw) > ENDPOINT_BYTES:
        raise ValueError(f"the holder endpoint {endpoint!r} is longer than {ENDPOINT_BYTES} bytes")
    mine = torch.zeros(ENDPOINT_BYTES, dtype=torch.uint8)
    mine[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    mine = mine.to(device)
    out = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(out, mine, group=group)
    return [bytes(o.cpu().tolist()).rstrip(b"\0").decode() for o in out]


def holders_for(rank: int, world_size: int, group: Any, device: torch.device, logger: Any) -> Holders | None:
    """This rank's ``Holders``; None where no holder runs beside it, and on several machines on every rank when
    any rank has none (the same answer everywhere: ``find_copies`` is collective). Collective on several machines
    (every rank calls it: the all-gather of the holders' endpoints); local on one."""
    client = Client.from_env()
    if not several_machines() or world_size == 1:
        return Holders(client) if client is not None else None
    endpoints = _exchange(client.endpoint if client is not None else "", group, world_size, device)
    if not all(endpoints):  # None on every rank alike: a load needs every rank's copy, and is collective
        missing = [r for r, e in enumerate(endpoints) if not e]
        if client is not None:
            logger.warning("fault.memory_checkpoint: ranks %s run without an in-memory checkpoint holder (started "
                           "without plait train?): no in-memory copies in this attempt, disk checkpoints only",
                           missing)
        return None
    return Holders.of_ranks(endpoints, rank)


def find_copies(holders: Holders | None, rank: int, world_size: int, accept: Callable[[int], bool],
                decode: Callable[[bytearray], Any], reduce: Callable[[torch.Tensor], torch.Tensor],
                logger: Any) -> HeldCopy | None:
    """The in-memory checkpoint every rank holds whole, of one same step that ``accept(step)`` takes on every rank,
    at this world size, with this rank's copy decoded (``decode``: it fits this run's layout); None otherwise (then
    every rank reads the disk). ``reduce``: a sum over every rank (one all-reduce of 6 numbers)."""
    found: tuple[str, int, Any] | None = None
    for where, header, payload in holders.find(rank, world_size, accept) if holders is not None else ():
        step = int(header["step"])
        try:
            found = (where, step, decode(payload))
            break
        except Exception as e:  # a copy that does not fit is never loaded: the next one, else the disk
            logger.warning("the in-memory copy of step %d (%s holder) does not fit this run (%s)", step, where, e)
    s = float(found[1]) if found is not None else -1.0
    sources = [float(found is not None and found[0] == w) for w in SOURCES]
    total = reduce(torch.tensor([float(found is not None), s, s * s, *sources], dtype=torch.float64))
    n = world_size
    if found is None or total[0] < n or n * total[2] != total[1] * total[1]:  # all found, all the same step
        return None
    return HeldCopy(found[1], found[2], found[0], {w: int(total[3 + i]) for i, w in enumerate(SOURCES)})
