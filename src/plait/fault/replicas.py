"""Per-step fault tolerance on torchft (``fault.mode = "replicas"``): the launcher's side.

Each data-parallel replica group runs as its own job under its own elastic agent (``torchrun --standalone``
with one worker per rank of the group, restarting them up to ``fault.max_restarts`` times), so the death of one
group's process ends nothing outside that group. The groups find one another through a torchft Lighthouse:
``fault.lighthouse`` names an existing one (clusters), otherwise the launcher starts one on this machine's loopback
for the run's length.
Every worker learns its group and the number of groups from ``PLAIT_REPLICA_GROUP`` / ``PLAIT_REPLICA_GROUPS``
and the Lighthouse from ``TORCHFT_LIGHTHOUSE`` (torchft's own variable). What happens inside a worker is
``plait.parallel.replicas``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from plait.config import ConfigError
from plait.runtime.sessions import stop_sessions

GROUP_ENV = "PLAIT_REPLICA_GROUP"
GROUPS_ENV = "PLAIT_REPLICA_GROUPS"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


def require_torchft() -> Any:
    """The torchft module, or one clear error saying how to install it."""
    # torchft's Rust side logs every quorum at INFO from its first import on; warnings and errors stay (a RUST_LOG
    # of the user's wins)
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft
    except ImportError:
        raise ConfigError("fault.mode=replicas runs on torchft, which is not installed: pip install 'plait[ft]' "
                          "(torchft 0.2.0), or set fault.mode=restart") from None
    return torchft


def replica_group() -> tuple[int, int] | None:
    """(this worker's replica group, the number of groups) from the launcher's environment; None outside one."""
    if GROUP_ENV not in os.environ:
        return None
    try:
        group, groups = int(os.environ[GROUP_ENV]), int(os.environ[GROUPS_ENV])
    except (KeyError, ValueError):
        raise ConfigError(f"{GROUP_ENV} and {GROUPS_ENV} must both be whole numbers (set by plait run --replicas "
                          "and plait train); unset them, or start the run with one of those") from None
    if not 0 <= group < groups:
        raise ConfigError(f"{GROUP_ENV}={group} must lie in 0..{groups - 1} ({GROUPS_ENV}={groups})")
    return group, groups


def default_groups(nproc: int, model_parallel: int) -> int:
    """The replica groups of a run of ``nproc`` ranks when ``parallel.dp_replicate`` is 0: one per model replica, that
    is per ``model_parallel`` ranks (tp x pp x cp, times ep: ``plait.parallel.replicas.topology.smallest_group``); one
    rank each without model parallelism."""
    return max(1, nproc // model_parallel)


def start_lighthouse(min_replicas: int = 1, join_timeout_ms: int = 1000,
                     heartbeat_timeout_ms: int = 2000) -> tuple[Any, str]:
    """A torchft Lighthouse bound to loopback on a free port, and its address (``http://127.0.0.1:PORT``). It forms
    a quorum once ``min_replicas`` groups ask and no other joins within ``join_timeout_ms``. A group that sent no
    heartbeat (every 100 ms) for ``heartbeat_timeout_ms`` is dead: until then the survivors' next quorum waits for
    it (a majority of the groups still counted alive must ask), so this bounds how long a SIGKILLed group stalls the
    others: torchft's default of 5 s measured 5.07 s from a kill to the survivor's next step on the default GPT."""
    require_torchft()
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                              heartbeat_timeout_ms=heartbeat_timeout_ms)
    port = server.address().rsplit(":", 1)[1]
    return server, f"http://127.0.0.1:{port}"


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def launch_replica_groups(command: Callable[[int], list[str]], groups: int, max_restarts: int, lighthouse: str,
                          min_replicas: int = 1, ranks: int = 1) -> int:
    """Run ``command(i)`` (a worker's argument list after ``python``) as replica group ``i`` of ``groups``, each of
    ``ranks`` workers under its own elastic agent (which restarts all of them when one fails); with no
    ``lighthouse`` address a loopback Lighthouse is started for the run. Returns 0 when every group ended well,
    else the first failing group's exit status (after the others were stopped). Ending the
    launcher with SIGTERM or Ctrl-C stops every group; a launcher killed with SIGKILL leaves the groups' agents
    running (each in its own session) until their workers fail to reach the Lighthouse and their restarts run out.
    Call it from the main thread (it handles SIGTERM while it waits)."""
    server = None
    if not lighthouse:
        server, lighthouse = start_lighthouse(min_replicas)
        print(f"plait: torchft Lighthouse at {lighthouse} for {groups} replica groups", flush=True)
    procs = []
    # SIGTERM (a scheduler, a timeout) ends the launcher through the finally below, which stops every group: by
    # default it would end only this process, leaving the agents, each in its own session, running
    previous = signal.signal(signal.SIGTERM, _raise_exit)
    try:
        for i in range(groups):
            env = {**os.environ, GROUP_ENV: str(i), GROUPS_ENV: str(groups), LIGHTHOUSE_ENV: lighthouse}
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                    f"--max-restarts={max_restarts}", *command(i)]
            procs.append(subprocess.Popen(argv, env=env, start_new_session=True))
        failed = 0
        while any(p.poll() is None for p in procs):
            bad = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if bad:  # a group out of restarts: the run cannot finish as asked
                failed = bad[0]
                break
            time.sleep(0.5)
        return failed or next((p.returncode for p in procs if p.returncode), 0)
    finally:
        stop_sessions(procs, grace_s=30)
        signal.signal(signal.SIGTERM, previous)
        if server is not None:
            server.shutdown()
