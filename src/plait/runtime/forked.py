"""A process forked from multiprocessing's fork server (plait's ranks and ``plait train``'s workers), made to
behave as the fresh interpreter a spawned process would be, in the two ways forking differs:

- **Its default start method.** A fork server's child inherits ``forkserver`` as its default, and with it the
  server's liveness pipe, which every process it then starts holds open. A data loader's workers started that
  way (the default of ``torch.utils.data.DataLoader``) would be children of a second fork server that outlives a
  killed worker: they watch that server, which they keep alive, and never exit, holding the worker's output
  pipes. ``fresh_start_method`` restores the platform's default (``fork`` on Linux, as under ``torchrun``), so
  such workers are the worker's own children and end with it.
- **Its exit handlers.** A forked child leaves through ``os._exit``, which skips ``atexit``: trackers that flush
  at exit (W&B's offline files, a logging handler) would lose what they hold. ``exit_handlers`` runs them when
  the process's work ends, as an interpreter's shutdown would, whether it ended cleanly or raised.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
from collections.abc import Iterator


def fresh_start_method() -> None:
    """The platform's default start method for the processes this one starts (see the module docstring)."""
    multiprocessing.set_start_method(None, force=True)


@contextlib.contextmanager
def exit_handlers() -> Iterator[None]:
    """Run the ``atexit`` handlers registered in this process when the block ends, however it ends (CPython
    clears them once run, so an interpreter that does shut down normally afterwards does not run them twice)."""
    try:
        yield
    finally:
        atexit._run_exitfuncs()
