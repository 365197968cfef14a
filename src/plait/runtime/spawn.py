"""Spawning ranks: ``world`` processes on one gloo group over loopback, each rank's result or traceback.

``spawn_ranks(fn, world, *args)`` starts ``world`` spawned processes, joins each to a gloo process group
(one CPU thread per rank unless told otherwise), calls ``fn(rank, world, *args)`` and returns the results
by rank. A rank that raises, or dies without a result, makes it raise ``SpawnError`` with that rank's
traceback or exit code; a group that does not finish within ``timeout_s`` is killed and reported by the
ranks that were missing. ``RankGroup`` is the same machinery for a caller that wants every rank's
``RankOutcome`` (a test that expects a rank to fail) instead of an exception.

Ranks start in a fraction of a second: they are forked from multiprocessing's fork server, a process started
once per parent that has imported torch (and whatever ``preload`` names) and never ran an op, so no rank pays
for a fresh interpreter and its imports (about 3 s of CPU each with torch and plait; 0.03 s forked). A rank
gets the parent's environment, working directory and ``sys.path`` as they are when the group starts, as a
spawned rank would, not as they were when the server started. Where the platform has no fork server, ranks
are spawned.

Two rules keep a group from failing for reasons of its own:

- The rendezvous store lives in the parent, not in rank 0. A rank that finishes, or fails, and exits can
  never take the store away from a peer still creating a process group or a device mesh (gloo's
  ``new_group`` talks to the store: a store hosted by a rank that had already exited gave its peer
  ``DistNetworkError: Broken pipe``). The parent binds the store's port itself, so there is no gap
  between choosing a free port and using it.
- Every rank reports, then waits on the store until every rank has reported (``plait.runtime.group.meet``)
  before it tears its process group down and exits. A rank that ends early (it raised, or simply had
  less to do) cannot close its connections while a peer is still in a collective with it. The parent
  stops waiting for the others a few seconds after the first failure, and kills what is left.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from plait.runtime.forked import exit_handlers, fresh_start_method
from plait.runtime.group import meet

HOST = "127.0.0.1"
# After the first failure, how long the other ranks get to report theirs (they are usually fallout of
# the first, but their tracebacks help); then the group is killed.
FAILURE_GRACE_S = 3.0
# After every rank reported, how long the group gets to tear down and exit before it is killed.
EXIT_GRACE_S = 5.0


START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
_PRELOAD = ["torch", "torch.distributed", "plait.runtime.spawn"]


def preload(modules: Iterable[str]) -> None:
    """Add ``modules`` to what the fork server imports when it starts (a module that fails to import is
    skipped), so every rank forked from it has them already. Call it before the first group starts."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def start_server() -> None:
    """Start the fork server now, with this process's environment as it is (it is otherwise started by the first
    group). A test session starts it before any test can change the environment."""
    if START_METHOD == "forkserver":
        from multiprocessing import forkserver

        mp.set_forkserver_preload([*_PRELOAD, "plait.runtime.gc_freeze"])  # last: freezes what the others made
        forkserver.ensure_running()


def free_port(host: str = HOST) -> int:
    """A TCP port that is free on ``host`` right now (for a rendezvous another program binds)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class RankOutcome:
    """How one rank ended: ``value`` (what ``fn`` returned) when ``error`` is None, else ``error`` (its
    traceback, or why it gave no result); ``exitcode`` once its process ended (negative: a signal)."""

    rank: int
    value: Any = None
    error: str | None = None
    exitcode: int | None = None
    order: int = 0  # when the parent learned it: the first failure is the cause, later ones its fallout

    @property
    def ok(self) -> bool:
        return self.error is None


class SpawnError(RuntimeError):
    """A spawned group failed; ``str()`` names each failed rank with its traceback, ``outcomes`` has all."""

    def __init__(self, message: str, outcomes: list[RankOutcome]) -> None:
        super().__init__(message)
        self.outcomes = outcomes


def init_rank(rank: int, world: int, store: dist.Store, timeout_s: float, threads: int = 1) -> None:
    """``threads`` CPU threads for this process and a gloo process group of ``world`` ranks on ``store``."""
    os.environ.update(OMP_NUM_THREADS=str(threads), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))


class _ParentFd:
    """One of the parent's file descriptors, duplicated into the rank as it starts (``multiprocessing`` sends it
    alongside the process): the rank's output goes where the parent's goes now, such as a test's captured
    output, not where the fork server's went when it started."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        from multiprocessing import reduction

        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(dup: Any) -> int:
    return dup.detach()


@dataclass
class _Context:
    """What a rank takes from its parent at the moment the group starts (a forked rank would otherwise have the
    fork server's): environment, working directory, import path, standard output and error."""

    env: dict[str, str]
    cwd: str
    path: list[str]
    stdout: Any
    stderr: Any

    @classmethod
    def here(cls) -> _Context:
        return cls(dict(os.environ), os.getcwd(), list(sys.path), _ParentFd(1), _ParentFd(2))

    def enter(self) -> None:
        os.environ.clear()
        os.environ.update(self.env)
        os.chdir(self.cwd)
        sys.path[:] = self.path
        for fd, received, stream in ((1, self.stdout, sys.stdout), (2, self.stderr, sys.stderr)):
            stream.flush()
            os.dup2(received, fd)
            os.close(received)


def _rank_main(fn: Callable, rank: int, world: int, port: int, args: tuple, results: Any, timeout_s: float,
               threads: int, context: _Context) -> None:
    """A spawned rank: join the group, run ``fn``, report, wait for the others, tear down (and, forked, behave
    as a fresh interpreter: ``plait.runtime.forked``)."""
    store = None
    with exit_handlers():
        try:
            context.enter()
            fresh_start_method()
            store = dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=timeout_s))
            init_rank(rank, world, store, timeout_s, threads)
            out = fn(rank, world, *args)
            # Plain pickle sends tensors by value; the queue's own pickler would pass shared-memory handles that
            # die with this process.
            results.put((rank, True, pickle.dumps(out)))
        except BaseException:  # report every failure to the parent, whatever it is
            results.put((rank, False, traceback.format_exc()))
        # Flush the report before anything that can block or abort (a peer left stuck in a collective on
        # purpose can make ``destroy_process_group`` wait for the backend's timeout).
        results.close()
        results.join_thread()
        try:
            if store is not None:
                meet(store, world, "plait-spawn/done")  # the store's timeout bounds the wait
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class RankGroup:
    """``world`` spawned ranks running ``fn(rank, world, *args)`` on one gloo group, as a context manager:
    ``wait()`` returns every rank's outcome; leaving the block ends every process (see the module docstring).

    ``pg_timeout_s`` bounds each collective and the store's waits inside the ranks; ``threads`` is each
    rank's CPU thread count."""

    def __init__(self, fn: Callable, world: int, args: tuple = (), *, pg_timeout_s: float = 60.0,
                 threads: int = 1, name: str = "ranks") -> None:
        self.fn, self.world, self.args, self.name = fn, world, args, name
        self.pg_timeout_s, self.threads = pg_timeout_s, threads
        self.procs: list[Any] = []
        self._store: dist.TCPStore | None = None
        self._results: Any = None
        self._outcomes: dict[int, RankOutcome] = {}

    def __enter__(self) -> RankGroup:
        start_server()
        ctx = mp.get_context(START_METHOD)
        self._results = ctx.Queue()
        # Port 0: the store binds a free port itself; it serves until the group is closed.
        self._store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=self.pg_timeout_s))
        port = self._store.port
        self.procs = [ctx.Process(target=_rank_main, name=f"{self.name}-rank{r}",
                                  args=(self.fn, r, self.world, port, self.args, self._results, self.pg_timeout_s,
                                        self.threads, _Context.here()))
                      for r in range(self.world)]
        try:
            for p in self.procs:
                p.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _take(self, block_s: float) -> bool:
        """Read one report into the outcomes; False when none came within ``block_s``."""
        try:
            rank, ok, payload = self._results.get(timeout=block_s) if block_s > 0 else self._results.get_nowait()
        except queue.Empty:
            return False
        self._record(RankOutcome(rank, pickle.loads(payload)) if ok else RankOutcome(rank, error=payload))
        return True

    def _record(self, outcome: RankOutcome) -> None:
        outcome.order = len(self._outcomes)
        self._outcomes[outcome.rank] = outcome

    def _dead_without_report(self) -> list[int]:
        dead = [r for r, p in enumerate(self.procs) if r not in self._outcomes and p.exitcode is not None]
        if dead:
            while self._take(0):  # a rank flushes its report before it exits: read what is in the pipe
                pass
        return [r for r in dead if r not in self._outcomes]

    def wait(self, timeout_s: float) -> list[RankOutcome]:
        """Every rank's outcome, by rank. Stops waiting ``FAILURE_GRACE_S`` after the first failure, or at
        ``timeout_s``; a rank that has not reported by then gets an error saying so."""
        deadline = time.monotonic() + timeout_s
        while len(self._outcomes) < self.world and time.monotonic() < deadline:
            self._take(0.2)
            for r in self._dead_without_report():
                code = self.procs[r].exitcode
                self._record(RankOutcome(r, error=f"its process {_describe_exit(code)} without a result"))
            if any(not o.ok for o in self._outcomes.values()):
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        failed = any(not o.ok for o in self._outcomes.values())
        for r in range(self.world):
            if r not in self._outcomes:
                why = "gave no result before the group was ended" if failed else f"did not finish in {timeout_s:g} s"
                self._record(RankOutcome(r, error=why))
        return [self._outcomes[r] for r in range(self.world)]

    def close(self) -> None:
        """End the group: a clean group gets ``EXIT_GRACE_S`` to exit, then whatever is left is killed; record
        exit codes in the outcomes; stop the store."""
        clean = len(self._outcomes) == self.world and all(o.ok for o in self._outcomes.values())
        deadline = time.monotonic() + (EXIT_GRACE_S if clean else 0.0)
        for p in self.procs:
            if p.pid is None:
                continue
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for r, p in enumerate(self.procs):
            if r in self._outcomes and p.pid is not None:
                self._outcomes[r].exitcode = p.exitcode
        if self._results is not None:
            self._results.close()
            self._results.cancel_join_thread()
        self._store = None  # the last reference: its server stops


def failure_message(name: str, outcomes: list[RankOutcome]) -> str:
    """One paragraph per failed rank, the first to fail first: ``<name>: rank r failed:`` and its traceback
    or reason."""
    failed = sorted((o for o in outcomes if not o.ok), key=lambda o: o.order)
    return "\n".join(f"{name}: rank {o.rank} failed:\n{o.error}" for o in failed)


def spawn_ranks(fn: Callable, world: int, *args: Any, timeout_s: float = 120.0, pg_timeout_s: float = 60.0,
                threads: int = 1, name: str = "ranks") -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks and return what each returned, by rank.

    ``fn`` must be a module-level function and its arguments and results picklable. Raises ``SpawnError``
    naming every failed rank (its traceback, or how its process ended) when one raises, dies or the group
    takes longer than ``timeout_s``."""
    with RankGroup(fn, world, args, pg_timeout_s=pg_timeout_s, threads=threads, name=name) as group:
        outcomes = group.wait(timeout_s)
    if not all(o.ok for o in outcomes):
        raise SpawnError(failure_message(name, outcomes), outcomes)
    return [o.value for o in outcomes]
