"""The one object that knows the device mesh.

Axis order is fixed, outermost first: ``pp, dp_replicate, dp_shard, ep, cp, tp`` (tensor parallel
innermost, so its groups are the closest ranks, which share a node whenever they can; context parallel next,
its ring or all-to-all the next busiest traffic). The
topology is built once from the config, validated against the world size, and passed down
explicitly; nothing reads a global process group deep inside a layer.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from plait.config import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from plait.config import Config


class MeshAxis(enum.StrEnum):
    PP = "pp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    EP = "ep"
    CP = "cp"
    TP = "tp"


AXIS_ORDER: tuple[MeshAxis, ...] = tuple(MeshAxis)


def resolve_degrees(cfg: Config, world_size: int) -> dict[str, int]:
    """Degrees per axis for ``world_size`` ranks; infers dp when it is 0; raises a readable error.

    Expert parallelism is folded into data parallelism: the data-parallel degree ``dp`` counts the
    expert-parallel ranks (each processes its own micro-batches), split on the mesh as
    ``dp_replicate = dp / ep`` (ranks holding the same experts) times ``ep``. Hybrid sharding
    (``parallel.dp_shard = N``) splits that axis again: ``dp_replicate = dp / (ep x N)`` times ``dp_shard = N``
    (N must divide ``dp / ep``); with 0 it stays whole (``dp_shard = 1`` on the mesh)."""
    p = cfg.parallel
    for name in ("tp", "pp", "ep", "cp"):
        if getattr(p, name) < 1:
            raise ConfigError(f"parallel.{name} must be at least 1; got {getattr(p, name)}")
    if p.dp < 0:
        raise ConfigError(f"parallel.dp must be at least 1 (or 0 to infer it); got {p.dp}")
    model_par = p.tp * p.pp * p.cp
    dp = p.dp
    if dp == 0:
        if world_size % model_par:
            raise ConfigError(
                f"world size {world_size} does not divide by tp x pp{' x cp' if p.cp > 1 else ''} = {model_par}; "
                f"use a world size that is a multiple of {model_par} (parallel.nproc) or change the degrees"
            )
        dp = world_size // model_par
    if dp % p.ep:
        fits = [e for e in range(1, dp + 1) if dp % e == 0]
        raise ConfigError(
            f"parallel.ep={p.ep} does not divide the data-parallel degree {dp} (expert-parallel ranks are "
            f"data-parallel ranks): use ep in {fits}, or a world size of a multiple of {p.ep * model_par}"
        )
    shard = p.dp_shard or 1
    if (dp // p.ep) % shard:
        fits = [n for n in range(1, dp // p.ep + 1) if (dp // p.ep) % n == 0]
        raise ConfigError(
            f"parallel.dp_shard={p.dp_shard} does not divide the {dp // p.ep} data-parallel ranks per expert "
            f"group (dp={dp} / ep={p.ep}): each shard group is dp_shard ranks, replicated dp / (ep x dp_shard) "
            f"times; use dp_shard in {fits}, or 0 to shard over every data-parallel rank"
        )
    degrees = {"pp": p.pp, "dp_replicate": dp // (p.ep * shard), "dp_shard": shard, "ep": p.ep, "cp": p.cp,
               "tp": p.tp}
    product = math.prod(degrees.values())
    if product != world_size:
        raise ConfigError(
            f"parallel degrees dp={dp} x tp={p.tp} x pp={p.pp}{f' x cp={p.cp}' if p.cp > 1 else ''} = {product} "
            "do not match "
            f"the world size {world_size}; set parallel.nproc={product}, or set parallel.dp=0 to infer "
            f"dp from the world size"
        )
    return degrees


# Named flattened axes (torchtitan's ParallelDims): the mesh axes each spans, in mesh order.
FLATTENED: dict[str, tuple[str, ...]] = {
    # the ranks that read different batches: expert-parallel ranks are data-parallel ranks
    "dp": ("dp_replicate", "dp_shard", "ep"),
    # the ranks whose gradients are averaged: the cp ranks hold different tokens of the same sequences
    "dp_cp": ("dp_replicate", "dp_shard", "ep", "cp"),
    # the ranks one shard group of hybrid sharding spans (its shards of dense parameters)
    "dp_shard_cp": ("dp_shard", "ep", "cp"),
    # the ranks holding the same experts (expert gradients are summed over them)
    "edp": ("dp_replicate", "dp_shard", "cp"),
}


@dataclass
class Topology:
    """Mesh degrees, this rank's coordinates, and the device mesh with its per-axis groups. ``degree``, ``coord``
    and ``group`` take a mesh axis or a named flattened one (``FLATTENED``: ``dp``, ``dp_cp``, ``dp_shard_cp``,
    ``edp``). ``outside``: mesh axes whose ranks train apart (``within``): the flattened axes leave them out."""

    degrees: dict[str, int]
    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh | None = None
    _groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)
    outside: tuple[str, ...] = ()

    def _axes(self, name: MeshAxis | str) -> tuple[str, ...]:
        """The mesh axes ``name`` spans (itself, or a flattened name's less the axes ``outside``)."""
        if str(name) not in FLATTENED:
            return (str(name),)
        return tuple(a for a in FLATTENED[str(name)] if a not in self.outside)

    def within(self, *outside: MeshAxis | str) -> Topology:
        """This topology as seen inside one replica along the ``outside`` axes (DiLoCo's ``dp_replicate``: replicas
        that train apart and meet every H steps): the same ranks, mesh and groups, but the flattened axes (``dp``,
        ``dp_cp``, ``dp_shard_cp``, ``edp``) span only the replica's ranks, so a gradient-sync policy, the experts'
        sync and every degree read from them stay inside it."""
        return dataclasses.replace(self, outside=tuple(str(a) for a in outside))

    @property
    def dp(self) -> int:
        """Data-parallel degree: the ranks that process different micro-batches (expert-parallel included)."""
        return self.degree("dp")

    @property
    def ep(self) -> int:
        return self.degrees["ep"]

    def degree(self, axis: MeshAxis | str) -> int:
        """The ranks along ``axis`` (a flattened one's: the product); an axis a topology does not name (a parameter
        server's cp) is 1."""
        return math.prod(self.degrees.get(a, 1) for a in self._axes(axis))

    def coord(self, axis: MeshAxis | str) -> int:
        """This rank's index along ``axis`` (row-major over AXIS_ORDER; a flattened axis: row-major over its
        axes)."""
        out = 0
        for name in self._axes(axis):
            out = out * self.degrees.get(name, 1) + self._coord(name)
        return out

    def _coord(self, axis: str) -> int:
        stride = 1
        for a in reversed(AXIS_ORDER):
            if a == axis:
                return (self.rank // stride) % self.degree(a)
            stride *= self.degree(a)
        return 0  # an axis this topology does not lay out (a parameter server's cp)

    def live(self, axis: MeshAxis | str) -> tuple[str, ...]:
        """The mesh axes of ``axis`` with more than one rank (the ones a collective over it spans)."""
        return tuple(a for a in self._axes(axis) if self.degrees.get(a, 1) > 1)

    @property
    def train_group(self) -> dist.ProcessGroup | None:
        """The ranks that run the training loop, for the engine's own collectives (None: the whole world;
        a parameter server's topology names its workers)."""
        return None

    @property
    def dp_rank(self) -> int:
        return self.coord("dp")

    def group(self, *axes: MeshAxis | str) -> dist.ProcessGroup | None:
        """Process group spanning ``axes`` (mesh axes or flattened names; None when there is no process group:
        one process). Axes of one rank add nothing; with none left it is the first axis's group (this rank alone)."""
        every = [a for axis in axes for a in self._axes(axis)]
        names = [a for a in every if self.degrees.get(a, 1) > 1] or every[:1]
        key = "+".join(names)
        if key in self._groups:
            return self._groups[key]
        if self.mesh is None:
            return None
        sub = self.mesh[tuple(names)] if len(names) > 1 else self.mesh[names[0]]
        grp = sub._flatten().get_group() if len(names) > 1 else sub.get_group()
        self._groups[key] = grp
        return grp

    def sub_mesh(self, axis: MeshAxis | str) -> DeviceMesh:
        """The 1-D mesh over ``axis`` (a flattened one's axes flattened)."""
        assert self.mesh is not None
        names = list(self.live(axis)) or [self._axes(axis)[0]]
        return self.mesh[names[0]] if len(names) == 1 else self.mesh[tuple(names)]._flatten()

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The ranks that read different batches (``dp``)."""
        return self.group("dp")

    @property
    def dp_reachable(self) -> int:
        """The data-parallel ranks a collective over ``dp_group`` reaches: every one of ``dp``, except where the
        data-parallel ranks are not one world (``fault.mode=replicas``: each replica group is its own)."""
        return self.dp

    @property
    def hybrid(self) -> bool:
        """Hybrid sharding (HSDP): shard groups of ``dp_shard`` ranks replicated ``dp_replicate`` times (inside
        ``within("dp_replicate")`` there is one replica: not hybrid)."""
        return self.degrees["dp_shard"] > 1 and "dp_replicate" in self.live("dp_cp")

    @property
    def shard_degree(self) -> int:
        """The ranks ZeRO-3 shards a dense parameter over: a shard group (``dp_shard_cp``) under HSDP, else every
        rank gradients are averaged over (``dp_cp``)."""
        return self.degree("dp_shard_cp") if self.hybrid else self.degree("dp_cp")

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 shards dense parameters over: the 1-D ``dp_cp`` mesh, or under hybrid sharding the 2-D
        ``(dp_replicate, dp_shard_cp)`` mesh (replicated along dim 0, sharded along dim 1: HSDP)."""
        assert self.mesh is not None
        if self.hybrid:
            shard = list(self.live("dp_shard_cp"))
            if len(shard) == 1:
                return self.mesh["dp_replicate", shard[0]]
            self.mesh[tuple(shard)]._flatten("dp_shard_cp")  # registered on the root mesh, sliced with its name
            return self.mesh["dp_replicate", "dp_shard_cp"]
        return self.sub_mesh("dp_cp")

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 shards expert weights over, the ranks holding the same experts (``edp``): 1-D, or under
        hybrid sharding 2-D (``dp_replicate``, then the shard group's ``dp_shard`` x ``cp`` ranks), as dense
        parameters are."""
        assert self.mesh is not None
        if not self.hybrid:
            return self.sub_mesh("edp")
        shard = [a for a in ("dp_shard", "cp") if self.degrees[a] > 1]
        if len(shard) == 1:
            return self.mesh["dp_replicate", shard[0]]
        self.mesh[tuple(shard)]._flatten("edp_shard")  # registered on the root mesh, sliced with its name
        return self.mesh["dp_replicate", "edp_shard"]

    @property
    def expert_dp_group(self) -> dist.ProcessGroup | None:
        """Ranks holding the same experts (``dp_cp / ep`` of them): expert gradients reduce over it."""
        return self.group("edp")

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        return self.group(MeshAxis.EP)


def build_topology(cfg: Config, device: torch.device) -> Topology:
    """Build the topology for the current process group (or a single process when none is initialized)."""
    if not (dist.is_available() and dist.is_initialized()):
        degrees = resolve_degrees(cfg, 1)
        return Topology(degrees=degrees, rank=0, world_size=1, device=device)
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    degrees = resolve_degrees(cfg, world)
    names = tuple(str(a) for a in AXIS_ORDER)
    mesh = init_device_mesh(device.type, tuple(degrees[n] for n in names), mesh_dim_names=names)
    return Topology(degrees=degrees, rank=dist.get_rank(), world_size=world, device=device, mesh=mesh)
