"""Preemption: SIGTERM, SIGINT or SIGUSR1 ends a run at the next step boundary, saved, with a distinct exit code.

The first signal only sets a flag (a worker may be inside a collective that must complete). At each log
step every rank contributes its flag to one small all-reduce (``Plait.step``; where steps are slow, at stop
checks in between too: ``plait.engine.stepper``), so all ranks see the request at the same step, at most
``train.log_every - 1`` steps and about ``STOP_CHECK_S`` (20 s) after it arrived, save together and exit with
``PREEMPTED_EXIT``. A second SIGINT
(Ctrl-C twice) ends the process at once. The elastic agent forwards SIGTERM to its workers and gives
them 30 s before killing them (plait's own launcher: ``PLAIT_GRACE_S``); a save of the default model takes well
under a second. SIGUSR1 is SLURM's warning before a time limit or a preemption (``--signal=B:USR1@<grace>``, passed
on to the tasks by the batch script).
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

# Documented exit codes of `plait train` / `plait run`.
FAILED_EXIT = 1  # a worker failed (restarts exhausted, or an error a restart cannot fix)
CONFIG_EXIT = 2  # the configuration cannot work (nothing was started)
NO_PROGRESS_EXIT = 3  # restarts failed again without progress: stopped instead of looping
PREEMPTED_EXIT = 75  # SIGTERM/SIGINT/SIGUSR1: every rank saved at the same step; resume with --resume (EX_TEMPFAIL)


class Preempted(Exception):
    """Raised by the trainer once every rank has saved after a preemption request."""

    def __init__(self, step: int, checkpoint: str) -> None:
        super().__init__(f"preempted at step {step}; checkpoint {checkpoint}")
        self.step, self.checkpoint = step, checkpoint


class PreemptionFlag:
    """SIGTERM/SIGINT/SIGUSR1 handlers for a worker process (installed from the main thread only)."""

    def __init__(self) -> None:
        self.requested = False
        self.signal: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested and signum == signal.SIGINT:
            os._exit(130)  # a second Ctrl-C: abort at once
        self.requested, self.signal = True, signum
