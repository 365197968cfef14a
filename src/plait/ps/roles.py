"""Who serves and who works, the process groups of a PS run, its config checks and merged statistics.

Ranks ``0 .. N-1`` are workers and the last ``ps.servers`` ranks are servers, so global rank 0 (the
rank that writes metrics, checkpoints' metadata and summaries) is a worker. Four groups, created on
every rank in the same order: the workers' (their collectives: logging, evaluation),
the parameter-server group for point-to-point messages (gloo, whatever the training backend, with a
long timeout: a server legitimately waits as long as the workers compute, and a peer that dies is
seen at once through its closed connection), the servers' (one all-reduce per sync version when
the gradient is clipped over several shards), and every rank's (gloo: the checkpoints' DCP collectives,
in which the servers write and read their own shards).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from plait.config import Config, ConfigError
from plait.parallel.errors import RankDone
from plait.topology import Topology

# How long a PS peer may be silent: a server waits for the workers' whole compute, so no timeout of
# gloo's short kind may apply to it; a dead peer is detected by its closed connection instead.
P2P_TIMEOUT = timedelta(days=7)
SUPPORTED = ("data parallelism over the workers only: parallel.tp = pp = ep = 1, parallel.zero = 0, "
             "parallel.impl = plait, comm.compress = none, comm.allreduce = backend")


class ServerDone(RankDone):
    """Raised by ``Plait.setup`` on a server rank once every worker has finished: the server's part of the
    run is over, and the process exits with status 0 unless the caller catches it (``stats`` holds the
    server's statistics). Servers never run the user's loop."""

    key = "ps_server"


@dataclass
class PsGroups:
    rank: int
    world_size: int
    num_servers: int
    workers: Any = None
    p2p: Any = None
    servers: Any = None
    world: Any = None

    @property
    def num_workers(self) -> int:
        return self.world_size - self.num_servers

    @property
    def is_server(self) -> bool:
        return self.rank >= self.num_workers

    @property
    def server_index(self) -> int:
        return self.rank - self.num_workers

    @property
    def server_ranks(self) -> list[int]:
        return list(range(self.num_workers, self.world_size))


def make_groups(servers: int) -> PsGroups:
    """The PS process groups for ``servers`` servers (collective: every rank calls it, in the same order)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = PsGroups(rank, world, servers)
    g.workers = dist.new_group(ranks=list(range(g.num_workers)), use_local_synchronization=False)
    g.p2p = dist.new_group(backend="gloo", timeout=P2P_TIMEOUT)
    g.servers = dist.new_group(ranks=g.server_ranks, backend="gloo") if g.num_servers > 1 else None
    g.world = dist.new_group(backend="gloo")
    return g


def check_ps(cfg: Config, world_size: int) -> int:
    """Check ``[ps]`` and its composition for ``world_size`` ranks; returns the number of workers."""
    p, s, c = cfg.parallel, cfg.ps, cfg.comm
    if world_size < 2:
        raise ConfigError(f"parallel.mode=ps needs at least 2 ranks (a server and a worker); the world has "
                          f"{world_size}: set parallel.nproc >= 2")
    if not 1 <= s.servers <= world_size - 1:
        raise ConfigError(f"ps.servers={s.servers} must be between 1 and world size - 1 = {world_size - 1} (at "
                          "least one rank must be a worker)")
    workers = world_size - s.servers
    if s.staleness < 0:
        raise ConfigError(f"ps.staleness must be 0 or more (the SSP bound s); got {s.staleness}")
    if s.mode == "backup":
        if not 0 <= s.backup_workers < workers:
            raise ConfigError(f"ps.backup_workers={s.backup_workers} must be between 0 and workers - 1 = {workers - 1} "
                              f"({workers} workers): each version needs at least one gradient")
    if cfg.checkpoint.async_save:
        raise ConfigError("checkpoint.async=true does not combine with parallel.mode=ps in this build: the servers "
                          "write their own shards of a checkpoint while the workers wait; set checkpoint.async=false")
    if s.dc_lambda < 0 or s.staleness_scaling < 0:
        raise ConfigError("ps.dc_lambda and ps.staleness_scaling must be 0 or more")
    if s.max_staleness < -1:
        raise ConfigError(f"ps.max_staleness must be -1 (no limit) or 0 or more; got {s.max_staleness}")
    if s.push_every < 1 or s.pull_every < 1:
        raise ConfigError("ps.push_every and ps.pull_every must be at least 1")
    if s.pull_every > 1 and s.mode not in ("async", "dc"):
        raise ConfigError(f"ps.pull_every={s.pull_every} applies to ps.mode=async or dc (sync, backup and ssp bound "
                          f"what a worker reads); got ps.mode={s.mode}")
    bad = [f"parallel.{k}={getattr(p, k)}" for k in ("tp", "pp", "ep") if getattr(p, k) != 1]
    bad += [f"parallel.zero={p.zero}"] if p.zero else []
    bad += ["parallel.impl=torch"] if p.impl == "torch" else []
    bad += ["parallel.sync_batchnorm=true"] if p.sync_batchnorm else []
    bad += [f"comm.compress={c.compress}"] if c.compress != "none" else []
    bad += [f"comm.allreduce={c.allreduce}"] if c.allreduce != "backend" else []
    if p.dp not in (0, workers):
        bad.append(f"parallel.dp={p.dp} (the workers are the data-parallel ranks: {workers})")
    if bad:
        raise ConfigError(f"parallel.mode=ps does not combine with {', '.join(bad)}; it supports {SUPPORTED}")
    return workers


@dataclass
class PsTopology(Topology):
    """The workers' topology, with the PS run's process groups (``groups``)."""

    groups: PsGroups | None = None

    @property
    def train_group(self) -> Any:
        return self.groups.workers


def ps_topology(groups: PsGroups, device: torch.device) -> PsTopology:
    """The workers' topology: ``dp`` = the workers, over the workers' group (servers get the same one)."""
    degrees = {"pp": 1, "dp_replicate": groups.num_workers, "dp_shard": 1, "ep": 1, "tp": 1}
    return PsTopology(degrees=degrees, rank=groups.rank, world_size=groups.num_workers, device=device,
                      _groups={"dp_replicate": groups.workers}, groups=groups)


def merge_stats(per_server: list[dict[str, Any]], ps: Any) -> dict[str, Any]:
    """One ``ps`` block from every server's statistics: sums of counts and bytes, the histogram of the
    staleness of applied gradients (sync and backup: 0), the largest staleness per worker and clock gap."""
    hist: dict[str, int] = {}
    for s in per_server:
        for k, v in s["staleness_histogram"].items():
            hist[k] = hist.get(k, 0) + v
    n = len(per_server[0]["worker_max_staleness"]) if per_server else 0
    total = lambda key: sum(s[key] for s in per_server)  # noqa: E731
    return {"mode": ps.mode, "servers": len(per_server), "workers": n,
            "versions": [s["version"] for s in per_server], "clocks": per_server[0]["clocks"] if per_server else [],
            "applied": total("applied"), "dropped": total("dropped"), "rejected": total("rejected"),
            "nonfinite": total("nonfinite"),
            "staleness_histogram": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
            "max_staleness": max((int(k) for k in hist), default=0),
            "worker_max_staleness": [max(s["worker_max_staleness"][k] for s in per_server) for k in range(n)],
            "max_clock_gap": max((s["max_clock_gap"] for s in per_server), default=0),
            "max_read_gap": max((s["max_read_gap"] for s in per_server), default=0),
            "push_bytes": total("bytes_received"), "pull_bytes": total("bytes_sent"),
            "server_pull_wait_s": round(total("pull_wait_s"), 6),
            "server_utilisation": [s["utilisation"] for s in per_server],
            "shard_numel": [s["numel"] for s in per_server]}
