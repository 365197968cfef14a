"""The key under which an attempt's ranks meet in the agents' shared store (``plait.runtime.dist.attempt_key``):
the ranks of one attempt agree on it, whichever starts first, and never take a dead attempt's for theirs."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from plait.runtime.dist import attempt_key


def _attempt(store: dist.TCPStore, world: int, delays: list[float]) -> list[str]:
    """One attempt: rank r starts after ``delays[r]`` seconds, each on its own client of ``store``."""
    keys: list[str | BaseException] = [""] * world

    def rank(r: int) -> None:
        time.sleep(delays[r])
        client = dist.TCPStore("127.0.0.1", store.port, world, is_master=False)
        try:
            keys[r] = attempt_key(client, r, world, timeout_s=20)
        except BaseException as e:  # noqa: BLE001 - reported below
            keys[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    errors = [k for k in keys if isinstance(k, BaseException)]
    assert not errors, errors
    return keys  # type: ignore[return-value]


def test_ranks_agree_on_a_fresh_key_whichever_starts_first() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    first = _attempt(store, 3, [0.0, 0.0, 0.0])
    assert len(set(first)) == 1
    seen = {first[0]}
    # later attempts in the same store: the others read the dead attempt's leader first (rank 0 late), or rank 0
    # publishes before the others exist; a world that shrank leaves a join key of a rank that is not there
    for delays in ([0.3, 0.0, 0.0], [0.0, 0.3, 0.1], [0.2, 0.0], [0.0, 0.0, 0.0, 0.25]):
        keys = _attempt(store, len(delays), delays)
        assert len(set(keys)) == 1, keys
        assert keys[0] not in seen, "an attempt took an earlier attempt's key"
        seen.add(keys[0])


def test_a_missing_rank_is_named_after_the_timeout() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with pytest.raises(TimeoutError, match=r"ranks \[2\] did not join"):
        _lonely(store)


def _lonely(store: dist.TCPStore) -> None:
    """Rank 0 of 3 with rank 1 answering and rank 2 never starting."""
    client = dist.TCPStore("127.0.0.1", store.port, 3, is_master=False)
    t = threading.Thread(target=lambda: _swallow(client), daemon=True)
    t.start()
    try:
        attempt_key(store, 0, 3, timeout_s=1.0)
    finally:
        t.join(5)  # rank 1 gives up too, before the store goes


def _swallow(client: dist.TCPStore) -> None:
    try:
        attempt_key(client, 1, 3, timeout_s=2.0)
    except TimeoutError:
        pass
