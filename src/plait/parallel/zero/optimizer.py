"""ZeRO stages 1 and 2: plait's sharded optimizer over the data-parallel ranks.

Layout. Trainable parameters are packed, in reverse definition order (roughly the order backward
produces their gradients), into buckets of about ``bucket_mb``; a bucket never mixes param groups, nor
sharding patterns (see tensor parallelism below). Each bucket is one flat buffer padded to a multiple of
the world size, and the model's parameters become views into it (``p.data = flat[a:b].view_as(p)``), so
the all-gather after the step updates the model in place with no copy. Rank ``r`` owns the ``r``-th
1/N of every bucket: every rank owns exactly the same number of elements, and each bucket's
reduce-scatter lands directly in its owner's slot. The inner ``torch.optim`` optimizer is built on the
rank's chunks (one tensor per bucket, one param group per trainer group with its hyperparameters);
elementwise optimizers (AdamW, SGD) then compute exactly what they compute unsharded. The chunk of the
fp32 flat buffer is itself the fp32 master copy; a separate fp32 master is kept only when parameters
are not fp32 or are offloaded.

Gradients. Autograd accumulates each parameter's gradient as usual; a post-accumulate-grad hook adds
it into the bucket's flat gradient buffer and drops ``p.grad``. Stage 1 keeps the full local gradient
buffers and all-reduces them in place when the step (or clipping) asks for gradients; its shard is a
slice of that buffer, so it holds no more gradient memory than an unsharded optimizer. Stage 2
launches each bucket's reduce-scatter from the hooks while backward continues, always in the fixed
bucket order (so every rank issues the same collectives in the same order), and frees the full local
buffer once its reduce-scatter is done (polled from the hooks; when more than ``MAX_FULL_IN_FLIGHT``
launched buckets still hold theirs, backward waits for the oldest), so during backward the full
gradients alive are a few buckets', and only the reduced 1/N shard survives backward. Stage 2's
transient gradient memory thus scales with ``bucket_mb``, not the model: it needs buckets much smaller
than the model. Reduce-scatter rather than all-reduce at stage 2: each rank only needs its own shard,
and it moves half the bytes.

Tensor (and sequence) parallelism. A parameter may be a DTensor (a tensor-parallel shard, or a norm
replicated over tp): ZeRO works on its local tensor, which becomes the view into the flat buffer
(``p._local_tensor``, as FSDP2 does with its shards), so the parameter stays the DTensor the tp plan's
forward needs and the all-gather still updates it in place. A gradient with other placements than its
parameter (a replicated norm's ``Partial`` gradient under sequence parallelism) is redistributed like the
parameter before it enters the bucket (``plait.parallel.data.reducer.local_grad``: an all-reduce over tp,
the gradient's own); a ``Partial`` one stays in ``.grad`` through the accumulation micro-steps (autograd
sums it there), so it is summed over tp once per optimizer step. The ZeRO group then holds ranks of one tp
coordinate, whose local shards have the same shapes. The global norm sums each bucket's squares over the
ZeRO group and, for a bucket of tp shards, over tp too (a bucket of tp-replicated or plain parameters
counts once): a bucket holds one sharding pattern (``Bucket.shard_groups``, ``plait.parallel.zero.buckets``),
so its squares have one set of groups. Checkpoint states of a DTensor parameter are DTensors of its global
tensor (``plait.parallel.zero.state``).

Communication layer. ``use_comm(comm)`` routes every collective through plait's ``Comm`` (counted
in ``comm_bytes``, guarded by the hang timeout). With compression on, a bucket is reduced with the
compressor's ``allreduce_mean`` over the whole bucket, and this rank keeps its 1/N slice: the
compressors have no reduce-scatter form (PowerSGD's factors and the quantized or sparse payloads
describe the whole bucket), so a compressed bucket costs a full compressed all-reduce where the
uncompressed path pays a reduce-scatter, and the decompression work is done for the whole bucket
on every rank. That pays only where the compressed all-reduce is smaller than the reduce-scatter's
``(n-1)/n`` of the fp32 bucket: PowerSGD (``~8 r / sqrt(N)`` of it), int8/int4 and sparse
compressors on few ranks (their all-gathers grow with ``n - 1``); fp16/bf16 do not pay here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.comm.collectives import Comm, all_gather_flat, ring_allreduce_bytes, ring_half_bytes
from plait.parallel.data.reducer import local_grad
from plait.parallel.zero.buckets import Bucket, build_buckets, normalize_groups, param_fqns, partial_grad
from plait.parallel.zero.state import gather_state_dict, scatter_state_dict
from plait.plan.buckets import MAX_FULL_IN_FLIGHT

OFFLOAD_CHOICES = ("none", "optimizer", "params")
# Stage 2: launched buckets that may still hold their full local gradient during backward (those whose
# reduce-scatter is in flight); more and backward waits for the oldest. 1 is double buffering: one
# bucket reducing while the next fills, so a bucket's communication still overlaps the next one's compute.

# torch 2.13 renamed the flat-tensor collectives; older releases (pyproject allows >= 2.4) lack the new names.
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class ZeroConfigError(ValueError):
    """An impossible ZeRO/offload combination; the message says what to change."""


def validate_zero(stage: int, dp: int, offload: str, device_type: str) -> None:
    """Reject impossible ``parallel.zero`` / ``parallel.offload`` choices with one clear message.

    Contract: ``stage`` in 0..3; stages >= 1 shard over the data-parallel ranks so they need dp >= 2,
    except ZeRO-3 with ``offload="params"``, which on one rank keeps the model's states in host memory and
    only the units in use on the device (one GPU training a model larger than its memory);
    ``offload="optimizer"`` belongs to stages 1-2 and ``"params"`` to stage 3; any offload needs
    parameters on an accelerator, because offload moves state from accelerator memory to CPU memory
    and on a CPU device the state already lives there.
    """
    if stage not in (0, 1, 2, 3):
        raise ZeroConfigError(f"parallel.zero must be 0, 1, 2 or 3; got {stage!r}")
    if stage >= 1 and dp < 2 and not (stage == 3 and offload == "params"):
        raise ZeroConfigError(
            f"parallel.zero={stage} shards model state across the data-parallel ranks, but dp={dp}: "
            "there is nothing to shard across. Use parallel.zero=0, or run with dp >= 2 "
            "(for example parallel.nproc=2)"
        )
    if offload not in OFFLOAD_CHOICES:
        raise ZeroConfigError(f"parallel.offload must be one of {OFFLOAD_CHOICES}; got {offload!r}")
    if offload == "optimizer" and stage not in (1, 2):
        raise ZeroConfigError(
            f"parallel.offload=optimizer offloads the sharded optimizer of zero=1 or 2, not zero={stage}; "
            "use parallel.zero=1 or 2, or parallel.offload=params with parallel.zero=3"
        )
    if offload == "params" and stage != 3:
        raise ZeroConfigError(
            f"parallel.offload=params needs parallel.zero=3 (FSDP2 CPU offload); got zero={stage}. "
            "Use parallel.zero=3, or parallel.offload=optimizer with zero=1 or 2"
        )
    if offload != "none" and device_type == "cpu":
        raise ZeroConfigError(
            f"parallel.offload={offload} moves state from accelerator memory to CPU memory, but this run "
            "trains on the CPU, where that state already lives: there is nothing to offload. "
            "Set parallel.offload=none (or train on a GPU)"
        )


class ZeroOptimizer:
    """ZeRO-1/2 sharded optimizer wrapping any elementwise ``torch.optim`` optimizer.

    Contract: ``params`` are the trainer's param groups (dicts with ``"params"`` and per-group
    hyperparameters, or a plain iterable of parameters) covering every trainable parameter of
    ``model`` exactly once; all must share one dtype and device. Parameters may be DTensors (tensor
    parallelism): ``group`` is then the data-parallel ranks of one tp coordinate. Construction rewrites
    the model's parameters as views of flat buffers (same values; a DTensor's local tensor), places them in
    buckets (``plait.parallel.zero.buckets``) and registers gradient hooks; build it after
    the model is final (checkpointing applied) and before training. Per step: backward (wrap
    non-final accumulation micro-steps in ``no_sync()``), optionally ``clip_grad_norm_``, ``step()``,
    ``zero_grad()``. Gradients are summed over ``group`` and divided by ``grad_divisor`` (default: the
    group's size, an average). ``experts=True`` takes the expert-parallel parameters instead of the dense
    ones (``plait.parallel.units.is_expert``): ``plait.parallel.expert.dispatch`` shards them over the
    expert-data-parallel group with the whole data-parallel degree as divisor. ``p.grad`` stays None on the model: the
    reduced gradients live in the optimizer's shard tensors (``param_groups[i]["params"][j].grad``).
    ``offload=True`` keeps the fp32 master shard, its gradient (copied from the device shard each step)
    and the optimizer states in host memory; the config allows it only on an accelerator, but the class
    runs it on CPU too (no pinning there), which is how its tests exercise the copies.
    """

    def __init__(self, model: nn.Module, params: Iterable[Any], optimizer_cls: type = torch.optim.AdamW,
                 *, group: dist.ProcessGroup | None = None, stage: int = 2, bucket_mb: float = 25.0,
                 offload: bool = False, experts: bool = False, grad_divisor: int | None = None,
                 **defaults: Any) -> None:
        if stage not in (1, 2):
            raise ZeroConfigError(f"ZeroOptimizer implements zero=1 and zero=2; got stage={stage} "
                                  "(zero=3 is plait.parallel.fsdp.shard.apply_fsdp, zero=0 is plain data parallel)")
        self.model, self.stage, self.group = model, stage, group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.divisor = grad_divisor or self.world
        groups = normalize_groups(params)
        self._fqn = param_fqns(model)
        self.buckets = build_buckets(model, groups, bucket_mb, self.world, self.rank, experts)
        self._group_fqns = [[self._fqn[p] for p in g["params"]] for g in groups]
        self.offload = offload
        for b in self.buckets:
            if offload or b.flat.dtype != torch.float32:
                b.master = _master_copy(b.shard, offload)
        inner_groups = []
        for gi, g in enumerate(groups):
            hp = {k: v for k, v in g.items() if k != "params"}
            inner_groups.append({"params": [b.master for b in self.buckets if b.group_index == gi], **hp})
        self.optimizer = optimizer_cls(inner_groups, **defaults)
        self.comm: Comm | None = None
        self.compressor = None
        if stage == 1:
            for b in self.buckets:  # the shard is a slice of the kept full buffer: no extra gradient memory
                b.grad_shard = b.ensure_grad_full()[self.rank * b.chunk:(self.rank + 1) * b.chunk]
        self._sync = True
        self._next_launch = 0
        self._reduced = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(b, i))
                       for b in self.buckets for i, p in enumerate(b.params)]

    def use_comm(self, comm: Comm) -> None:
        """Issue every collective through ``comm`` (counted, guarded, compressed if it compresses).

        Call once, before the first backward, on every rank."""
        self.comm = comm
        self.compressor = comm.make_compressor()

    def _sum(self, t: torch.Tensor, group: Any) -> None:
        """All-reduce (sum) ``t`` in place over ``group``, through the comm layer when there is one."""
        if self.comm is not None:
            self.comm.all_reduce_sum(t, group, name="zero gradient norm")
        else:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)

    def _wait(self, work: Any) -> None:
        if self.comm is not None:
            self.comm.wait(work)
        else:
            work.wait()

    # -- the torch.optim surface the trainer uses -------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def finish_grad_sync(self) -> None:
        """Make the averaged gradient shards ready now (``step`` and ``clip_grad_norm_`` call it).

        Communication: reduce-scatter of every bucket not yet launched, then waits for all; no
        backward. Collective: every rank must call it at the same point.
        """
        self._ensure_reduced()

    def grad_buffers(self) -> list[torch.Tensor]:
        """Gradient storage this optimizer holds (full local buffers still alive, and the shards)."""
        return [t for b in self.buckets for t in (b.grad_full, b.grad_shard) if t is not None]

    def set_sync(self, enabled: bool) -> None:
        """Whether the next backward passes reduce gradients (False: accumulate locally)."""
        self._sync = enabled

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally without communicating (non-final accumulation micro-steps)."""
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear local gradient accumulation; stage 1 keeps (zeroes) its full buffers, stage 2 frees them."""
        for b in self.buckets:
            if self.stage == 1 and b.grad_full is not None:
                b.grad_full.zero_()
            else:
                b.grad_full = None
            for p in b.params:
                p.grad = None
        self._reset_sync_state()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm to ``max_norm``; return the (pre-clip) total norm.

        Communication: one all-reduce (sum) of a scalar, the local shards' sum of squares, over the
        group (and one more over the tp group for the buckets of tensor-parallel shards); no backward.
        Each element is owned by exactly one rank of the group (of the group and tp for a tp shard), so
        the sum is the full gradient's squared norm. A non-finite norm is returned unchanged and nothing
        is scaled, so the trainer can skip the step. Nothing is read on the host: the coefficient stays
        on the device (``max_norm`` inf: the norm only).
        """
        self._ensure_reduced()
        squares: dict[tuple[int, ...], list[Any]] = {}  # one sum per sharding pattern: [squares, its groups]
        for b in self.buckets:
            entry = squares.setdefault(tuple(id(g) for g in b.shard_groups), [b.grad_shard.new_zeros(()),
                                                                              b.shard_groups])
            entry[0] += b.grad_shard.pow(2).sum()
        total = self.buckets[0].grad_shard.new_zeros(())
        for sq, groups in squares.values():
            for g in (self.group, *groups):
                self._sum(sq, g)
            total += sq
        total = total.sqrt()
        if not math.isinf(max_norm):
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # same formula as torch's clip
            coef = torch.where(torch.isfinite(total), coef, torch.ones_like(coef))
            for b in self.buckets:
                b.grad_shard.mul_(coef)
        return total

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """Update this rank's shard, then all-gather every bucket into the model's parameters.

        Communication: reduce-scatter of any bucket not yet reduced (see ``_launch``), then one
        all-gather per bucket (each rank contributes its chunk); none in backward.
        """
        if closure is not None:
            raise ValueError("ZeroOptimizer.step does not take a closure; run forward/backward before step()")
        self._ensure_reduced()
        for b in self.buckets:
            if self.offload:  # to the host buffer; blocking: the CPU optimizer reads it right after
                if b.master.grad is None:
                    b.master.grad = _master_copy(b.grad_shard, True)
                else:
                    b.master.grad.copy_(b.grad_shard)
            else:  # grad_shard is fp32, on the master's device: no copy
                b.master.grad = b.grad_shard
        self.optimizer.step()
        works = []
        for i, b in enumerate(self.buckets):
            if b.master is not b.shard:
                b.shard.copy_(b.master, non_blocking=True)
            works.append(self._all_gather(i, b))
        for w in works:
            self._wait(w)
        self._reset_sync_state()

    def _all_gather(self, index: int, b: Bucket) -> Any:
        # The input is a copy: gloo does not promise in-place all-gather when input aliases output.
        shard = b.shard.clone()

        def issue() -> Any:
            return all_gather_flat(b.flat, shard, group=self.group, async_op=True)

        if self.comm is None:
            return issue()
        nbytes = ring_half_bytes(b.flat.numel() * b.flat.element_size(), self.world)
        return self.comm.issue_async(f"zero all-gather bucket {index}", self.group, issue, nbytes)

    # -- gradient synchronisation -------------------------------------------------------------------
    def _make_hook(self, bucket: Bucket, index: int):
        def hook(p: torch.Tensor) -> None:
            if bucket.launched:
                raise RuntimeError("a gradient arrived for a bucket already reduced in this step; "
                                   "call zero_grad()/step() between backward passes")
            if not self._sync and partial_grad(p.grad):
                return  # autograd sums it in p.grad over the micro-steps; it is summed over tp once, at the last
            self._take(bucket, index)
            if self._sync:
                bucket.ready.add(index)
                if self.stage == 2:
                    self._launch_ready()
                    self._release_reduced()
        return hook

    @staticmethod
    def _take(b: Bucket, index: int) -> None:
        """Move parameter ``index``'s ``.grad`` into the bucket's local gradient buffer, laid out like its local
        tensor (a DTensor gradient first redistributed like its parameter: a ``Partial`` one summed over tp)."""
        p = b.params[index]
        if p.grad is not None:
            b.view(index, b.ensure_grad_full()).add_(local_grad(p))
            p.grad = None

    def gather_local(self) -> None:
        """Every gradient still in a parameter's ``.grad`` into its bucket: one assigned rather than accumulated
        (torch's zero-bubble weight pass), or a ``Partial`` one kept there through accumulation micro-steps.
        Communication: a tp all-reduce of each ``Partial`` gradient (the gradient's own sum)."""
        for b in self.buckets:
            for i in range(len(b.params)):
                self._take(b, i)

    def _release_reduced(self) -> None:
        """Stage 2, during backward: free the full local buffer of every launched bucket whose
        reduce-scatter has finished (polled: backward is not held up), and wait for the oldest when
        more than ``MAX_FULL_IN_FLIGHT`` launched buckets still hold one, so the full gradients alive
        in backward are bounded by a few buckets, not the model. No communication of its own."""
        launched = [b for b in self.buckets[:self._next_launch] if b.grad_full is not None]
        for b in launched:
            if b.work is not None and _is_done(getattr(b.work, "handle", b.work)):
                b.grad_full = None
        launched = [b for b in launched if b.grad_full is not None]
        for b in launched[:max(0, len(launched) - MAX_FULL_IN_FLIGHT)]:
            self._wait(b.work)
            b.work, b.grad_full = None, None

    def _launch_ready(self) -> None:
        # Launch strictly in bucket order so every rank issues identical collectives.
        while self._next_launch < len(self.buckets):
            b = self.buckets[self._next_launch]
            if len(b.ready) < len(b.params):
                return
            self._launch(b)

    def _launch(self, b: Bucket) -> None:
        """Sum bucket ``b``'s local gradient over the group into this rank's shard; async.

        Communication (no autograd involvement): stage 2, one reduce-scatter of ``numel`` elements
        into the separate shard buffer; stage 1, one in-place all-reduce of the full local buffer,
        whose slice is the shard (the full buffer is kept at stage 1 anyway, so this holds no second
        gradient buffer, at twice the reduce-scatter's bytes). Before it, a tp all-reduce of any ``Partial``
        gradient the bucket still holds in ``.grad`` (``gather_local``).
        """
        self._reduced = False
        for i in range(len(b.params)):  # what no hook moved this step (see gather_local)
            self._take(b, i)
        index, full = self._next_launch, b.ensure_grad_full()
        stage1 = self.stage == 1

        def issue() -> Any:
            if stage1:
                return dist.all_reduce(full, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            return reduce_scatter_flat(b.grad_shard, full, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

        if self.comm is None:
            b.work = issue()
        elif self.compressor is not None and self.comm.compress_active:
            name = f"zero bucket {index} ({self.compressor.name})"
            b.work = self.comm.run_async(name, self.group, lambda: self._compressed_shard(index, b, full))
        else:
            size = full.numel() * full.element_size()
            nbytes = ring_allreduce_bytes(size, self.world) if stage1 else ring_half_bytes(size, self.world)
            b.work = self.comm.issue_async(f"zero {'all-reduce' if stage1 else 'reduce-scatter'} bucket {index}",
                                           self.group, issue, nbytes)
        b.launched = True
        self._next_launch += 1

    def _compressed_shard(self, index: int, b: Bucket, full: torch.Tensor) -> int:
        """Comm thread: compressed average of the whole bucket, this rank's slice kept as a sum (the
        caller divides every shard by the world size). Returns the bytes put on the wire."""
        before = self.compressor.wire_bytes
        mean = self.compressor.allreduce_mean(index, full, self.group, shapes=b.shapes)
        b.grad_shard.copy_(mean[self.rank * b.chunk:(self.rank + 1) * b.chunk]).mul_(self.world)
        return self.compressor.wire_bytes - before

    def _ensure_reduced(self) -> None:
        if self._reduced:
            return
        while self._next_launch < len(self.buckets):  # buckets some of whose params got no gradient
            self._launch(self.buckets[self._next_launch])
        for b in self.buckets:
            if b.work is not None:  # None: already waited for in backward (_release_reduced)
                self._wait(b.work)
            b.work = None
            b.grad_shard.div_(self.divisor)  # the group's size (an average) unless grad_divisor says otherwise
            if self.stage == 2:
                b.grad_full = None  # only the reduced shard survives
        self._reduced = True

    def _reset_sync_state(self) -> None:
        for b in self.buckets:
            b.ready.clear()
            b.launched = False
        self._next_launch = 0
        self._reduced = False

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return gather_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        scatter_state_dict(self, state_dict)


def _is_done(handle: Any) -> bool:
    """Whether a c10d ``Work`` or a comm-thread future has finished, without waiting."""
    if isinstance(handle, Future):
        return handle.done()
    return bool(handle.is_completed())


def _master_copy(t: torch.Tensor, offload: bool) -> torch.Tensor:
    """A separate fp32 copy of ``t``: in host memory when offloading (pinned where CUDA is, so copies
    to and from the GPU can be asynchronous; a CPU-only build cannot pin), else on ``t``'s device."""
    out = t.detach().to(device="cpu" if offload else t.device, dtype=torch.float32, copy=True)
    return out.pin_memory() if offload and torch.cuda.is_available() else out
