"""DiLoCo / local SGD (``parallel.sync = "diloco"``): data-parallel replicas that communicate once every H steps.

Each data-parallel rank is one replica: a whole model with its own optimizer (the user's, the *inner* optimizer).
For ``parallel.diloco_inner_steps`` (H) optimizer steps it trains on its own share of every global batch with
no gradient all-reduce. Then the replicas synchronise: each computes its pseudo-gradient, the start weights of
the period minus its weights now; one all-reduce averages it over the replicas (the mean); the *outer*
optimizer, Nesterov SGD with DiLoCo's settings (learning rate ``diloco_outer_lr`` = 0.7, momentum
``diloco_outer_momentum`` = 0.9; torch's ``SGD`` formula, dampening 0), applies it to the start weights, and
every replica continues from the result: after a synchronisation all replicas hold bit-identical weights.
BatchNorm running statistics are averaged at the same step (one more all-reduce of them).

Streaming DiLoCo (``parallel.diloco_fragments`` = F > 1): the trainable parameters are split into F consecutive
fragments of about equal size (``split_fragments``); fragment f synchronises at step (f + 1) x H / F of every period,
as above but on its own values (its start weights, its outer momentum): each synchronisation sends 1/F of the
weights, the bytes per period stay the same. The all-reduce is not overlapped with the following inner steps.

Communication: one all-reduce of every trainable parameter, in float32, every H steps, through plait's
``Comm`` (so ``comm.allreduce`` chooses its algorithm and ``StepInfo.comm_bytes`` counts it at the step it
happens); nothing on the other steps. Per-step data parallelism all-reduces the same number of gradient values at
every step: DiLoCo puts 1/H of its bytes on the wire. With ``comm.compress`` (a named compressor, not ``auto``) the
pseudo-gradient's mean goes through that compressor instead, with its error feedback (kept in checkpoints as for
gradient buckets).

With H = 1, an outer learning rate of 1 and no outer momentum, a synchronisation averages the replicas' weights
after one step. For an inner update that is linear in the gradient (SGD, with or without momentum or weight
decay) that is data parallelism's update, up to float rounding; Adam's is not linear, so DiLoCo with AdamW
differs from data parallelism with AdamW even at H = 1 (each replica normalises its own gradient).

The inner optimizer's state stays each replica's own (DiLoCo's choice). Checkpoints, exports and evaluations
(``Plait.evaluation``: the trainer scores its held-out set inside it) hold the weights every replica agrees on, those
of the last synchronisation, with the outer momentum: a resume, or a rollback, starts a new inner period from them
(the inner steps since that synchronisation are trained again from fresh data), and every replica takes the inner
optimizer state of the first replica. Use a
``checkpoint.every`` and a ``train.steps`` that are multiples of H to lose nothing.

DiLoCo is a driver (``plait.parallel.layout.Driver``): it wraps the step of the layout inside each replica from
outside, after the optimizer step. A replica is one rank with the whole model here: ZeRO, FSDP, tensor, pipeline and
expert parallelism, a parameter server and PyTorch DDP are refused with a message (see ``check_diloco``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from plait.config import Config, ConfigError, ParallelConfig
from plait.parallel.capabilities import Driver
from plait.parallel.grad_sync import LayoutError, reduce_in_place
from plait.parallel.layout import Layout
from plait.parallel.units import batchnorm_buffers


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
    others = [(f"parallel.zero={p.zero}", p.zero > 0), (f"parallel.tp={p.tp}", p.tp > 1),
              (f"parallel.pp={p.pp}", p.pp > 1), (f"parallel.ep={p.ep}", p.ep > 1),
              (f"parallel.dp_shard={p.dp_shard}", p.dp_shard > 1)]
    refused = [name for name, on in others if on]
    if refused:
        raise ConfigError(f"parallel.sync=diloco trains one whole model per rank (each rank a replica); it does not "
                          f"compose with {', '.join(refused)}: remove it, or set parallel.sync=every_step")
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


class DiLoCo(Driver):
    """DiLoCo over whole-model replicas (see the module docstring): ``group`` holds the ``replicas`` that synchronise
    every H steps."""

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
        self._anchor: torch.Tensor | None = None  # (P,) float32: the weights at the start of the period
        self._momentum: torch.Tensor | None = None  # (P,) float32: the outer optimizer's momentum buffer
        self._params: list[nn.Parameter] = []
        self._bn: list[torch.Tensor] = []

    # -- building ------------------------------------------------------------------------------------
    def begin(self, layout: Layout, run: Any) -> None:
        """The start weights of the first period, taken at the end of setup (after the weights were broadcast,
        loaded or initialised)."""
        self._params = layout.trainable()
        self._bn = batchnorm_buffers(layout.model) if self.replicas > 1 and not self.sync_batchnorm else []
        wrong = sorted({str(q.dtype) for q in self._params if q.dtype != torch.float32})
        if wrong:
            raise LayoutError(f"parallel.sync=diloco keeps its outer state in float32 like the model's weights; this "
                              f"model has {', '.join(wrong)} parameters: keep the weights in float32 and choose the "
                              "compute precision with train.precision")
        self._anchor = torch.cat([q.detach().reshape(-1) for q in self._params]).float()
        self._momentum = torch.zeros_like(self._anchor)  # torch's first SGD step (buffer = gradient) is 0 * m + g
        self._fragments = split_fragments([q.numel() for q in self._params], self.num_fragments)

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` cut into tensors shaped like the trainable parameters, in their order."""
        out, offset = [], 0
        for q in self._params:
            out.append(flat[offset:offset + q.numel()].view_as(q))
            offset += q.numel()
        return out

    # -- the step ------------------------------------------------------------------------------------
    def after_step(self, layout: Layout) -> None:
        """At fragment f's step of each period of H steps, (f + 1) x H / fragments (every H-th step with one
        fragment): its synchronisation. Communication: one all-reduce of that fragment's pseudo-gradient (float32)
        and, with BatchNorm, one of its running statistics; none on other steps."""
        self.since_start += 1
        h, n = self.inner_steps, self.num_fragments
        self._synced = [f for f in range(n) if self.since_start % h == (f + 1) * h // n % h
                        and self._fragments[f][2] < self._fragments[f][3]]  # an empty fragment has nothing to send
        for f in self._synced:
            self.synchronise(f)

    @torch.no_grad()
    def synchronise(self, fragment: int = 0) -> None:
        """The outer step of one fragment (see the module docstring): every replica's weights of that fragment
        become its updated start weights."""
        first, end, lo, hi = self._fragments[fragment]
        params = self._params[first:end]
        anchor, momentum = self._anchor[lo:hi], self._momentum[lo:hi]
        delta = torch.cat([q.detach().reshape(-1) for q in params]).float()  # (P_f,) the weights now
        torch.sub(anchor, delta, out=delta)  # the pseudo-gradient: start minus now
        if self.compressor is not None:  # the compressed mean, identical on every replica
            name = f"diloco pseudo-gradient ({self.compressor.name})"
            work = self.comm.run_async(name, self.group, lambda: self._compressed_mean(delta, fragment))
            self.comm.wait(work)
        elif self.replicas > 1:
            self.comm.all_reduce_sum(delta, self.group, name="diloco pseudo-gradient")
            delta /= self.replicas
        update = delta
        if self.momentum > 0:  # torch.optim.SGD with dampening 0
            momentum.mul_(self.momentum).add_(delta)
            update = delta.add_(momentum, alpha=self.momentum) if self.nesterov else momentum
        anchor.add_(update, alpha=-self.outer_lr)
        for q, start in zip(params, self._views(self._anchor)[first:end], strict=True):
            q.copy_(start)
        if self._bn and fragment == self.num_fragments - 1:  # once per period
            reduce_in_place(self._bn, self.comm, self.group, self.replicas, "batchnorm statistics")
        self.syncs += 1

    def _compressed_mean(self, delta: torch.Tensor, fragment: int) -> int:
        """On the comm thread: ``delta`` replaced by its compressed mean over the replicas; returns wire bytes."""
        before = self.compressor.wire_bytes
        first, end, _, _ = self._fragments[fragment]
        shapes = [q.shape for q in self._params[first:end]]  # PowerSGD approximates each matrix on its own
        delta.copy_(self.compressor.allreduce_mean(fragment, delta, self.group, shapes=shapes))
        return self.compressor.wire_bytes - before

    @contextlib.contextmanager
    def evaluation(self, layout: Layout) -> Iterator[None]:
        """The synchronised weights (the start weights of the period: what checkpoints and exports hold) in the model
        while an evaluation runs, this replica's own put back after it: between synchronisations each replica's
        weights differ, and the ranks would score different models, none of them the one that is saved. Right after
        a synchronisation of the whole model they are the same values and nothing is copied. No communication; two
        copies of the trainable weights at each evaluation, none on a training step."""
        params = self._params
        if self._anchor is None or (self.num_fragments == 1 and self.since_start % self.inner_steps == 0):
            yield
            return
        own = [q.detach().clone() for q in params]
        with torch.no_grad():
            for q, start in zip(params, self._views(self._anchor), strict=True):
                q.copy_(start)
        try:
            yield
        finally:
            with torch.no_grad():
                for q, mine in zip(params, own, strict=True):
                    q.copy_(mine)

    def step_metrics(self) -> dict[str, Any]:
        return {"diloco_synced": bool(self._synced), "diloco_fragments_synced": len(self._synced)}

    def describe(self, inner: str) -> str:
        return f"DiLoCo (H={self.inner_steps})" if self.replicas > 1 else ""

    # -- state: the weights every replica agrees on ---------------------------------------------------
    def entries(self, layout: Layout, sd: dict[str, Any]) -> dict[str, Any]:
        """``sd`` (a model state dict) with every trainable parameter's entry replaced by its start weights (views
        of the start weights: loading into them loads the start weights)."""
        if self._anchor is None:  # before the optimizer: no period has begun
            return sd
        starts = {q.data_ptr(): v for q, v in zip(self._params, self._views(self._anchor), strict=True)}
        return {k: starts.get(v.data_ptr(), v) if isinstance(v, torch.Tensor) else v for k, v in sd.items()}

    def state(self, layout: Layout, model_sd: dict, optim_sd: dict) -> tuple[dict, dict]:
        names = [n for n, _ in layout.named_parameters()]
        momentum = dict(zip(names, self._views(self._momentum), strict=True))
        return self.entries(layout, model_sd), {**optim_sd, "diloco_outer_momentum": momentum}

    def load(self, layout: Layout, model_sd: dict, optim_sd: dict) -> tuple[dict, dict]:
        """The checkpoint's start weights were read into ours (and load into the model next); a new period
        starts."""
        self.since_start = 0
        return model_sd, {k: v for k, v in optim_sd.items() if k != "diloco_outer_momentum"}
