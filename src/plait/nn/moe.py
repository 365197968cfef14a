"""A mixture-of-experts feed-forward layer any model can use: ``plait.nn.MoE``.

Routing (``plait.nn.routing``): token choice, top-k, router logits ``(N, E)`` in float32 whatever the autocast
dtype; softmax or sigmoid scores, group-limited top-k, ties to the lower expert index, gates renormalised when
``top_k > 1``. Every shape in the layer is static and nothing is read to the host: a forward launches without
waiting for the device, and torch.compile traces it as one graph.

Capacity (``capacity_factor`` > 0): each expert takes at most ``ceil(capacity_factor x N x k / E)``
assignments of this rank's N tokens per forward; the rest are dropped, by ``drop_policy``: ``probs``
keeps each expert's highest-probability assignments, ``position`` its earliest tokens. 0 is dropless.
A dropped assignment contributes zero; a token whose every assignment is dropped leaves the layer as
zeros, so the model's residual connection passes it through unchanged.

Balancing, ``balance``:
* ``aux``: the Switch load-balancing loss ``aux_loss_coef x E x sum_e f_e x P_e`` (``routing.switch_aux_loss``),
  per forward (per micro-batch), per layer, on the micro-batch's whole sequences. Under accumulation each
  micro-batch's aux loss enters that micro-batch's scaled loss, so a step's aux loss is the mean over its
  micro-batches, as the main loss is; over data-parallel ranks the gradients average, so it is the mean over
  ranks too. (GShard and Megatron normalise alike; DeepSpeed counts f_e over top-1 only.)
* ``bias``: auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for
  selection, moved after every optimizer step by ``bias_update_rate`` towards the experts that got fewer
  tokens than the mean (``update_bias``, with the counts summed over every rank routing other tokens).
* ``none``.
``seq_aux_loss_coef`` adds DeepSeek-V3's sequence-wise balance loss (any ``balance``; DeepSeek-V3 pairs it with
``bias`` at a tiny coefficient) and ``z_loss_coef`` the router z-loss.

Where a rank holds one shard of every sequence (context parallelism; sequence parallelism's tensor-parallel ranks),
``tokens`` (installed by ``plait.parallel.expert.apply``; ``WholeTokens`` by default) sums the expert counts over the
shards in the forward: each shard's term of the Switch and sequence-wise losses is then the shard's part of the whole
sequences' loss, whose mean over the shards is that loss (and the z-loss a mean over tokens already), so the losses
and their gradients equal one process's on the whole sequences. Capacity stays per rank's tokens.

The balancing losses reach the router through the backward pass without being added to the value the model
returns (Megatron's ``MoEAuxLossAutoScaler``): the layer's output carries them, and its backward gives them
gradient ``grad_scale``, which the engine sets to the scale of the main loss (loss scale / accumulation), so a
user's loss needs no change and pipeline stages need no extra channel. ``grad_scale`` is held in a tensor the
backward reads when it runs, so a compiled graph sees each step's value.

Statistics stay on the device: ``load`` (assignments per expert since the last bias update), ``stats_acc``
(dropped, assignments, aux, z and sequence losses, forwards since the engine last read them) and the last
forward's figures (``last_stats``, read on demand). The engine's ``MoeMonitor`` reads them at log steps only.

Experts: ``num_experts`` two-layer MLPs as 3-D weights (``plait.nn.experts.GroupedExperts``: one grouped GEMM per
weight where the device allows; expert parallelism shards their dim 0), plus ``shared_experts`` always-on MLPs.
The dispatcher moves assignments to experts and back: ``LocalDispatcher`` here;
``plait.parallel.expert.dispatch`` swaps in the all-to-all one across ranks.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.nn.experts import GroupedExperts, count_ids
from plait.nn.routing import RouterSpec, Routing, select, sequence_aux_loss, switch_aux_loss, z_loss

POLICIES = ("probs", "position")
BALANCES = ("aux", "bias", "none")
STATS = ("dropped", "assignments", "aux_loss", "z_loss", "seq_aux_loss", "forwards")

__all__ = ["MoE", "GroupedExperts", "LocalDispatcher", "Routing", "max_violation", "moe_layers"]


class _AuxLossInjector(torch.autograd.Function):
    """Forward: ``x`` unchanged. Backward: ``x``'s gradient through, and ``scale`` (a tensor the engine fills
    before each backward) as the gradient of ``aux`` (a scalar)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.scale = scale  # not saved for backward: filled in place after this forward, read when backward runs
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, ctx.scale.clone(), None


class WholeTokens:
    """The layer sees whole sequences (the default): its balancing statistics are its own tokens'.

    Under context or sequence parallelism a rank holds one of ``shards`` equal shards of every sequence; plait's
    expert dimension then installs an object of the same shape (``plait.parallel.expert.apply.ShardedTokens``):
    ``sum`` adds a statistic over the ranks holding the other shards, and ``summed`` counts those of them whose
    gradients are summed (sequence parallelism's tensor-parallel ranks) rather than averaged (context
    parallelism's, averaged with the data-parallel ranks)."""

    shards = 1
    summed = 1

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return t


class LocalDispatcher:
    """All experts on this rank: group each expert's assignments, run it, and return them in assignment order."""

    expert_offset = 0

    def __call__(self, x: torch.Tensor, routing: Routing, experts: GroupedExperts) -> torch.Tensor:
        return experts(x, routing.tokens, routing.experts - self.expert_offset, cap=routing.per_expert)


class MoE(nn.Module):
    """Mixture-of-experts feed-forward block: ``(B, T, C) -> (B, T, C)`` (or ``(N, C)``); see the module docstring."""

    def __init__(self, d_model: int, d_hidden: int, num_experts: int, *, top_k: int = 2,
                 capacity_factor: float = 0.0, drop_policy: str = "probs", aux_loss_coef: float = 0.01,
                 z_loss_coef: float = 0.0, balance: str = "aux", shared_experts: int = 0,
                 bias_update_rate: float = 1e-3, score: str = "softmax", num_groups: int = 1,
                 topk_groups: int = 1, route_scale: float = 1.0, seq_aux_loss_coef: float = 0.0,
                 experts: str = "auto") -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"moe.top_k={top_k} must be between 1 and moe.num_experts={num_experts}")
        if drop_policy not in POLICIES or balance not in BALANCES or capacity_factor < 0:
            raise ValueError(f"moe: drop_policy in {POLICIES}, balance in {BALANCES}, capacity_factor >= 0; got "
                             f"{drop_policy!r}, {balance!r}, {capacity_factor}")
        self.spec = RouterSpec(num_experts, top_k, score, num_groups, topk_groups, route_scale)
        self.spec.check()
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.aux_loss_coef, self.z_loss_coef, self.balance = aux_loss_coef, z_loss_coef, balance
        self.seq_aux_loss_coef, self.bias_update_rate = seq_aux_loss_coef, bias_update_rate
        self.router = nn.Linear(d_model, num_experts, bias=False)
        nn.init.normal_(self.router.weight, std=0.02)
        self.experts = GroupedExperts(num_experts, d_model, d_hidden, experts)
        self.shared = nn.ModuleList(_SharedMLP(d_model, d_hidden) for _ in range(shared_experts))
        self.register_buffer("expert_bias", torch.zeros(num_experts))
        self.dispatcher: Any = LocalDispatcher()
        self.tokens: Any = WholeTokens()  # the shards of each sequence the balancing statistics are summed over
        # Plain tensors, not buffers: they are this rank's own figures (DDP would broadcast buffers) and
        # no checkpoint holds them; ``_apply`` moves them with the module.
        self._grad_scale = torch.ones((), dtype=torch.float32)  # the main loss's scale, filled by the engine
        self.load = torch.zeros(num_experts, dtype=torch.float64)  # assignments since the last bias update
        self.stats_acc = torch.zeros(len(STATS), dtype=torch.float64)  # since the engine last read them
        self._last = torch.zeros(num_experts + len(STATS) - 1, dtype=torch.float64)  # the last forward's

    # -- state the module moves with it -----------------------------------------------------------------
    def _apply(self, fn: Any, recurse: bool = True) -> MoE:
        super()._apply(fn, recurse)
        device = self.expert_bias.device
        for name in ("_grad_scale", "load", "stats_acc", "_last"):
            t = getattr(self, name)
            if t.device != device:  # device only: these keep their dtype whatever the model is cast to
                setattr(self, name, torch.zeros_like(t, device=device) if t.is_meta or device.type == "meta"
                        else t.to(device))
        return self

    @property
    def grad_scale(self) -> float:
        return float(self._grad_scale)

    @grad_scale.setter
    def grad_scale(self, value: float) -> None:
        self._grad_scale.fill_(value)  # in place: a compiled graph reads the tensor, not a constant

    @property
    def last_stats(self) -> dict[str, Any]:
        """The last training forward's figures (a host read: for tests and interactive use, not the step)."""
        last = self._last.tolist()
        e = self.num_experts
        out: dict[str, Any] = {"tokens_per_expert": [int(v) for v in last[:e]]}
        out.update({name: v for name, v in zip(STATS[:-1], last[e:], strict=True)})
        out["dropped"], out["assignments"] = int(out["dropped"]), int(out["assignments"])
        return out

    # -- routing -----------------------------------------------------------------------------------------
    def route(self, x: torch.Tensor, seq_len: int | None = None) -> tuple[Routing, torch.Tensor]:
        """Routing of the ``(N, C)`` tokens (whole sequences of ``seq_len``; default one of N) and the balancing
        losses (a scalar, zero when none apply)."""
        n, e, k = x.size(0), self.num_experts, self.top_k
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.router.weight.float())  # (N, E), float32 whatever the autocast
        p, top, chosen, gates = select(logits, self.spec, self.expert_bias if self.balance == "bias" else None)
        tokens = torch.arange(n, device=x.device).repeat_interleave(k)  # (N k,)
        experts, weights = top.reshape(-1), gates.reshape(-1)
        counts = count_ids(experts, e)
        zero = logits.new_zeros(())
        shards = self.tokens.shards  # > 1: this rank's rows are one shard of each sequence
        aux = zero
        if self.balance == "aux" and self.aux_loss_coef:
            whole = self.tokens.sum(counts) if shards > 1 else counts  # the whole sequences' assignments
            aux = switch_aux_loss(p, whole, k, self.aux_loss_coef, shards)
        seq = zero
        if self.seq_aux_loss_coef:
            seq = sequence_aux_loss(p, top, seq_len or n, self.seq_aux_loss_coef, shards,
                                    self.tokens.sum if shards > 1 else None)
        z = z_loss(logits, self.z_loss_coef) if self.z_loss_coef else zero
        routing = Routing(tokens, experts, weights, counts, torch.zeros((), dtype=torch.int64, device=x.device), n,
                          torch.stack([aux, z, seq]).detach())
        if self.capacity_factor:
            routing = self._drop(routing, chosen.detach().reshape(-1), math.ceil(self.capacity_factor * n * k / e))
        # each shard's term averages to the whole's over the shards; where the shards' gradients add (sequence
        # parallelism) each carries its share
        return routing, (aux + z + seq) / self.tokens.summed

    def _drop(self, r: Routing, priority: torch.Tensor, capacity: int) -> Routing:
        """At most ``capacity`` assignments per expert, by the drop policy; the others marked dropped in place."""
        a = len(r.experts)
        if self.drop_policy == "probs":  # highest router probability first, then earlier token, per expert
            order = torch.argsort(-priority, stable=True)
        else:
            order = torch.arange(a, device=r.experts.device)
        order = order[torch.argsort(r.experts[order], stable=True)]  # grouped by expert, policy order within
        first = r.counts.cumsum(0) - r.counts  # (E,) first position of each expert in that order
        rank = torch.arange(a, device=order.device) - first.index_select(0, r.experts.index_select(0, order))
        kept = torch.empty_like(rank, dtype=torch.bool).index_copy_(0, order, rank < capacity)  # assignment order
        experts = torch.where(kept, r.experts, self.num_experts)
        weights = torch.where(kept, r.weights, 0.0)
        return Routing(r.tokens, experts, weights, r.counts, (~kept).sum(), min(capacity, r.per_expert), r.losses)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # (N, C)
        routing, losses = self.route(tokens, shape[-2] if x.dim() == 3 else None)
        expert_out = self.dispatcher(tokens, routing, self.experts)  # (A, C), assignment order, zeros where dropped
        weighted = expert_out * routing.weights.to(expert_out.dtype)[:, None]
        out = weighted.view(tokens.size(0), self.top_k, -1).sum(1)  # a token's k results, in its choice order
        for mlp in self.shared:
            out = out + mlp(tokens)
        self._record(routing)
        if losses.requires_grad:
            out = _AuxLossInjector.apply(out, losses, self._grad_scale)
        return out.reshape(shape)

    def _record(self, routing: Routing) -> None:
        """This training forward's figures, accumulated on the device (no host read): ``load``, ``stats_acc``
        and the last forward's."""
        if not self.training:
            return
        counts = routing.counts.detach().to(torch.float64)
        dropped = routing.dropped.to(torch.float64).reshape(1)
        assignments = torch.full((1,), float(len(routing.tokens)), dtype=torch.float64, device=counts.device)
        figures = torch.cat([dropped, assignments, routing.losses.to(torch.float64)])
        self.load += counts
        self.stats_acc += torch.cat([figures, figures.new_ones(1)])
        self._last.copy_(torch.cat([counts, figures]))

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """Auxiliary-loss-free balancing: ``bias_e += rate x sign(mean load - load_e)`` from the step's
        assignment counts ``load`` (summed over every data-parallel rank: the same on each)."""
        if self.balance == "bias":
            self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load).to(self.expert_bias)


class _SharedMLP(nn.Module):
    def __init__(self, d_model: int, d_hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, d_hidden)
        self.proj = nn.Linear(d_hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def max_violation(load: torch.Tensor) -> float:
    """MaxVio: how far the most loaded expert is above the mean load, as a fraction of it (a host read)."""
    mean = float(load.mean())
    return float(load.max()) / mean - 1.0 if mean > 0 else 0.0
