"""DiLoCo / local SGD (``parallel.sync = "diloco"``): data-parallel replicas that communicate once every H steps.

A replica is one model on the ranks of one ``dp_replicate`` coordinate of the mesh: everything else (the data-parallel
ranks of ``parallel.dp_shard`` x ``ep`` x ``cp``, tensor and pipeline parallelism) is inside it, and the layout inside
runs as it would alone (``replica_inside``: the topology within ``dp_replicate``): its gradient-sync policy (plait's
reducer, ZeRO-1/2, FSDP2) averages the gradients over the replica's own data-parallel ranks at every step, its
experts' gradients over the replica's ranks holding the same experts. Under DiLoCo ``parallel.dp_shard`` = N is the
data-parallel ranks of one replica for every ZeRO stage (0: one); the replicas are the other ``dp / (ep x N)``: HSDP's
replicate axis, synchronised every H steps instead of every step. Each replica trains with its own optimizer (the
user's, the *inner* optimizer) on its own share of every global batch for ``parallel.diloco_inner_steps`` (H)
optimizer steps, with no communication between the replicas. Then they synchronise: each rank computes its
pseudo-gradient, the start weights of the period minus its weights now, on what it holds (its LOCAL part of each
parameter: a DTensor's shard under FSDP2 or tensor parallelism, ZeRO-1/2's whole parameters, its pipeline stage's,
its experts); one all-reduce over the ``dp_replicate`` group averages it (rank k of every replica holds the same
part); the *outer* optimizer, Nesterov SGD with DiLoCo's settings (learning rate ``diloco_outer_lr`` = 0.7, momentum
``diloco_outer_momentum`` = 0.9; torch's ``SGD`` formula, dampening 0), applies it to the start weights, and every
replica continues from the result: after a synchronisation all replicas hold bit-identical weights. BatchNorm running
statistics are averaged in the same all-reduce. The start weights and the outer momentum are float32, one value per
local element (two copies of this rank's part of the model).

Streaming DiLoCo (``parallel.diloco_fragments`` = F > 1): the trainable parameters are split into F consecutive
fragments of about equal size (``split_fragments``); fragment f synchronises at step (f + 1) x H / F of every period,
as above but on its own values (its start weights, its outer momentum): each synchronisation sends 1/F of the
weights, the bytes per period stay the same. The all-reduce is not overlapped with the following inner steps.

Communication: one all-reduce of this rank's part of every trainable parameter, in float32, every H steps, through
plait's ``Comm`` (so ``comm.allreduce`` chooses its algorithm and ``StepInfo.comm_bytes`` counts it at the step it
happens); between the replicas nothing on the other steps (inside a replica, its layout's own). Per-step data
parallelism all-reduces the same number of gradient values at every step: DiLoCo puts 1/H of its bytes on the wire.
Under ZeRO-1/2 every rank of a replica holds the whole model, so each sends all of it (N-fold the bytes of one copy
over N ranks per replica). With ``comm.compress`` (a named compressor, not ``auto``) the pseudo-gradient's mean goes
through that compressor instead, with its error feedback (kept in checkpoints as for gradient buckets).

torchft replica groups (``fault.mode = "replicas"``): each group is one replica (its layout inside as that mode
builds it, synchronised at every step inside the group); the outer all-reduce goes over torchft's live groups through
the ``Replicas`` driver (``ReplicaMean``: the mean over the groups in the quorum, in float32 (``comm.compress`` then
compresses the group's per-step all-reduce inside it), then the group's agreement that it
arrived: a synchronisation that failed is dropped, every rank back at its start weights), torchft's per-step gradient
average is off, and a heal carries the start weights (the model's entries are them), the outer momentum and the place
in the period (``Healing``).

With H = 1, an outer learning rate of 1 and no outer momentum, a synchronisation averages the replicas' weights
after one step. For an inner update that is linear in the gradient (SGD, with or without momentum or weight
decay) that is data parallelism's update, up to float rounding; Adam's is not linear, so DiLoCo with AdamW
differs from data parallelism with AdamW even at H = 1 (each replica normalises its own gradient).

The inner optimizer's state stays each replica's own (DiLoCo's choice). Checkpoints (their entries in the one format:
the start weights in the form the layout gives each entry, a DTensor over this rank's start weights where the entry is
one), exports, ``full_state_dict`` and evaluations (``Plait.evaluation``: the trainer scores its held-out set inside
it) hold the weights every replica agrees on, those of the last synchronisation, with the outer momentum: a resume,
or a rollback, starts a new inner period from them (the inner steps since that synchronisation are trained again from
fresh data), and every replica takes the inner optimizer state of one replica. Use a ``checkpoint.every`` and a
``train.steps`` that are multiples of H to lose nothing.

DiLoCo is a driver (``plait.parallel.capabilities.Driver``): it wraps the step of the layout inside each replica from
outside, after the optimizer step. A parameter server and PyTorch DDP are refused with a message (see
``check_diloco``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from plait.config import Config, ConfigError, ParallelConfig
from plait.fault.replicas import replica_group
from plait.parallel.capabilities import Driver, ReplicaMean
from plait.parallel.grad_sync import LayoutError, reduce_in_place
from plait.parallel.layout import Layout
from plait.parallel.units import batchnorm_buffers
from plait.topology import MeshAxis, Topology

OUTER = MeshAxis.DP_REPLICATE  # the mesh axis whose coordinates are DiLoCo's replicas


def _check_settings(p: ParallelConfig) -> None:
    if p.diloco_inner_steps < 1:
        raise ConfigError(f"parallel.diloco_inner_steps must be at least 1 (optimizer steps between two "
                          f"synchronisations); got {p.diloco_inner_steps}")
    if not p.diloco_outer_lr > 0:
        raise ConfigError(f"parallel.diloco_outer_lr must be above 0 (DiLoCo's is 0.7; 1.0 with momentum 0 averages "
                          f"the replicas); got {p.diloco_outer_lr}")
    if not 0 <= p.diloco_outer_momentum < 1:
        raise ConfigError(f"parallel.diloco_outer_momentum must be in [0, 1) (DiLoCo's is 0.9); got "
                          f"{p.diloco_outer_momentum}")
    if not 1 <= p.diloco_fragments <= p.diloco_inner_steps:
        raise ConfigError(f"parallel.diloco_fragments must lie in 1..diloco_inner_steps ({p.diloco_inner_steps}): each "
                          f"fragment synchronises at its own step of the period; got {p.diloco_fragments}")
    if p.diloco_nesterov and p.diloco_outer_momentum == 0:
        raise ConfigError("parallel.diloco_nesterov needs a momentum: set parallel.diloco_outer_momentum above 0 "
                          "(DiLoCo's 0.9), or parallel.diloco_nesterov=false for plain averaging")


def _check_layout(cfg: Config, degrees: dict[str, int]) -> None:
    p, c = cfg.parallel, cfg.comm
    if p.mode == "ps":
        raise ConfigError("parallel.sync=diloco synchronises collective data-parallel replicas; a parameter server "
                          "(parallel.mode=ps) has its own consistency (ps.mode): set parallel.sync=every_step")
    if p.impl == "torch":
        raise ConfigError("parallel.impl=torch selects PyTorch DDP's per-step gradient all-reduce; parallel.sync="
                          "diloco does not reduce gradients: set parallel.impl=plait")
    if p.sync_batchnorm:
        raise ConfigError("parallel.sync_batchnorm communicates at every forward; with parallel.sync=diloco "
                          "BatchNorm statistics are averaged at each synchronisation: set it false")
    if c.compress == "auto":
        raise ConfigError("comm.compress=auto decides from the exposed communication of per-step all-reduces; with "
                          "parallel.sync=diloco name a compressor for the pseudo-gradient (int8, powersgd...) or none")
    if cfg.fault.rebalance:
        raise ConfigError("fault.rebalance weights the gradients of a per-step all-reduce; with parallel.sync="
                          "diloco each replica steps on its own gradients: set fault.rebalance=false")


def split_fragments(sizes: list[int], num: int) -> list[tuple[int, int, int, int]]:
    """Parameters of ``sizes`` (in order) split into ``num`` consecutive fragments of about equal size: parameter i
    goes to fragment ``min(num - 1, num x (values before it) // total)``. Returns per fragment (first parameter, end
    parameter, first value, end value); a fragment may be empty when one parameter outweighs the others."""
    total = sum(sizes)
    owner, before = [], 0
    for n in sizes:
        owner.append(min(num - 1, num * before // max(total, 1)))
        before += n
    out, offsets = [], [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    for f in range(num):
        members = [i for i, o in enumerate(owner) if o == f]
        first = members[0] if members else (out[-1][1] if out else 0)
        end = members[-1] + 1 if members else first
        out.append((first, end, offsets[first], offsets[end]))
    return out


def check_diloco(cfg: Config, degrees: dict[str, int]) -> None:
    """DiLoCo's settings, and the layouts its replicas cannot take."""
    if cfg.parallel.sync != "diloco":
        return
    _check_settings(cfg.parallel)
    _check_layout(cfg, degrees)


# -- what a replica holds -----------------------------------------------------------------------------
def _outside(cfg: Config) -> bool:
    """Whether DiLoCo's replicas are the mesh's ``dp_replicate`` axis (not torchft's groups, each its own world)."""
    return cfg.parallel.sync == "diloco" and cfg.fault.mode != "replicas"


def replica_degrees_inside(cfg: Config, degrees: dict[str, int]) -> dict[str, int]:
    """The degrees the layout inside one replica is checked with (one replica: ``dp_replicate`` = 1 under DiLoCo;
    ``degrees`` as they are otherwise)."""
    return {**degrees, str(OUTER): 1} if cfg.parallel.sync == "diloco" else degrees


def replica_inside(cfg: Config, topo: Topology) -> Topology:
    """The topology the layout inside one replica is built on: ``topo`` within its ``dp_replicate`` axis under
    DiLoCo (a torchft group's topology is its own world already: each group is a replica); ``topo`` otherwise."""
    return topo.within(OUTER) if _outside(cfg) else topo


def diloco_replicas(cfg: Config, topo: Topology) -> tuple[Any, int]:
    """(the process group the outer all-reduce runs over, the replicas): the ``dp_replicate`` axis of ``topo`` (the
    whole run's); under torchft replica groups no group (the ``Replicas`` driver averages over the live groups)."""
    if not _outside(cfg):
        found = replica_group()
        return None, found[1] if found is not None else 1
    n = topo.degree(OUTER)
    return (topo.group(OUTER) if n > 1 else None), n


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard (a view: writing it writes the DTensor), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def _like(entry: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's part of a tensor shaped like ``entry``'s part) in ``entry``'s form: a DTensor laid out
    as ``entry`` where it is one (so a checkpoint reshards it), ``local`` itself otherwise."""
    if not isinstance(entry, DTensor):
        return local
    return DTensor.from_local(local, entry.device_mesh, entry.placements, run_check=False, shape=entry.shape,
                              stride=entry.stride())


class DiLoCo(Driver):
    """DiLoCo around the layout inside each replica (see the module docstring): ``group`` holds the ``replicas`` that
    synchronise every H steps (None with one replica, or under torchft replica groups, whose ``Replicas`` driver
    averages)."""

    def __init__(self, cfg: Config, comm: Any, group: Any, replicas: int) -> None:
        p = cfg.parallel
        self.comm, self.group, self.replicas = comm, group, replicas
        self.sync_batchnorm = p.sync_batchnorm
        self.inner_steps, self.outer_lr = p.diloco_inner_steps, p.diloco_outer_lr
        self.momentum, self.nesterov = p.diloco_outer_momentum, p.diloco_nesterov
        self.num_fragments = p.diloco_fragments
        self.since_start = 0  # inner steps since the run (or the last load) began
        self.syncs = 0
        self._synced: list[int] = []  # the fragments synchronised at the step just taken
        self._fragments: list[tuple[int, int, int, int]] = []  # (first param, end param, first value, end value)
        # comm.compress: the pseudo-gradient's all-reduce through plait's compressor (error feedback kept in the
        # checkpoint's per-rank state, as for gradient buckets)
        self.compressor = comm.make_compressor() if replicas > 1 else None
        self.outer: ReplicaMean | None = None  # torchft's live groups, where they are the replicas
        self._anchor: torch.Tensor | None = None  # (P,) float32: this rank's part of the weights at the period's start
        self._momentum: torch.Tensor | None = None  # (P,) float32: the outer optimizer's momentum buffer
        self._params: list[nn.Parameter] = []
        self._bn: list[torch.Tensor] = []

    # -- building ------------------------------------------------------------------------------------
    def begin(self, layout: Layout, run: Any) -> None:
        """The start weights of the first period, taken at the end of setup (after the weights were broadcast,
        loaded or initialised)."""
        self.outer = next((d for d in layout.drivers if isinstance(d, ReplicaMean)), None)
        self._params = layout.trainable()
        self._bn = batchnorm_buffers(layout.model) if self.replicas > 1 and not self.sync_batchnorm else []
        wrong = sorted({str(q.dtype) for q in self._locals if q.dtype != torch.float32})
        if wrong:
            raise LayoutError(f"parallel.sync=diloco keeps its outer state in float32 like the model's weights; this "
                              f"model has {', '.join(wrong)} parameters: keep the weights in float32 and choose the "
                              "compute precision with train.precision")
        self._anchor = torch.cat([q.detach().reshape(-1) for q in self._locals]).float()
        self._momentum = torch.zeros_like(self._anchor)  # torch's first SGD step (buffer = gradient) is 0 * m + g
        self._fragments = split_fragments([q.numel() for q in self._locals], self.num_fragments)

    @property
    def _locals(self) -> list[torch.Tensor]:
        """This rank's part of each trainable parameter (views: writing them writes it), asked each time: FSDP2 may
        give a parameter new local storage after setup."""
        return [_local(q) for q in self._params]

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` cut into tensors shaped like this rank's part of each trainable parameter, in their order."""
        out, offset = [], 0
        for q in self._locals:
            out.append(flat[offset:offset + q.numel()].view_as(q))
            offset += q.numel()
        return out

    @torch.no_grad()
    def _restart(self, first: int = 0, end: int | None = None) -> None:
        """The parameters ``first:end`` (all by default) back at their start weights."""
        for q, start in zip(self._locals[first:end], self._views(self._anchor)[first:end], strict=True):
            q.copy_(start)

    # -- the step ------------------------------------------------------------------------------------
    def after_step(self, layout: Layout) -> None:
        """At fragment f's step of each period of H steps, (f + 1) x H / fragments (every H-th step with one
        fragment): its synchronisation. Communication: one all-reduce of this rank's part of that fragment's
        pseudo-gradient (float32), with BatchNorm's running statistics at the period's last; none on other steps."""
        self.since_start += 1
        h, n = self.inner_steps, self.num_fragments
        self._synced = [f for f in range(n) if self.since_start % h == (f + 1) * h // n % h
                        and self._fragments[f][2] < self._fragments[f][3]]  # an empty fragment has nothing to send
        for f in self._synced:
            self.synchronise(f)

    @torch.no_grad()
    def synchronise(self, fragment: int = 0) -> None:
        """The outer step of one fragment (see the module docstring): every replica's weights of that fragment
        become its updated start weights (its start weights as they were, where torchft's groups did not agree that
        the mean arrived)."""
        first, end, lo, hi = self._fragments[fragment]
        anchor, momentum = self._anchor[lo:hi], self._momentum[lo:hi]
        delta = torch.cat([q.detach().reshape(-1) for q in self._locals[first:end]]).float()  # (P_f,) the weights now
        torch.sub(anchor, delta, out=delta)  # the pseudo-gradient: start minus now
        bn = self._bn if fragment == self.num_fragments - 1 else []  # once per period
        if not self._mean(delta, bn, fragment):
            self._restart(first, end)
            return
        update = delta
        if self.momentum > 0:  # torch.optim.SGD with dampening 0
            momentum.mul_(self.momentum).add_(delta)
            update = delta.add_(momentum, alpha=self.momentum) if self.nesterov else momentum
        anchor.add_(update, alpha=-self.outer_lr)
        self._restart(first, end)
        self.syncs += 1

    def _mean(self, delta: torch.Tensor, bn: list[torch.Tensor], fragment: int) -> bool:
        """``delta`` (and the BatchNorm statistics ``bn``) replaced by their mean over the replicas; False where
        torchft's groups did not agree that it arrived (nothing is then to be applied)."""
        if self.outer is not None:  # torchft's live groups: one all-reduce of both, then the group's agreement
            flat = torch.cat([delta, *(t.reshape(-1).float() for t in bn)])
            if not self.outer.replica_mean(flat):
                return False
            _unflatten(flat, [delta, *bn])
            return True
        if self.compressor is not None:  # the compressed mean, identical on every replica
            name = f"diloco pseudo-gradient ({self.compressor.name})"
            work = self.comm.run_async(name, self.group, lambda: self._compressed_mean(delta, fragment))
            self.comm.wait(work)
            if bn:
                reduce_in_place(bn, self.comm, self.group, self.replicas, "batchnorm statistics")
        elif self.replicas > 1:
            flat = torch.cat([delta, *(t.reshape(-1).float() for t in bn)]) if bn else delta
            self.comm.all_reduce_sum(flat, self.group, name="diloco pseudo-gradient")
            flat /= self.replicas
            if bn:
                _unflatten(flat, [delta, *bn])
        return True

    def _compressed_mean(self, delta: torch.Tensor, fragment: int) -> int:
        """On the comm thread: ``delta`` replaced by its compressed mean over the replicas; returns wire bytes."""
        before = self.compressor.wire_bytes
        first, end, _, _ = self._fragments[fragment]
        shapes = [q.shape for q in self._locals[first:end]]  # PowerSGD approximates each matrix on its own
        delta.copy_(self.compressor.allreduce_mean(fragment, delta, self.group, shapes=shapes))
        return self.compressor.wire_bytes - before

    @contextlib.contextmanager
    def evaluation(self, layout: Layout) -> Iterator[None]:
        """The synchronised weights (the start weights of the period: what checkpoints and exports hold) in the model
        while an evaluation (or a gathering of the whole model) runs, this replica's own put back after it: between
        synchronisations each replica's weights differ, and the ranks would score different models, none of them the
        one that is saved. Right after a synchronisation of the whole model they are the same values and nothing is
        copied. No communication; two copies of this rank's part of the trainable weights, none on a training step."""
        if self._anchor is None or (self.num_fragments == 1 and self.since_start % self.inner_steps == 0):
            yield
            return
        locals_ = self._locals
        own = [q.detach().clone() for q in locals_]
        self._restart()
        try:
            yield
        finally:
            with torch.no_grad():
                for q, mine in zip(locals_, own, strict=True):
                    q.copy_(mine)

    def step_metrics(self) -> dict[str, Any]:
        return {"diloco_synced": bool(self._synced), "diloco_fragments_synced": len(self._synced)}

    def describe(self, inner: str) -> str:
        if self.replicas <= 1:
            return inner
        return f"DiLoCo (H={self.inner_steps})" + (f" over {inner}" if inner else "")

    # -- state: the weights every replica agrees on ---------------------------------------------------
    def _formed(self, sd: dict[str, Any], flat: torch.Tensor) -> dict[str, Any]:
        """The entries of ``sd`` that hold a trainable parameter's storage (matched by this rank's part of each), each
        replaced by the same part of ``flat`` (the start weights, or the outer momentum) in the entry's form."""
        views = {(q.data_ptr(), q.numel()): v for q, v in zip(self._locals, self._views(flat), strict=True)
                 if q.numel()}
        out = {}
        for k, v in sd.items():
            if isinstance(v, torch.Tensor) and (key := (_local(v).data_ptr(), _local(v).numel())) in views:
                out[k] = _like(v, views[key].view_as(_local(v)))
        return out

    def entries(self, layout: Layout, sd: dict[str, Any]) -> dict[str, Any]:
        """``sd`` (a model state dict) with every trainable parameter's entry replaced by its start weights (views
        of the start weights, DTensors over them where the entry is one: loading into them loads the start
        weights)."""
        if self._anchor is None:  # before the optimizer: no period has begun
            return sd
        return {**sd, **self._formed(sd, self._anchor)}

    def state(self, layout: Layout, model_sd: dict, optim_sd: dict) -> tuple[dict, dict]:
        """The start weights in the model's entries; the outer momentum beside the optimizer's states, under the
        parameters' single-process names, each in the form of its model entry (a DTensor where that is one)."""
        names = {id(q): n for n, q in layout.named_parameters()}
        momentum: dict[str, torch.Tensor] = {}
        for q, mine, view in zip(self._params, self._locals, self._views(self._momentum), strict=True):
            name = names[id(q)]
            entry = model_sd.get(name)
            if name not in momentum:  # a tied copy's under the name of the parameter it copies: the same values
                held = isinstance(entry, torch.Tensor) and _local(entry).data_ptr() == mine.data_ptr()
                momentum[name] = _like(entry, view) if held else _like(q, view)  # an expert's entry is a DTensor
        return self.entries(layout, model_sd), {**optim_sd, "diloco_outer_momentum": momentum}

    def load(self, layout: Layout, model_sd: dict, optim_sd: dict) -> tuple[dict, dict]:
        """The checkpoint's start weights were read into ours (and load into the model next); a new period
        starts."""
        self.since_start = 0
        return model_sd, {k: v for k, v in optim_sd.items() if k != "diloco_outer_momentum"}

    # -- a torchft heal ------------------------------------------------------------------------------
    def heal_state(self) -> dict[str, Any]:
        """What a replica group's heal carries beside the model's entries (this rank's start weights, through
        ``entries``): the outer momentum and the place in the period."""
        return {"momentum": self._momentum.clone(), "since_start": self.since_start, "syncs": self.syncs}

    def heal(self, state: dict[str, Any] | None) -> None:
        """After the start weights were written from outside (a heal from a live group's ``heal_state``, or the
        group's agreement on its first weights: None): the model continues from them."""
        if state is not None:
            self._momentum.copy_(state["momentum"])
            self.since_start, self.syncs = state["since_start"], state["syncs"]
        self._restart()


def _unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """``flat`` written back into ``tensors`` (in order, each its numel)."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
