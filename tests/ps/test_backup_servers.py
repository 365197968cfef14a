"""Backup workers over several servers, in this process: no interleaving of pushes, replies and ends lets
the servers apply different versions (each applies a version with one all-reduce among the servers, of the
clipping norm, so a server that applies a version no other server applies waits in it for ever).

The servers' shards are ``plait.ps.state.ShardState`` and the workers tag their pushes with
``plait.ps.worker.PsClient.push_version``, as in a run; what the transport and the threads add is modelled:
a worker sends its push to every server, then waits for every reply; a server handles each worker's
messages in order and answers a pull once ``may_pull`` allows. While a server is inside an all-reduce that
another server has not reached yet, it has taken that version's gradients (later pushes of it are dropped)
and answers only pulls that do not wait for that version, with its parameters (``ShardState.applying``:
the server releases its lock meanwhile; ``locked=True`` models a server that holds it and does nothing).
"""

from __future__ import annotations

import random
from collections import deque
from types import SimpleNamespace

import torch

from plait.ps.shard import Segment
from plait.ps.state import ShardState
from plait.ps.worker import PsClient


class _Run:
    """``workers`` workers and ``servers`` servers in ``ps.mode=backup`` with ``backup`` backup workers;
    every worker pushes ``steps`` gradients, then ends (DONE). After its ``m``-th push for each ``m`` in
    ``meet``, a worker meets the others in a collective: it parks (PARK to every server), waits until every
    worker has, and its next message unparks it (as ``ParameterServer.meet`` and ``Server._handle`` do)."""

    def __init__(self, workers: int, servers: int, backup: int, steps: int, one_version: bool,
                 meet: tuple[int, ...] = (), locked: bool = False) -> None:
        self.locked = locked
        self.calls = [0] * servers  # all-reduces each server has entered
        cfg = SimpleNamespace(mode="backup", backup_workers=backup, staleness=0, dc_lambda=0.0, dc_adaptive=False,
                              max_staleness=-1, staleness_scaling=0.0)
        self.shards = []
        for s in range(servers):
            st = ShardState(torch.zeros(1, dtype=torch.float64), [Segment(0, 0, 1)], torch.optim.SGD, {"lr": 1.0},
                            [{"lr": 1.0}], workers, cfg, grad_clip=0.0, norm_sum=self._norm_sum(s))
            self.shards.append(st)
        flat = SimpleNamespace(shard_range=lambda s: (s, s + 1))
        self.clients = [PsClient(flat, k, list(range(workers, workers + servers)), None, one_version=one_version)
                        for k in range(workers)]
        self.queue = {(s, k): deque() for s in range(servers) for k in range(workers)}  # sent, not yet handled
        self.owed = {(s, k): False for s in range(servers) for k in range(workers)}  # a pull reply s owes k
        self.replies = [servers] * workers  # replies worker k still waits for (servers: it is computing)
        self.steps, self.left = steps, [steps] * workers
        self.ended = [False] * workers
        self.meet, self.met = meet, [0] * workers  # collectives each worker has left
        self.meeting: set[int] = set()  # workers in the collective now

    def _norm_sum(self, s: int):  # noqa: ANN202 - the shard's norm_sum
        def norm_sum(x: float) -> float:
            self.calls[s] += 1
            return x
        return norm_sum

    def blocked(self, s: int) -> bool:
        return self.calls[s] > min(self.calls)

    def events(self) -> list[tuple[str, int, int]]:
        out = []
        for k in range(len(self.clients)):
            if self.replies[k] < len(self.shards) or self.ended[k] or k in self.meeting:
                continue
            m = self.met[k]
            if m < len(self.meet) and self.steps - self.left[k] == self.meet[m]:
                out.append(("park", k, 0))
            else:
                out.append(("push", k, 0) if self.left[k] else ("done", k, 0))
        for (s, k), q in self.queue.items():
            st = self.shards[s]
            if self.blocked(s) and self.locked:
                continue
            if self.owed[s, k]:
                # the model's shard is at the version being applied + 1 while blocked (the update is instant)
                last = st.last_push_version[k]
                if st.may_pull(k) if not self.blocked(s) else (last is not None and last < st.version - 1):
                    out.append(("reply", k, s))
            elif q:
                out.append(("handle", k, s))
        return out

    def do(self, what: str, k: int, s: int) -> None:
        c = self.clients[k]
        if what == "push":  # the push goes to every server, each with its version, before any reply is read
            for i in range(len(self.shards)):
                self.queue[i, k].append(c.push_version(i))
            self.left[k] -= 1
            self.replies[k] = 0
        elif what == "done":
            for i in range(len(self.shards)):
                self.queue[i, k].append(None)
            self.ended[k] = True
        elif what == "park":
            for i in range(len(self.shards)):
                self.queue[i, k].append("park")
            self.meeting.add(k)
            if len(self.meeting) == len(self.clients):  # everyone is in: the collective ends
                self.meeting.clear()
                self.met = [m + 1 for m in self.met]
        elif what == "handle":
            version = self.queue[s, k].popleft()
            if version == "park":
                self.shards[s].park(k)
            elif version is None:
                self.shards[s].finish(k)
            else:
                self.shards[s].parked.discard(k)
                self.shards[s].push(k, version, torch.ones(1, dtype=torch.float64), 1.0, [1.0])
                self.owed[s, k] = True
        else:  # reply: the worker now holds this shard's version (the one being applied while blocked)
            c.versions[s] = self.shards[s].version - self.blocked(s)
            self.owed[s, k] = False
            self.replies[k] += 1

    def hang(self) -> str | None:
        """None when every worker ended and every server applied the same versions, else what hangs."""
        if all(self.ended) and not any(self.queue.values()) and len(set(self.calls)) == 1:
            return None
        return (f"no step can happen: all-reduces entered per server {self.calls}, versions "
                f"{[s.version for s in self.shards]}, workers' versions {[c.versions for c in self.clients]}, "
                f"pushes left {self.left}, ended {self.ended}")


def _play(run: _Run, script: list[tuple[str, int, int]]) -> None:
    for event in script:
        assert event in run.events(), (event, run.events())
        run.do(*event)


def _random(run: _Run, seed: int, slow: int = 1, slow_factor: float = 3.0) -> str | None:
    """Play random interleavings (worker ``slow`` computes ``slow_factor`` times less often) to the end."""
    rng = random.Random(seed)
    while True:
        events = run.events()
        if not events:
            return run.hang()
        weights = [1.0 / slow_factor if e[0] in ("push", "park", "done") and e[1] == slow else 1.0 for e in events]
        run.do(*rng.choices(events, weights)[0])


# The run that hung (2 workers, 2 servers, b = 1, worker 1 slow; 2 pushes each here): server A (0) handles
# worker 0's second push before worker 1's first, server B (1) worker 1's first before worker 0's second, so
# worker 1 reads version 2 of A's shard and version 1 of B's; worker 0 ends; worker 1's next push, judged
# shard by shard, is of A's current version (A applies version 3: its third all-reduce) and stale on B
# (dropped: B never enters a third all-reduce, A never answers worker 1).
MIXED_READ = [("push", 0, 0), ("push", 1, 0), ("handle", 0, 0), ("handle", 0, 1), ("reply", 0, 0), ("reply", 0, 1),
              ("push", 0, 0), ("handle", 1, 1), ("reply", 1, 1), ("handle", 0, 0), ("handle", 0, 1),
              ("reply", 0, 0), ("reply", 0, 1), ("handle", 1, 0), ("reply", 1, 0), ("done", 0, 0),
              ("handle", 0, 0), ("handle", 0, 1), ("push", 1, 0), ("handle", 1, 0), ("handle", 1, 1)]


def test_a_mixed_read_is_of_its_oldest_version_on_every_server() -> None:
    run = _Run(2, 2, 1, steps=2, one_version=True)
    _play(run, MIXED_READ[:15])
    assert run.clients[1].versions == [2, 1]  # the mixed read
    assert [run.clients[1].push_version(s) for s in (0, 1)] == [1, 1]
    _play(run, MIXED_READ[15:])
    assert run.calls == [2, 2] and [s.version for s in run.shards] == [2, 2]
    assert [s.dropped for s in run.shards] == [2, 2]  # worker 1's pushes, both stale on both servers
    assert run.events() == [("reply", 1, 0), ("reply", 1, 1)]
    assert _random(run, 0) is None  # and the run ends
    assert run.clients[1].versions == [2, 2] and all(s.applied == 2 and s.done == {0, 1} for s in run.shards)
    # judged shard by shard (each server the version of its own shard read), the same interleaving hangs:
    # server A applies version 3 alone and waits in its third all-reduce, holding worker 1's reply
    old = _Run(2, 2, 1, steps=2, one_version=False)
    _play(old, MIXED_READ)
    assert old.calls == [3, 2] and old.blocked(0)
    hang = _random(old, 0)
    assert hang is not None and "all-reduces entered per server [3, 2]" in hang
    assert old.replies[1] == 1 and old.owed[0, 1]  # worker 1 waits for server A's reply for ever


def test_no_interleaving_hangs() -> None:
    """Random interleavings of backup runs (a slow worker, workers ending at different times, collectives
    every other run): every one ends with the servers at the same version. The model finds the two hangs
    this rules out: pushes tagged shard by shard, and (where a version takes 2 or more gradients) parks with
    a server that holds its lock in the all-reduce: a park counts on one server until that worker's next
    message, which another server has already handled, so the first applies a version with fewer gradients
    and waits in the all-reduce, not answering the stale push the other server's version waits behind."""
    hangs = [h for seed in range(60) if (h := _random(_Run(2, 2, 1, 6, one_version=False), seed))]
    assert hangs, "the model no longer finds the hang of per-shard versions"
    hangs = [h for seed in range(60) if (h := _random(_Run(3, 2, 1, 6, one_version=True, meet=(2, 4), locked=True),
                                                       seed))]
    assert hangs, "the model no longer finds the hang of parks with a locked server"
    for workers, servers, backup in ((2, 2, 1), (3, 2, 1), (3, 3, 2), (3, 2, 0), (4, 3, 1), (4, 2, 2)):
        for seed in range(40):
            run = _Run(workers, servers, backup, 6, one_version=True, meet=(2, 4) if seed % 2 else ())
            assert _random(run, seed) is None, (workers, servers, backup, seed, run.hang())
            assert len({s.version for s in run.shards}) == 1
            assert all(s.applied + s.dropped == workers * 6 for s in run.shards)
