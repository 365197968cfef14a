"""Step watchdog: a rank stuck in any collective, whoever issued it, ends the job with a named error.

``CollectiveGuard`` covers the collectives plait issues through ``Comm``. Many others are issued
inside PyTorch on plait's behalf: DTensor redistributions (tensor parallel), pipeline P2P,
FSDP2's all-gathers and reduce-scatters, DCP checkpoint save/load, and direct ``dist.*`` calls in
the model-parallel layouts. The watchdog covers all of them from the outside:

- The trainer calls ``enter(step, phase)`` at each phase of its loop ("forward/backward",
  "optimizer", "evaluate", "checkpoint save", ...). That only stores a few attributes; the record
  ``seq|step|phase|state|where`` reaches the rendezvous store (key ``<prefix>/<n>/<rank>``, where
  ``n`` counts the watchdogs this process made, overwritten)
  from a daemon thread, at most once per sampling interval, so no store round trip is on the
  critical path.
- The same thread samples the main thread's Python stack every interval (``sys._current_frames``).
  The innermost frame outside PyTorch's generic plumbing says where the rank is: inside
  ``torch/distributed`` or ``plait/comm`` it is *waiting* in communication, anywhere else it is
  *busy* (computing, or stalled in its own code). Once a phase has run half the timeout, the
  state and place are published too, so a peer that times out can tell who is holding it up.
- When the main thread has been waiting in the same communication call for ``timeout_s`` plus a
  margin (the margin lets ``CollectiveGuard``'s own, more precise error win for plait's
  collectives), the thread reads every rank's record and names the ranks that did not arrive:
  those at an earlier phase, else those busy outside communication in the current one. The main
  thread may be blocked inside a C++ collective and cannot raise, so the thread writes
  ``CollectiveTimeout: ...`` to the launcher's error file (``RUN_DIR/errors/rank<r>.txt``) and
  ends the process with ``os._exit(1)``.
- When the backend's own timeout fires first (gloo honours the process-group timeout, which the
  launcher sets to ``comm.timeout_s``) the main thread gets gloo's ``RuntimeError``;
  ``explain(exc)`` turns it into the same named ``CollectiveTimeout``.

A phase may compute for as long as it needs: only waiting for peers is bounded. Waits with no
Python frame of their own (a collective run by the C++ autograd engine) are bounded by the
backend's timeout and named through ``explain``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType

import torch.distributed as dist

from plait.comm.guard import CollectiveTimeout

_SEP = os.sep
_COMM_DIRS = (f"{_SEP}torch{_SEP}distributed{_SEP}", f"{_SEP}plait{_SEP}comm{_SEP}")
_TORCH_DIR = f"{_SEP}torch{_SEP}"
# Substrings of a backend error caused by a peer that is late, gone or unreachable.
KILL_GRACE_S = 2.0  # SIGTERM to SIGKILL for a stuck peer (hang escalation)
_COMM_FAILURES = ("gloo", "Timed out", "timed out", "Connection closed", "Connection reset", "NCCL")


@dataclass
class Record:
    """One rank's last published position: phase number ``seq`` (the same on every rank for the same
    phase), the step and phase name, and ``state`` ("running", "waiting" or "busy") with ``where``."""

    seq: int
    step: int
    phase: str
    state: str
    where: str

    def encode(self) -> str:
        return "|".join([str(self.seq), str(self.step), self.phase, self.state, self.where])

    @classmethod
    def decode(cls, text: str) -> Record:
        seq, step, phase, state, where = text.split("|", 4)
        return cls(int(seq), int(step), phase, state, where)


def _short(path: str) -> str:
    for marker in ("site-packages" + _SEP, _SEP + "src" + _SEP):
        if marker in path:
            return path.rsplit(marker, 1)[1]
    return os.path.basename(path)


def locate(frames: list[FrameType]) -> tuple[str, str, FrameType | None]:
    """(state, where, frame) of a stack given innermost first: the first frame outside PyTorch's
    generic plumbing (``torch/`` but not ``torch/distributed``) decides. ``waiting`` when it is
    communication code, ``busy`` otherwise."""
    for f in frames:
        path = f.f_code.co_filename
        comm = any(d in path for d in _COMM_DIRS)
        if comm or _TORCH_DIR not in path:
            where = f"{_short(path)}:{f.f_lineno} in {f.f_code.co_name}"
            return ("waiting" if comm else "busy"), where, f
    return "busy", ("PyTorch internals" if frames else "a collective with no Python stack"), None


def _stack(frame: FrameType | None) -> list[FrameType]:
    out = []
    while frame is not None:
        out.append(frame)
        frame = frame.f_back
    return out


def _tb_frames(tb: TracebackType | None) -> list[FrameType]:
    out = []
    while tb is not None:
        out.append(tb.tb_frame)
        tb = tb.tb_next
    return out[::-1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def is_comm_failure(exc: BaseException) -> bool:
    """True for a backend error raised because a peer was late, died or became unreachable."""
    if isinstance(exc, CollectiveTimeout):
        return False
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _COMM_FAILURES)


class StepWatchdog:
    """Bound every wait for peers in a training step, and name the ranks that did not arrive.

    ``store`` is a c10d store every rank reaches (None: inert, for one process), ``timeout_s`` the
    longest a rank may wait in one collective (``comm.timeout_s``), ``error_path`` the file the
    launcher reads a worker's error from, ``kinds`` a few words on the collectives this layout
    runs (named in the error). ``interval_s`` is the sampling period (default: a tenth of the
    timeout, within 0.1-1 s) and ``margin_s`` the extra wait before the watchdog fires. Call
    ``enter`` at each phase (the thread starts at the first call) and ``close`` at the end.
    """

    _made = 0
    late: list[int] = []  # the ranks the last description named

    def __init__(self, store: dist.Store | None, timeout_s: float, rank: int, world_size: int,
                 error_path: Path | None = None, kinds: str = "", prefix: str = "plait/phase",
                 interval_s: float | None = None, margin_s: float = 3.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"collective timeout must be positive seconds; got {timeout_s}")
        self.store, self.timeout_s, self.rank, self.world_size = store, float(timeout_s), rank, world_size
        # Every rank builds its watchdogs in the same order, so the n-th ones share keys and a
        # stale one (a test building several trainers in one process) cannot mix with a newer one.
        StepWatchdog._made += 1
        self.error_path, self.kinds, self.prefix = error_path, kinds, f"{prefix}/{StepWatchdog._made}"
        self.interval_s = interval_s if interval_s is not None else min(1.0, max(0.1, timeout_s / 10))
        self.margin_s = margin_s
        self._seq, self._step, self._phase, self._since = 0, 0, "", 0.0
        self._main: int | None = None
        self._published: str | None = None
        self._wait_id: tuple | None = None
        self._wait_since = 0.0
        self._state = "running"  # the last sample's view of the main thread (``status``)
        self._lock = threading.Lock()  # held by whoever reports the error: the thread or explain()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- main thread -------------------------------------------------------------------------------
    def enter(self, step: int, phase: str) -> None:
        """Record that this rank starts ``phase`` of ``step``; every rank must enter the same phases
        in the same order. Costs a few attribute writes: the store is written by the thread."""
        if self.store is None or self._stop.is_set():
            return
        self._seq += 1
        self._step, self._phase, self._since = step, phase, time.monotonic()
        if self._thread is None:
            self._main = threading.get_ident()
            self._thread = threading.Thread(target=self._run, name="plait-watchdog", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the thread (no stray thread after training); later ``enter`` calls do nothing. The last
        record says this rank closed, so a peer still waiting names it as gone rather than as silent."""
        if self.store is not None and not self._stop.is_set() and self._seq:
            with contextlib.suppress(Exception):
                self._publish(Record(self._seq, self._step, self._phase, "closed", ""))
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.interval_s + 5)
        self._thread = None

    def explain(self, exc: BaseException) -> BaseException:
        """``exc`` as a named ``CollectiveTimeout`` when it is a backend timeout or lost peer (the
        watchdog is then stopped: the caller raises it and the process ends); otherwise ``exc``."""
        if self.store is None or not is_comm_failure(exc) or not self._lock.acquire(blocking=False):
            return exc
        self._stop.set()
        _, where, _ = locate(_tb_frames(exc.__traceback__))
        with contextlib.suppress(Exception):  # peers explaining their own failure see this rank waiting
            self._publish(Record(self._seq, self._step, self._phase, "waiting", where))
        cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        lost = "Connection" in cause or "connection" in cause
        return CollectiveTimeout(f"{self.describe(None, where, lost)}; backend said: {cause}", ranks=self.late)

    def status(self) -> tuple[str, float]:
        """``(state, seconds)`` for monitoring, from any thread: "off" (inert, not started or closed), "running" (not
        sampled yet), "busy" or "waiting" as last sampled, and how long the main thread has waited in the same
        communication call (0 when it is not waiting)."""
        if self.store is None or self._stop.is_set() or self._thread is None:
            return "off", 0.0
        if self._state != "waiting" or self._wait_id is None:
            return self._state, 0.0
        return "waiting", time.monotonic() - self._wait_since

    # -- the thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._sample()
            except Exception:  # the store went away with its host: the launcher ends the job
                if self._stop.is_set():
                    return
                time.sleep(self.interval_s)

    def _sample(self) -> None:
        frame = sys._current_frames().get(self._main)
        if frame is None:  # the main thread has ended
            return
        seq, now = self._seq, time.monotonic()
        state, where, f = locate(_stack(frame))
        self._state = state
        if state == "waiting":
            ident = (seq, id(f), f.f_lasti if f is not None else -1)
            if ident != self._wait_id:
                self._wait_id, self._wait_since = ident, now
            elif now - self._wait_since >= self.timeout_s + self.margin_s:
                self._fire(now - self._wait_since, where, frame)
        else:
            self._wait_id = None
        if now - self._since < self.timeout_s / 2:
            state, where = "running", ""  # young phase: position only, which changes less often
        self._publish(Record(seq, self._step, self._phase, state, where))
        del frame, f

    def _publish(self, rec: Record) -> None:
        text = rec.encode()
        if text != self._published:
            self.store.set(f"{self.prefix}/{self.rank}", text)
            self._published = text

    def _fire(self, waited: float, where: str, frame: FrameType) -> None:
        if not self._lock.acquire(blocking=False):
            return  # the main thread is already reporting a backend error
        try:
            with contextlib.suppress(Exception):
                self._publish(Record(self._seq, self._step, self._phase, "waiting", where))
            text = f"CollectiveTimeout: {self.describe(waited, where)}"
            if not os.environ.get("TORCHELASTIC_RUN_ID", "").startswith("plait-"):
                print(f"plait rank {self.rank}: {text}", file=sys.stderr, flush=True)  # else the launcher says it
            if self.error_path is not None:
                stack = "".join(traceback.format_stack(frame))
                self.error_path.parent.mkdir(parents=True, exist_ok=True)
                self.error_path.write_text(f"{text}\nmain thread of rank {self.rank} (seen by the watchdog):\n{stack}")
            with contextlib.suppress(Exception):
                self._end_stuck_peers()
        finally:
            os._exit(1)  # the main thread is blocked in a collective: only ending the process frees it

    # -- naming the ranks --------------------------------------------------------------------------
    def records(self) -> dict[int, Record | None]:
        """Every rank's last published record (None: it never published one)."""
        out: dict[int, Record | None] = {}
        for r in range(self.world_size):
            key = f"{self.prefix}/{r}"
            out[r] = Record.decode(self.store.get(key).decode()) if self.store.check([key]) else None
        return out

    def describe(self, waited: float | None, where: str, lost: bool = False) -> str:
        """The error's text: this rank's phase and wait (``waited`` None: the backend ended it, by its
        timeout or, ``lost``, because a peer's connection closed), then the ranks holding it up."""
        kinds = f" ({self.kinds} collectives)" if self.kinds else ""
        if lost:
            head = (f"step {self._step} phase '{self._phase}'{kinds} failed: rank {self.rank} lost a peer's "
                    f"connection while waiting in {where}")
        else:
            wait = f"waited {waited:.1f}s in {where}" if waited is not None else f"timed out waiting in {where}"
            head = (f"step {self._step} phase '{self._phase}'{kinds} did not complete within "
                    f"{self.timeout_s:g}s: rank {self.rank} {wait}")
        try:
            who = self._culprits(self.records())
        except Exception as e:  # the store may be gone with the rank that hosted it
            who = f"the rendezvous store could not be read to find the missing ranks ({e})"
        return (f"{head}; {who}. Check those ranks' logs for an earlier error or a code path that "
                f"skips a collective; raise comm.timeout_s if they are only slow")

    def _culprits(self, recs: dict[int, Record | None]) -> str:
        latest = max((r.seq for r in recs.values() if r is not None), default=0)
        others = {r: x for r, x in recs.items() if r != self.rank}  # this rank knows it is waiting
        behind = {r: "published no status (it never started, or exited before its first report)" if x is None else
                  f"closed its Plait after step {x.step} '{x.phase}'" if x.state == "closed" else
                  f"last seen at step {x.step} '{x.phase}'" + (f" in {x.where}" if x.where else "")
                  for r, x in recs.items() if x is None or x.seq < latest}
        busy = {r: f"busy at step {x.step} '{x.phase}' in {x.where}" if x.state == "busy" else
                f"closed its Plait after step {x.step} '{x.phase}'"
                for r, x in others.items() if x is not None and x.seq == latest and x.state in ("busy", "closed")}
        silent = {r: "published no status in this phase (its process may be frozen)"
                  for r, x in others.items() if x is not None and x.seq == latest and x.state == "running"}
        for found, verb in ((behind, "did not arrive"), (busy, "did not arrive"), (silent, "did not report")):
            if found:
                detail = "; ".join(f"rank {r} {d}" for r, d in sorted(found.items()))
                self.late = sorted(found)
                return f"ranks {sorted(found)} {verb} ({detail})"
        return ("every rank is waiting in communication, so a peer died, the network stalled, or ranks "
                "issued their collectives in different orders")

    def end_stuck_peers(self, ranks: list[int]) -> None:
        """Hang escalation for ``ranks`` named by another detector (plait's collective guard)."""
        self.late = list(ranks)
        self._end_stuck_peers()

    def _end_stuck_peers(self) -> None:
        """Hang escalation: the late ranks running on this host (pids from ``workers/rank<r>.pid`` next to
        the error directory) get SIGCONT (a stopped process), SIGTERM, and after ``KILL_GRACE_S`` SIGKILL, so
        the attempt ends now rather than after the agent's 30 s termination grace; the restart policy then
        applies. Ranks on other hosts end when their connections to this one close."""
        if self.error_path is None or not self.late:
            return
        import signal
        import socket

        from plait.fault.restart import worker_pids

        pids = worker_pids(self.error_path.parent.parent)
        here = socket.gethostname()
        targets = [pids[r][0] for r in self.late if r in pids and pids[r][1] == here and pids[r][0] != os.getpid()]
        for sig in (signal.SIGCONT, signal.SIGTERM):
            for pid in targets:
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
        deadline = time.monotonic() + KILL_GRACE_S
        while targets and time.monotonic() < deadline:
            targets = [p for p in targets if _alive(p)]
            time.sleep(0.1)
        for pid in targets:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
