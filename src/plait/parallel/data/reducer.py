"""Data parallelism: plait's bucketed, overlapped gradient reducer, and PyTorch DDP as its reference.

plait's reducer keeps every gradient inside a flat per-bucket buffer (``param.grad`` is a view into
it), so autograd accumulates straight into the buffer and no copy is made before or after the
all-reduce. Buckets hold parameters in reverse registration order, the order in which backward
produces their gradients. A post-accumulate-grad hook counts each bucket down; when a bucket is
complete its all-reduce starts asynchronously while backward continues on earlier layers. Buckets
are launched strictly in index order on every rank, because c10d matches collectives on a group by
issue order; buckets whose parameters got no gradient this step are launched, in order, from a
callback that runs when backward finishes. On non-final accumulation micro-steps nothing is
communicated (``no_sync``).

The all-reduce algorithm, gradient compression and the hang guard belong to the ``Comm`` the
reducer is given. With compression on, each bucket's average is ``compressor.allreduce_mean`` run on
the comm thread (overlapping backward like an uncompressed bucket) and copied back into the bucket;
the compressor keeps its error-feedback state per bucket index.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from plait.comm.collectives import Comm, CommWork
from plait.comm.compress import Compressor
from plait.parallel.units import is_expert
from plait.plan.buckets import reducer_groups


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    flat: torch.Tensor  # (numel,) gradient storage shared by the params' .grad views
    views: list[torch.Tensor]
    pending: int = 0
    work: CommWork | None = None
    ready: bool = False
    launched: bool = False


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (tensor-parallel parameters), the tensor itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_grad(p: nn.Parameter) -> torch.Tensor | None:
    """This rank's gradient shard, laid out like the parameter's shard.

    DTensor autograd may leave a gradient with other placements than its parameter (a vocabulary-
    sharded embedding can get a replicated gradient); it is first redistributed like the parameter."""
    g = p.grad
    if isinstance(g, DTensor):
        if g.placements != p.placements:
            p.grad = g = g.redistribute(p.device_mesh, p.placements)
        return g.to_local()
    return g




def _make_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[_Bucket]:
    """Group params (already in gradient-ready order) into same-dtype buckets of about bucket_bytes.

    The first bucket is capped at 1 MiB: its gradients are ready earliest, and a small first bucket
    starts communication early in backward even when the whole model would fit in one bucket."""
    sizes = [(_local(p).numel() * p.element_size(), p.dtype) for p in params]
    groups = [[params[i] for i in group] for group in reducer_groups(sizes, bucket_bytes)]
    buckets = []
    for ps in groups:
        shards = [_local(p) for p in ps]
        flat = torch.zeros(sum(s.numel() for s in shards), dtype=ps[0].dtype, device=shards[0].device)
        views, off = [], 0
        for s in shards:
            views.append(flat[off: off + s.numel()].view_as(s))
            off += s.numel()
        buckets.append(_Bucket(params=ps, flat=flat, views=views))
    return buckets


class GradReducer:
    """Averages gradients over ``group`` with bucketed all-reduces overlapped with backward.

    Contract: build it before the optimizer; call ``finish()`` after the final micro-step's
    ``backward()`` and before reading gradients; wrap non-final micro-steps in ``no_sync()``; zero
    gradients with ``zero_grad()`` (or ``optimizer.zero_grad(set_to_none=False)``).
    """

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None, comm: Comm,
                 bucket_mb: float = 25.0, broadcast: bool = True) -> None:
        self.module = model
        # Tensor-parallel (DTensor) parameters cannot take a plain view as .grad: their local gradient
        # shards are copied into the bucket when it launches and back when it is reduced.
        self.copy_grads = any(isinstance(p, DTensor) for p in model.parameters())
        self.group = group
        self.comm = comm
        self.world = dist.get_world_size(group)
        self.require_sync = True
        self._callback_queued = False
        if broadcast:  # the engine broadcasts the whole world's weights itself before any layout
            self._broadcast_initial_state()
        # Expert-parallel parameters (plait.parallel.expert.dispatch) reduce over their own group, not this one.
        params = [p for p in model.parameters() if p.requires_grad and not is_expert(p)]
        self.buckets = _make_buckets(list(reversed(params)), int(bucket_mb * 2**20))
        self._next = 0
        for b in self.buckets:
            for i, p in enumerate(b.params):
                if not self.copy_grads:
                    p.grad = b.views[i]
                # the hook knows its bucket and slot: no lookup by parameter (a tensor's hash is a Python call)
                p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, b, i))
        # Built after the buckets so every rank registers compressors in the same order.
        self.compressor: Compressor | None = comm.make_compressor()
        self._reset()

    def _broadcast_initial_state(self) -> None:
        """Every rank starts from rank 0's parameters and buffers (one broadcast per tensor)."""
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                self.comm.broadcast(_local(t.data), src=src, group=self.group, name="initial broadcast")

    def _reset(self) -> None:
        self._next = 0
        self._callback_queued = False
        for b in self.buckets:
            b.pending, b.ready, b.launched, b.work = len(b.params), False, False, None

    def _on_grad_ready(self, bucket: _Bucket, i: int, p: nn.Parameter) -> None:
        grad, view = p.grad, bucket.views[i]
        if self.copy_grads or grad is view:
            pass  # copied at launch; or accumulated into its view (the same tensor object), the usual case
        elif grad is None or grad.data_ptr() != view.data_ptr():
            # The optimizer dropped the views (zero_grad with set_to_none): put the gradient back.
            bucket.views[i].copy_(p.grad)
            p.grad = bucket.views[i]
        if not self.require_sync:
            return
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._launch_remaining)
        bucket.pending -= 1
        if bucket.pending == 0:
            bucket.ready = True
            self._launch_ready()

    def _launch(self, index: int) -> None:
        b = self.buckets[index]
        if self.copy_grads:
            for p, view in zip(b.params, b.views, strict=True):
                g = local_grad(p)
                if g is None:
                    view.zero_()
                else:
                    view.copy_(g)
        elif b.pending:
            # Some parameters got no gradient through the hook this step. Where the optimizer dropped their
            # .grad, the bucket still holds an old gradient: send zeros instead, as the other ranks may have
            # real ones. A .grad set by assignment, which fires no hook (the zero-bubble schedule's weight
            # pass: torch's stage_backward_weight assigns dW when .grad is None), is this step's gradient.
            for p, view in zip(b.params, b.views, strict=True):
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                    p.grad = view
        if self.compressor is not None and self.comm.compress_active:
            name = f"gradient bucket {index} ({self.compressor.name})"
            b.work = self.comm.run_async(name, self.group, lambda: self._compressed_mean(index, b.flat))
        else:
            b.flat.div_(self.world)  # average = sum of pre-divided gradients
            b.work = self.comm.all_reduce_async(b.flat, self.group, name=f"gradient bucket {index}")
        b.launched = True

    def _compressed_mean(self, index: int, flat: torch.Tensor) -> int:
        """Runs on the comm thread: replace ``flat`` by the compressed average; returns wire bytes."""
        before = self.compressor.wire_bytes
        shapes = [v.shape for v in self.buckets[index].views]  # PowerSGD compresses each matrix on its own
        flat.copy_(self.compressor.allreduce_mean(index, flat.float(), self.group, shapes=shapes))
        return self.compressor.wire_bytes - before

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].ready:
            self._launch(self._next)
            self._next += 1

    def _launch_remaining(self) -> None:
        """End of backward: buckets with unused parameters go now, still in index order."""
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1

    def finish(self) -> None:
        """Wait for every bucket's all-reduce; afterwards each ``param.grad`` holds the average."""
        if not self._callback_queued:
            # No gradient reached a hook on this rank (e.g. no backward ran): still take part.
            self._launch_remaining()
        for b in self.buckets:
            self.comm.wait(b.work)
            if self.copy_grads:
                for p, view in zip(b.params, b.views, strict=True):
                    g = local_grad(p)
                    if g is not None:
                        g.copy_(view)
        self._reset()

    def set_sync(self, enabled: bool) -> None:
        """Whether the next backward passes launch their all-reduces (False: accumulate locally)."""
        self.require_sync = enabled

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; nothing is communicated inside this context."""
        prev, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = prev

    def zero_grad(self) -> None:
        if self.copy_grads:
            self.module.zero_grad(set_to_none=True)
            return
        for b in self.buckets:
            b.flat.zero_()
        for b in self.buckets:
            for p, v in zip(b.params, b.views, strict=True):
                p.grad = v


class _ClassForward(nn.Module):
    """What DDP wraps: the user's model, called through its class's ``forward`` so that neither the
    model's own hooks (they ran in the user's call) nor the engine's patch of ``model.forward`` (which
    routes into DDP) run a second time."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: object, **kwargs: object) -> object:
        return type(self.model).forward(self.model, *args, **kwargs)


class TorchDDP:
    """PyTorch DDP behind the reducer's interface: the reference plait's reducer is measured against.

    ``module`` is the ``DistributedDataParallel`` wrapper; the engine routes the user's
    ``model(...)`` calls into it, so the user keeps the original model object and its state-dict keys.
    DDP arms its reducer for the backward in forward, so ``set_sync`` applies to the next forward."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None, bucket_mb: float) -> None:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = _ClassForward(model)
        ignored = [n for n, p in wrapped.named_parameters() if is_expert(p)]
        if ignored:  # expert-parallel parameters reduce over their own group (plait.parallel.expert.dispatch)
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(wrapped, ignored)
        self.module = DistributedDataParallel(wrapped, process_group=group, bucket_cap_mb=bucket_mb)

    def set_sync(self, enabled: bool) -> None:
        self.module.require_backward_grad_sync = enabled

    def finish(self) -> None:
        """DDP has already waited for its all-reduces inside backward."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.module.no_sync()

    def zero_grad(self) -> None:
        drop_grads(self)


class LocalGrads:
    """One data-parallel rank: nothing to reduce."""

    def __init__(self, model: nn.Module) -> None:
        self.module = model

    def set_sync(self, enabled: bool) -> None:
        """Nothing to communicate."""

    def finish(self) -> None:
        """Gradients are already complete."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def zero_grad(self) -> None:
        drop_grads(self)


def drop_grads(engine: TorchDDP | LocalGrads) -> None:
    """Gradients dropped (``set_to_none``), as a hand-written loop's ``optimizer.zero_grad()`` does: the next
    backward writes fresh ones instead of adding into zeroed memory. Over the parameters listed once (a module's
    own ``zero_grad`` walks the module tree at every call)."""
    params = engine.__dict__.get("_params")
    if params is None:
        params = engine._params = [p for p in engine.module.parameters() if p.requires_grad]
    for p in params:
        p.grad = None


def apply_data_parallel(model: nn.Module, group: dist.ProcessGroup | None, dp: int, impl: str,
                        bucket_mb: float, comm: Comm, broadcast: bool = True) -> GradReducer | TorchDDP | LocalGrads:
    """Wrap ``model`` for data parallelism over ``group`` (dp ranks) with plait's reducer or DDP."""
    if dp == 1:
        return LocalGrads(model)
    if impl == "torch":
        if comm.compression is not None or comm.algorithm != "backend":
            # DDP's comm hooks keep state (PowerSGD's residuals) that plait's checkpoint cannot
            # save, so a resumed run would silently diverge: rejected rather than half-supported.
            raise ValueError("parallel.impl=torch (PyTorch DDP) runs its own all-reduce: comm.compress and "
                             "comm.allreduce apply to plait's reducer; set parallel.impl=plait")
        return TorchDDP(model, group, bucket_mb)
    return GradReducer(model, group, comm, bucket_mb, broadcast=broadcast)
