"""Expert parallelism: MoE experts sharded over the ``ep`` mesh axis, folded into data parallelism.

Layout. The data-parallel world of ``dp`` ranks (expert-parallel ranks included; ``plait.topology``) is
split as ``dp_replicate = dp / ep`` groups of ``ep`` ranks. Every rank processes its own micro-batches.
Dense parameters are replicated on all ``dp`` ranks; each MoE layer's ``E`` experts are sharded over the
``ep`` ranks of a group (rank ``i`` holds the global experts ``[i E/ep, (i+1) E/ep)``) and replicated over
the ``dp / ep`` ranks holding the same slice (the expert-data-parallel group).

Dispatch (``AllToAllDispatcher``, the default): the routed assignments are sorted by global expert index; one
all-to-all exchanges the per-expert counts, then the tokens go out in slot buffers of a static size (each
destination reads which local expert a row is for from the counts, on the device), the local experts run, and a
second all-to-all brings the results back (autograd runs the two reversed in backward): no host read, so
torch.compile keeps one graph. ``SplitAllToAllDispatcher`` sends variable splits sized by the routing (one host
read per layer). ``AllGatherDispatcher`` is the reference path: every rank gathers
all ranks' assignments, computes those for its own experts, and one all-reduce sums the results.

Gradient reduction (``plait.parallel.expert.sync.ExpertSync.finish``), so that every gradient
equals one process training on the whole global batch (the mean over the ``dp`` ranks' losses):

* dense parameters: averaged over the whole data-parallel world including ``ep`` (the layout's reducer,
  DDP, unchanged), i.e. summed over ``dp`` ranks and divided by ``dp``;
* expert parameters: their local gradient already sums the contributions of the tokens every rank of the
  ``ep`` group sent; it is summed over the expert-data-parallel group (``dp / ep`` ranks) and divided by
  ``dp``, not by ``dp / ep`` (dividing by the group size is the classic error by a factor of ``ep``).

Every local expert runs on however many rows reached it, zero included, so its gradient is zeros rather
than None, and every rank issues the same collectives whatever its routing: no hang when an expert or a
whole rank gets no tokens.

Checkpoints: expert weights and their optimizer states are saved as ``DTensor`` shards of the global
``(E, ...)`` tensors on the ``ep`` mesh, keyed by the single-process names, so DCP reshards them to any
other ``ep`` (1 included) on load. The balancing bias is a buffer, the same on every rank.

Compositions (``plait.parallel.expert.sync.ExpertSync`` beside the gradient-sync policy of the dense parameters):
plait's data-parallel reducer, PyTorch DDP, one-rank data parallelism; ZeRO 1-3 and HSDP (the experts keep their own
optimizer, and are sharded like the dense parameters over the remaining data-parallel axes, the ``dp / ep``
ranks holding the same experts: their optimizer states and gradients by a second ``ZeroOptimizer`` at stages
1-2, their weights too by FSDP2 at stage 3, under HSDP over a shard group's ``dp_shard x cp`` of them and replicated
across the replicas; checkpoints then hold DTensors of the global ``(E, ...)`` tensors sharded over ep and those
axes); tensor parallelism (attention and dense MLPs tensor-parallel, MoE blocks whole on every tp rank: experts
whole, not expert-tensor-parallel; ep groups are the ranks with the same tp coordinate), at every ZeRO stage tp
takes; sequence parallelism (each tp rank's MoE layers route its own sequence shard: ``plait.parallel.tensor.
local_tokens``; their gradients summed over tp, the experts' with the expert-data-parallel ranks); context
parallelism (each rank's shard of the tokens dispatched like any other; the expert-data-parallel ranks include cp);
pipeline parallelism (each stage's MoE layers dispatch within the ranks of that stage; the same schedule on every ep
rank keeps the all-to-alls in step). Under cp and sp the balancing statistics are summed over the shards of each
sequence (``plait.parallel.expert.apply.ShardedTokens``). """

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.distributed.nn.functional as dfn
from torch import nn

from plait.config import ConfigError, MoeConfig, ParallelConfig
from plait.nn.experts import count_ids
from plait.nn.moe import STATS, MoE, Routing, max_violation, moe_layers
from plait.nn.routing import RouterSpec
from plait.parallel.units import EXPERT_ATTR, is_expert

__all__ = ["DISPATCHERS", "AllGatherDispatcher", "AllToAllDispatcher", "MoeMonitor", "SplitAllToAllDispatcher",
           "check_expert_layout", "is_expert", "shard_experts"]


class ExpertParallelError(ConfigError):
    """A model or layout expert parallelism cannot take; the message says what to do."""


def check_expert_layout(m: MoeConfig, p: ParallelConfig) -> None:
    """Config-only checks of ``[moe]`` against ``parallel.ep`` and the other degrees."""
    if m.num_experts < 0 or m.top_k < 1 or m.every < 1 or m.d_hidden < 0 or m.shared_experts < 0:
        raise ConfigError("moe.num_experts >= 0, moe.top_k >= 1, moe.every >= 1, moe.d_hidden >= 0 and "
                          "moe.shared_experts >= 0 are required")
    if m.capacity_factor < 0:
        raise ConfigError(f"moe.capacity_factor={m.capacity_factor} must be 0 (dropless) or positive")
    if m.num_experts and m.top_k > m.num_experts:
        raise ConfigError(f"moe.top_k={m.top_k} exceeds moe.num_experts={m.num_experts}: a token cannot choose "
                          f"more experts than exist; set moe.top_k <= {m.num_experts}")
    if m.num_experts:
        try:
            RouterSpec(m.num_experts, m.top_k, m.score, m.num_groups, m.topk_groups, m.route_scale).check()
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if m.num_experts and m.num_experts % p.ep:
        fits = [e for e in range(1, m.num_experts + 1) if m.num_experts % e == 0]
        raise ConfigError(f"moe.num_experts={m.num_experts} is not divisible by parallel.ep={p.ep}: every "
                          f"expert-parallel rank holds the same number of experts; use ep in {fits}")


# -- dispatchers ----------------------------------------------------------------------------------
class _Dispatcher:
    def __init__(self, group: dist.ProcessGroup | None, offset: int, local: int, ep: int, ep_rank: int) -> None:
        self.group, self.expert_offset, self.local, self.ep, self.ep_rank = group, offset, local, ep, ep_rank
        # forward dispatch + combine bytes to other ranks since the last report: a host tensor added to in place,
        # so a compiled graph neither reads the device nor guards on a growing Python integer
        self.bytes_sent = torch.zeros((), dtype=torch.float64)


class AllToAllDispatcher(_Dispatcher):
    """Assignments to the ranks holding their experts and back, in static shapes (no host read): one
    all-to-all of the per-expert counts, then every rank sends each destination a slot buffer of ``S`` rows
    (its rows for that destination first, grouped by local expert, then zeros), the destination runs its
    local experts on the rows the counts say are real, and a second all-to-all of the same shape brings the
    results back (autograd runs the two reversed in backward).

    ``S`` is the most rows one rank can have for one destination, so nothing is ever dropped here:
    ``N x min(k, E / ep)`` dropless (a token picks an expert at most once), or ``E / ep x`` the layer's
    capacity when ``moe.capacity_factor`` caps each expert (its drops are the layer's, reported as
    ``dropped_fraction``). The price of the static shape is bytes: ``S`` rows per destination whatever the
    routing, up to ``min(ep, E/k)`` times what variable splits would carry when dropless (c10d's
    ``all_to_all_single`` takes its split sizes as host integers, so variable splits need a device-to-host read
    per layer; symmetric memory's ``all_to_all_vdev``, the exception, is CUDA/NVSHMEM only). A capacity factor
    bounds the bytes to ``capacity_factor x`` the balanced load.

    Every rank of an ep group must route the same number of tokens per micro-batch (the same ``S``): the count
    exchange carries each rank's ``S`` and a device-side assertion stops a mismatch (no silent misreading)."""

    def __call__(self, x: torch.Tensor, routing: Routing, experts: Any) -> torch.Tensor:
        ep, local, c = self.ep, self.local, x.size(-1)
        a = len(routing.experts)
        slots = min(a, local * routing.per_expert)  # rows per destination, a static bound
        counts = count_ids(routing.experts, ep * local)  # (ep x local,) kept assignments per global expert
        order = torch.argsort(routing.experts, stable=True)  # by destination, then local expert; dropped last
        dest = (routing.experts // local).index_select(0, order)  # (A,) ep where dropped
        per_dest = counts.view(ep, local).sum(1)
        first = torch.cat([per_dest.cumsum(0) - per_dest, per_dest.new_zeros(1)])  # (ep + 1,)
        pos = torch.arange(a, device=x.device) - first.index_select(0, dest)
        slot_sorted = torch.where(dest < ep, dest * slots + pos, ep * slots)  # dropped: the spare row at the end
        slot = torch.empty_like(slot_sorted).index_copy_(0, order, slot_sorted)  # (A,) assignment order
        header = torch.cat([counts.view(ep, local), counts.new_full((ep, 1), slots)], 1)  # (dest, local + 1)
        recv = fc.all_to_all_single(header.reshape(-1), None, None, self.group).view(ep, local + 1)  # by source
        torch._assert_async((recv[:, -1] == slots).all(), "moe all-to-all: the ranks of an ep group routed "
                            "different numbers of tokens; every rank's micro-batch must have the same shape")
        x_send = x.new_zeros(ep * slots + 1, c).index_copy(0, slot, x.index_select(0, routing.tokens))[:-1]
        x_recv = fc.all_to_all_single_autograd(x_send, None, None, self.group)  # (ep S, C) by source
        ends = recv[:, :local].cumsum(1)  # (ep, local): where each local expert's rows end in a source's block
        rows = torch.arange(slots, device=x.device).expand(ep, slots).contiguous()
        ids = torch.searchsorted(ends, rows, right=True).reshape(-1)  # (ep S,) local expert; local: padding
        y = experts(x_recv, torch.arange(ep * slots, device=x.device), ids, cap=ep * routing.per_expert)
        y_back = fc.all_to_all_single_autograd(y, None, None, self.group)  # (ep S, C) in this rank's slots
        if torch.is_grad_enabled():  # training forwards; backward moves the same bytes again
            self.bytes_sent.add_(2 * (ep - 1) * slots * c * x.element_size())
        return torch.cat([y_back, y_back.new_zeros(1, c)]).index_select(0, slot)  # (A, C), dropped: zeros


class SplitAllToAllDispatcher(_Dispatcher):
    """``moe.dispatcher=alltoall_split``: the all-to-all with variable splits, sized by the routing. The bytes
    and the expert-side memory are what the routing needs (the balanced share times the busiest rank's
    imbalance), at the price of one device-to-host read of the counts per layer (c10d takes split sizes as host
    integers): for large ``ep`` without a capacity factor, where the static buffer's bound is ``min(ep, E/k)``
    times the balanced share. Eager only (``train.compile`` refuses it)."""

    def __call__(self, x: torch.Tensor, routing: Routing, experts: Any) -> torch.Tensor:
        ep, local, c = self.ep, self.local, x.size(-1)
        counts = count_ids(routing.experts, ep * local)  # (ep x local,) kept assignments per global expert
        order = torch.argsort(routing.experts, stable=True)  # by owning rank, then local expert; dropped last
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.group)
        sizes = torch.cat([counts.view(ep, local).sum(1), recv.view(ep, local).sum(1)]).tolist()  # the host read
        send_splits, recv_splits = sizes[:ep], sizes[ep:]
        kept = order[:sum(send_splits)]
        ids = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(recv, output_size=sum(recv_splits))
        x_send = x.index_select(0, routing.tokens.index_select(0, kept))  # (kept, C)
        x_recv = dfn.all_to_all_single(x.new_empty(sum(recv_splits), c), x_send, recv_splits, send_splits,
                                       group=self.group)
        y = experts(x_recv, torch.arange(len(ids), device=x.device), ids)  # (R, C)
        y_back = dfn.all_to_all_single(y.new_empty(len(kept), c), y, send_splits, recv_splits, group=self.group)
        if torch.is_grad_enabled():
            remote = sum(send_splits) - send_splits[self.ep_rank] + sum(recv_splits) - recv_splits[self.ep_rank]
            self.bytes_sent.add_(remote * c * x.element_size())
        return y_back.new_zeros(len(order), c).index_copy(0, kept, y_back)  # (A, C) assignment order, dropped 0


class AllGatherDispatcher(_Dispatcher):
    """Reference path: gather every rank's assignments, run this rank's experts on those routed to them,
    and sum the results over the ``ep`` group (an all-reduce); each rank keeps its own rows. Simple and
    obviously right, at ``ep`` times the all-to-all's traffic."""

    def __call__(self, x: torch.Tensor, routing: Routing, experts: Any) -> torch.Tensor:
        a = len(routing.tokens)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.ep)]
        dist.all_gather(sizes, torch.tensor([a]), group=self.group)
        a_max = max(int(s) for s in sizes)
        x_pad = x.new_zeros(a_max, x.size(-1))
        x_pad = x_pad.index_copy(0, torch.arange(a, device=x.device), x.index_select(0, routing.tokens))
        ids = torch.full((a_max,), -1, dtype=torch.int64, device=x.device)
        ids[:a] = routing.experts
        # The gather as a sum of zero-padded slots: differentiable (backward: the same all-reduce of the
        # gradient, each rank keeping its slot). torch's autograd all_gather mis-addresses a subgroup on gloo.
        slots = [x_pad if r == self.ep_rank else torch.zeros_like(x_pad) for r in range(self.ep)]
        xs = dfn.all_reduce(torch.stack(slots), group=self.group).unbind(0)
        all_ids = [torch.empty_like(ids) for _ in range(self.ep)]
        dist.all_gather(all_ids, ids, group=self.group)
        lo, hi = self.expert_offset, self.expert_offset + self.local
        ids_all = torch.cat(all_ids)  # (ep x a_max,): every rank's slots, one after another
        rows = ((ids_all >= lo) & (ids_all < hi)).nonzero().squeeze(1)
        y = experts(torch.cat(xs), rows, ids_all[rows] - lo)  # one call: FSDP2 gathers the weights once
        outs = y.new_zeros(self.ep * a_max, y.size(-1)).index_copy(0, rows, y)
        total = dfn.all_reduce(outs.view(self.ep, a_max, -1), group=self.group)  # (ep, a_max, C)
        if torch.is_grad_enabled():
            self.bytes_sent.add_(4 * (self.ep - 1) * a_max * x.size(-1) * x.element_size())
        return total[self.ep_rank, :a]


DISPATCHERS = {"alltoall": AllToAllDispatcher, "alltoall_split": SplitAllToAllDispatcher,
               "allgather": AllGatherDispatcher}


def shard_experts(model: nn.Module, ep: int, ep_rank: int, group: dist.ProcessGroup | None,
                  dispatcher: str = "alltoall") -> list[nn.Parameter]:
    """Keep rank ``ep_rank``'s slice of every MoE layer's experts (the weights are already equal on every
    rank) and install the dispatcher over ``group`` (the ``ep`` ranks); returns the expert parameters."""
    # torch 2.13 marks the autograd-aware collectives the dispatchers use deprecated in favour of the
    # functional ones; they remain the documented differentiable c10d calls that run on gloo.
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.nn\.functional\..* is deprecated",
                            category=FutureWarning)
    layers = moe_layers(model)
    if not layers:
        raise ExpertParallelError(f"parallel.ep={ep} but the model has no plait.nn.MoE layer to shard: set "
                                  "moe.num_experts for plait's GPT, use plait.nn.MoE in your model, or set "
                                  "parallel.ep=1")
    cls = DISPATCHERS[dispatcher]
    params: list[nn.Parameter] = []
    for layer in layers:
        e = layer.num_experts
        if e % ep:
            raise ExpertParallelError(f"an MoE layer has {e} experts, not divisible by parallel.ep={ep}")
        n = e // ep
        off = ep_rank * n
        params += keep_experts(layer.experts, ("w1", "w2"), off, n)
        layer.dispatcher = cls(group, off, n, ep, ep_rank)
    return params


def keep_experts(experts: nn.Module, names: tuple[str, ...] | list[str], off: int, n: int) -> list[nn.Parameter]:
    """Replace each stacked expert weight ``names`` of ``experts`` (experts on dim 0) by its rows
    ``[off, off + n)``, marked as expert-parallel with the global shape kept; returns the new parameters."""
    params = []
    for name in names:
        full = getattr(experts, name)
        local = nn.Parameter(full.detach()[off:off + n].clone(), requires_grad=full.requires_grad)
        setattr(local, EXPERT_ATTR, True)
        local.global_shape = tuple(full.shape)  # type: ignore[attr-defined]
        setattr(experts, name, local)
        params.append(local)
    return params


def _expert_modules(model: nn.Module) -> list[tuple[nn.Module, list[str]]]:
    """Each module holding expert-parallel parameters itself (plait's ``GroupedExperts``, a Hugging Face
    experts module), with those parameters' names."""
    out = []
    for m in model.modules():
        names = [n for n, q in m.named_parameters(recurse=False) if is_expert(q)]
        if names:
            out.append((m, names))
    return out


def fsdp_shard_experts(model: nn.Module, topo: Any, *, param_dtype: torch.dtype | None = None,
                       reshard_after_forward: bool = True) -> None:
    """ZeRO-3 for the experts: each module of local experts (plait's ``GroupedExperts``, a Hugging Face
    experts module) becomes an FSDP2 unit over the expert-data-parallel ranks (the ``dp / ep`` ranks holding
    the same experts; under hybrid sharding, sharded over those of a shard group and replicated over the replicas:
    ``Topology.expert_fsdp_mesh``), every weight sharded on its dim 1 (``C`` of ``w1``, ``H`` of ``w2``; dim 0, the
    expert index, is already split over ``ep``), the reduction divided by the whole data-parallel degree ``dp``.
    Call before the dense FSDP units are built (they then leave these parameters to the nested unit)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    mesh = topo.expert_fsdp_mesh
    n = mesh.size(mesh.ndim - 1)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for ex, names in _expert_modules(model):
        shapes = {name: getattr(getattr(ex, name), "global_shape", tuple(getattr(ex, name).shape)) for name in names}
        for name in names:
            size = getattr(ex, name).size(1)
            if size % n:
                raise ExpertParallelError(
                    f"parallel.zero=3 shards each expert weight's dim 1 over {n} of the ranks holding the same "
                    f"experts (dp / ep), but {name} has {size} there; choose parallel.ep so that they divide "
                    f"both the model width and the expert width (e.g. ep = dp), or use parallel.zero=1 or 2")
        fully_shard(ex, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward,
                    shard_placement_fn=lambda _p: Shard(1))
        # sum, then divide by dp (one process's gradient, not the group's mean); a plain SUM runs on gloo too,
        # where the fused PREMUL_SUM FSDP2 would otherwise pick does not exist
        ex.set_force_sum_reduction_for_comms(True)
        ex.set_gradient_divide_factor(float(topo.degree("dp_cp")))
        for name in names:  # FSDP made new parameters: mark them again
            q = getattr(ex, name)
            setattr(q, EXPERT_ATTR, True)
            q.global_shape = shapes[name]


# -- the engine's per-step MoE work ---------------------------------------------------------------
class MoeMonitor:
    """What the engine does for MoE layers around each step: the auxiliary losses' gradient scale before a
    backward, and after the optimizer step the bias balancing and the metrics (tokens per expert, MaxVio,
    dropped fraction, aux/z/sequence losses, all-to-all bytes), summed over the ranks routing different tokens
    (the data-parallel ranks, cp's shards of the sequences, and sequence parallelism's tp ranks).

    Nothing is read to the host except on a reporting step (``every``: the log steps, and step 1). Under bias
    balancing the counts are summed over the ranks every step on the device (one small all-reduce) and the
    biases moved there; the reported figures cover the steps since the last report."""

    def __init__(self, model: nn.Module, topo: Any, comm: Any, every: int = 1, bias: bool | None = None,
                 sequence_parallel: bool = False) -> None:
        """``model``: this rank's part (a pipeline stage may hold no MoE layer); ``bias``: whether any MoE layer
        of the whole model balances by bias (the same on every stage; default: this part's layers);
        ``sequence_parallel``: the tp ranks' MoE layers route their own sequence shards (their counts add too)."""
        self.layers: list[MoE] = moe_layers(model)
        self.topo, self.comm = topo, comm
        # the ranks routing different tokens: the data-parallel ranks, the cp ranks' shards, sp's tp ranks' shards
        axes = ("dp_cp", "tp") if sequence_parallel and topo.degree("tp") > 1 else ("dp_cp",)
        self.ranks = math.prod(topo.degree(a) for a in axes)
        self.group = topo.group(*axes) if self.ranks > 1 else None
        self.every = max(1, every)
        self.bias = any(layer.balance == "bias" for layer in self.layers) if bias is None else bias
        self.stages = topo.degree("pp") if topo.mesh is not None else 1  # figures gathered over the stages
        self._loads: torch.Tensor | None = None  # under bias balancing: summed loads since the last report

    def set_grad_scale(self, scale: float) -> None:
        for layer in self.layers:
            layer.grad_scale = scale

    def after_step(self, step: int) -> list[dict[str, Any]] | None:
        """Move the balancing biases (under bias balancing) and, on a reporting step, return the per-layer
        metrics of every stage's layers in model order (None on the other steps)."""
        if self.bias and self.layers:
            self._balance()
        if not (step % self.every == 0 or step == 1):
            return None
        out = self._local_metrics() if self.layers else []
        if self.stages > 1:  # every stage's layers, in model order, on every rank
            parts: list = [None] * self.stages
            dist.all_gather_object(parts, out, group=self.topo.group("pp"))
            out = [m for part in parts for m in part]
        return out

    def _balance(self) -> None:
        """The step's loads summed over the data-parallel ranks and the biases moved, on the device."""
        flat = torch.cat([layer.load for layer in self.layers])
        if self.ranks > 1:
            self.comm.all_reduce_sum(flat, self.group, name="moe loads")
        for layer, load in zip(self.layers, flat.split([layer.num_experts for layer in self.layers]), strict=True):
            layer.update_bias(load)
            layer.load.zero_()
        self._loads = flat if self._loads is None else self._loads + flat

    def _local_metrics(self) -> list[dict[str, Any]]:
        sizes = [layer.num_experts for layer in self.layers]
        parts = [layer.stats_acc for layer in self.layers]
        if not self.bias:
            parts = [layer.load for layer in self.layers] + parts
        flat = torch.cat(parts)
        if self.ranks > 1:
            self.comm.all_reduce_sum(flat, self.group, name="moe statistics")
        if self.bias:
            loads = self._loads if self._loads is not None else torch.zeros(sum(sizes), dtype=torch.float64)
            self._loads = None
        else:
            loads, flat = flat[:sum(sizes)], flat[sum(sizes):]
        per_layer = loads.cpu().split(sizes)  # the host read, on a reporting step only
        stats = flat.view(len(self.layers), len(STATS)).tolist()
        out: list[dict[str, Any]] = []
        for layer, load, (dropped, total, aux, z, seq, forwards) in zip(self.layers, per_layer, stats, strict=True):
            a2a = float(getattr(layer.dispatcher, "bytes_sent", 0))
            per = 1.0 / forwards if forwards else 0.0
            out.append({"tokens_per_expert": [int(v) for v in load.tolist()], "max_violation": max_violation(load),
                        "dropped_fraction": dropped / total if total else 0.0, "aux_loss": aux * per,
                        "z_loss": z * per, "seq_aux_loss": seq * per, "a2a_bytes": 2 * a2a})
            if not self.bias:
                layer.load.zero_()
            layer.stats_acc.zero_()
            if hasattr(layer.dispatcher, "bytes_sent"):
                layer.dispatcher.bytes_sent.zero_()
        return out
