"""Stopping launched processes that each lead their own session (``start_new_session=True``): the process and
everything it started (an elastic agent and its workers) get SIGTERM, then SIGKILL after a grace."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterable


def stop_sessions(procs: Iterable[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM the session of every process still running, wait up to ``grace_s`` for each, then SIGKILL the
    session of any that has not exited, and reap it."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
