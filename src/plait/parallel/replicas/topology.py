"""``fault.mode=replicas``'s topology and checks: each replica group is a job of its own (``plait.fault.replicas``
launches them), so a worker's world and mesh are its group's; ``ReplicaTopology`` places it among the groups for the
data, ``group_config`` is the config the layout inside a group is built from, and ``check_replicas`` what a replica
group cannot hold (``plait.parallel.replicas.driver``'s docstring): the settings of a group's own gradient
synchronisation (compression, plait's all-reduce algorithms, DDP, SyncBatchNorm, a policy by name) take effect inside
each group and are refused only where a group has one data-parallel rank."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from plait.config import Config, ConfigError, ParallelConfig
from plait.fault.replicas import default_groups, replica_group, require_torchft
from plait.parallel.grad_sync import policies
from plait.topology import Topology, build_topology


@dataclass
class ReplicaTopology(Topology):
    """The engine's topology of one replica group's rank: the group's own mesh (its ranks and process groups, the
    layout inside the group), and its place among the groups for the data: ``dp`` counts the data-parallel ranks of
    every group, ``dp_rank`` is this rank's among them (the ranks of one tensor-parallel group or pipeline share it:
    they read the same samples). The strategies get the group's plain topology."""

    group_index: int = 0
    num_groups: int = 1

    @property
    def dp(self) -> int:
        return self.num_groups * Topology.dp.fget(self)

    @property
    def dp_rank(self) -> int:
        return self.group_index * Topology.dp.fget(self) + Topology.dp_rank.fget(self)

    @property
    def dp_reachable(self) -> int:
        """This group's data-parallel ranks: the groups' values meet only in torchft's gradient all-reduce."""
        return Topology.dp.fget(self)

    def group_topology(self) -> Topology:
        """The group's own topology: the layout inside the group is built on it."""
        return Topology(degrees=self.degrees, rank=self.rank, world_size=self.world_size, device=self.device,
                        mesh=self.mesh, _groups=self._groups)


def group_config(cfg: Config) -> Config:
    """``cfg`` for the layout inside one group: its data-parallel degree inferred from the group's world."""
    out = copy.copy(cfg)
    out.parallel = copy.copy(cfg.parallel)
    out.parallel.dp, out.parallel.dp_replicate = 0, 0
    return out


def check_replicas(cfg: Config, degrees: dict[str, int]) -> None:
    """``fault.mode=replicas``'s settings and what a replica group cannot hold (module docstring)."""
    p, c, f = cfg.parallel, cfg.comm, cfg.fault
    if f.mode != "replicas":
        if p.dp_replicate:
            raise ConfigError(f"parallel.dp_replicate={p.dp_replicate} sets the torchft replica groups of "
                              "fault.mode=replicas; set fault.mode=replicas, or leave it 0 (hybrid sharding's "
                              "replicas follow from parallel.dp_shard)")
        return
    if p.mode == "ps":
        raise ConfigError("fault.mode=replicas averages the gradients of collective data-parallel replica groups; a "
                          "parameter server (parallel.mode=ps) is data parallelism with its own consistency: set "
                          "fault.mode=restart with it, or parallel.mode=collective")
    if f.rebalance:
        raise ConfigError("fault.rebalance moves shares of every global batch between data-parallel ranks by their "
                          "speed, agreed by every rank of the run; torchft replica groups are jobs of their own that "
                          "meet only in the gradient average, each reading its fixed share (untrained while it is "
                          "away), weighted alike: set fault.rebalance=false, or fault.mode=restart")
    groups, ranks = degrees["dp_replicate"], degrees["dp_shard"]  # ranks: a group's data-parallel ranks / ep
    model_par = p.tp * p.pp * p.cp
    shards = ranks * p.ep * p.cp  # the ranks a group's gradient synchronisation averages over (dp x cp)
    # settings that act on the group's own gradient synchronisation (module docstring of the driver): with one rank
    # it has none, and torchft's average over the groups stays its own float32 all-reduce
    own = [name for name, on in (
        (f"comm.compress={c.compress}", c.compress != "none"), (f"comm.allreduce={c.allreduce}",
                                                                 c.allreduce != "backend"),
        ("parallel.impl=torch", p.impl == "torch"), ("parallel.sync_batchnorm", p.sync_batchnorm)) if on]
    if own and shards < 2:
        raise ConfigError(f"{', '.join(own)} acts on each replica group's own gradient synchronisation, and a group "
                          f"here has one data-parallel rank, so there is none (torchft's average over the groups is "
                          f"its own float32 all-reduce): give each group 2 data-parallel ranks or more (plait run "
                          f"--replicas G --nproc {2 * model_par * p.ep}), or remove it")
    named = policies().get(p.strategy) if p.strategy != "auto" else None  # a policy by name, ZeRO's or FSDP's too
    shard, unset = (f"parallel.zero={p.zero}", "parallel.zero=0") if p.zero else (
        (f"parallel.strategy={p.strategy}", "parallel.strategy=auto") if named is not None and named.shards_gradients
        else ("", ""))
    if shard and shards < 2 and model_par == 1:
        raise ConfigError(f"fault.mode=replicas with {shard} shards each replica group's state over "
                          f"its ranks, and a group here is one rank ({groups} groups): set parallel.dp_replicate "
                          "to fewer groups than parallel.nproc (each of nproc / dp_replicate ranks; plait run "
                          f"--replicas G --nproc R), or {unset}")
    if shard and shards < 2:
        raise ConfigError(f"fault.mode=replicas with {shard} shards each replica group's state over "
                          f"its data-parallel ranks, and a group here has one (its {model_par} ranks are "
                          f"tp={p.tp} x pp={p.pp}): give each group {2 * model_par} ranks or more (plait run "
                          f"--replicas G --nproc {2 * model_par}), or set {unset}")
    if p.dp_shard and ranks % p.dp_shard:
        least = model_par * p.ep
        where = "ranks" if least == 1 else f"data-parallel ranks per ep rank ({ranks * least} / tp x pp x cp x ep)"
        raise ConfigError(f"parallel.dp_shard={p.dp_shard} must divide the {ranks} {where} of a replica group "
                          f"(HSDP inside each group); use dp_shard in "
                          f"{[n for n in range(2, ranks + 1) if ranks % n == 0]}, or 0 (FSDP over the group)")
    if f.min_replicas < 1 or f.min_replicas > groups:
        raise ConfigError(f"fault.min_replicas must lie in 1..{groups} (the replica groups); got {f.min_replicas}")
    require_torchft()


def smallest_group(p: ParallelConfig) -> int:
    """The ranks of the smallest replica group ``p`` allows: one model replica (tp x pp x cp ranks) on each of ep
    data-parallel ranks (expert parallelism spreads the experts over data-parallel ranks)."""
    return p.tp * p.pp * p.cp * p.ep


def replica_degrees(cfg: Config, world_size: int) -> dict[str, int]:
    """``dp_replicate``: the replica groups, ``dp_shard``: the data-parallel ranks of one group per expert-parallel
    rank (whatever its data-parallel layout inside), ``ep``, ``cp``, ``tp`` and ``pp``: the group's, so that ``dp``
    (``dp_replicate x dp_shard x ep``) counts every data-parallel rank of every group. In a worker ``world_size`` is
    its group's ranks and the launcher's environment names the groups; a launcher checking the config passes every
    rank of the run."""
    p = cfg.parallel
    found = replica_group()
    if found is not None:
        groups = found[1]
        if p.dp_replicate and p.dp_replicate != groups:
            raise ConfigError(f"parallel.dp_replicate={p.dp_replicate} but the launcher started {groups} replica "
                              "groups: leave it 0 under plait run --replicas, or start as many groups")
        ranks = world_size
    else:
        groups = p.dp_replicate or default_groups(world_size, smallest_group(p))
        if world_size % groups:
            raise ConfigError(f"parallel.dp_replicate={groups} replica groups must divide the {world_size} ranks "
                              f"(parallel.nproc); use dp_replicate in "
                              f"{[n for n in range(1, world_size + 1) if world_size % n == 0]}")
        ranks = world_size // groups
    least = smallest_group(p)
    if ranks % least:
        raise ConfigError(f"a replica group of {ranks} ranks does not divide by parallel.tp={p.tp} x "
                          f"parallel.pp={p.pp} x parallel.cp={p.cp} x parallel.ep={p.ep} = {least} (tensor, "
                          f"pipeline, context and expert parallelism run inside each group; expert-parallel ranks "
                          f"are data-parallel ranks): give each group a multiple of {least} ranks (plait run "
                          f"--replicas G --nproc {least}; plait train: parallel.nproc = dp_replicate x {least} x k)")
    return {"pp": p.pp, "dp_replicate": groups, "dp_shard": ranks // least, "ep": p.ep, "cp": p.cp, "tp": p.tp}


def replica_topology(cfg: Config, device: torch.device) -> Topology:
    """This rank's topology: its group's own world and mesh, its place among the groups for the data."""
    found = replica_group()
    if found is None:
        raise ConfigError("fault.mode=replicas runs each replica group as its own job: start the script with "
                          "plait run --replicas N SCRIPT (or plait train), which also starts a torchft "
                          "Lighthouse")
    group = build_topology(group_config(cfg), device)  # the group's own world: its ranks, its mesh
    return ReplicaTopology(degrees=group.degrees, rank=group.rank, world_size=group.world_size, device=device,
                           mesh=group.mesh, group_index=found[0], num_groups=found[1])
