"""A mixture-of-experts feed-forward layer any model can use: ``plait.nn.MoE``.

Routing (token choice, top-k): router logits ``(N, E)`` are computed in float32 whatever the autocast
dtype; probabilities are their softmax. The k experts of a token are its k highest scores (probability,
plus the balancing bias with ``balance="bias"``), ties broken by the lower expert index (a stable sort,
the same on every rank and run). Gate weights are the chosen probabilities, renormalised to sum to 1
when ``top_k > 1`` (Mixtral/Qwen); the bias only chooses, it never weights.

Capacity (``capacity_factor`` > 0): each expert takes at most ``ceil(capacity_factor x N x k / E)``
assignments of this rank's N tokens per forward; the rest are dropped, by ``drop_policy``: ``probs``
keeps each expert's highest-probability assignments, ``position`` its earliest tokens. 0 is dropless.
A dropped assignment contributes zero; a token whose every assignment is dropped leaves the layer as
zeros, so the model's residual connection passes it through unchanged.

Balancing, ``balance``:
* ``aux``: the Switch load-balancing loss ``aux_loss_coef x E x sum_e f_e x P_e``, with ``f_e`` the fraction
  of this rank's assignments routed to expert e (before capacity drops) and ``P_e`` the mean router
  probability of e over this rank's tokens; both per forward (per micro-batch), per layer, on the local
  tokens. Under accumulation each micro-batch's aux loss enters that micro-batch's scaled loss, so a
  step's aux loss is the mean over its micro-batches, as the main loss is; over data-parallel ranks the
  gradients average, so it is the mean over ranks too. (GShard and Megatron normalise alike; DeepSpeed
  counts f_e over top-1 only.)
* ``bias``: auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for
  selection, moved after every optimizer step by ``bias_update_rate`` towards the experts that got fewer
  tokens than the mean (``update_bias``, with the counts summed over the data-parallel world).
* ``none``.
``z_loss_coef`` adds the router z-loss, ``z_loss_coef x mean_tokens(logsumexp(logits)^2)``.

The auxiliary and z losses reach the router through the backward pass without being added to the value
the model returns (Megatron's ``MoEAuxLossAutoScaler``): the layer's output carries them, and its
backward gives them gradient ``grad_scale``, which the engine sets to the scale of the main loss (loss
scale / accumulation), so a user's loss needs no change and pipeline stages need no extra channel. Their
values are kept in ``last_stats`` for metrics.

Experts: ``num_experts`` two-layer MLPs held as two batched weights ``w1 (E, C, H)`` and ``w2 (E, H, C)``
(expert parallelism shards their dim 0), plus ``shared_experts`` always-on MLPs. The dispatcher moves
tokens to experts and back: ``LocalDispatcher`` here; ``plait.parallel.expert.dispatch`` swaps in the all-to-all
one across ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

POLICIES = ("probs", "position")
BALANCES = ("aux", "bias", "none")


class _AuxLossInjector(torch.autograd.Function):
    """Forward: ``x`` unchanged. Backward: ``x``'s gradient through, and the layer's ``grad_scale`` (read
    at backward time, when the engine has set it for this backward) to ``aux`` (a scalar)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux: torch.Tensor, layer: MoE) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.layer = layer
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, float(ctx.layer.grad_scale)), None


@dataclass
class Routing:
    """One forward's routing: for every kept assignment its token, expert and gate weight."""

    tokens: torch.Tensor  # (A,) int64 token index in the flattened batch
    experts: torch.Tensor  # (A,) int64 global expert index
    weights: torch.Tensor  # (A,) float32 gate weight
    counts: torch.Tensor  # (E,) assignments chosen per expert, before capacity drops
    dropped: int = 0
    stats: dict[str, float] = field(default_factory=dict)


class LocalDispatcher:
    """All experts on this rank: group each expert's tokens, run it, and scatter the results back."""

    expert_offset = 0

    def __call__(self, x: torch.Tensor, routing: Routing, experts: GroupedExperts) -> torch.Tensor:
        return experts(x, routing.tokens, routing.experts - self.expert_offset)


class GroupedExperts(nn.Module):
    """``num_experts`` MLPs ``C -> H -> C`` (GELU), as batched weights ``w1 (E, C, H)``, ``w2 (E, H, C)``."""

    def __init__(self, num_experts: int, d_model: int, d_hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, d_model, d_hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, d_hidden, d_model))
        nn.init.normal_(self.w1, std=0.02)
        nn.init.normal_(self.w2, std=0.02 / math.sqrt(2))

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's experts' weights as plain tensors (a DTensor's local shard under expert parallelism)."""
        w1, w2 = self.w1, self.w2
        if hasattr(w1, "to_local"):
            w1, w2 = w1.to_local(), w2.to_local()
        return w1, w2

    def forward(self, x: torch.Tensor, tokens: torch.Tensor, local_experts: torch.Tensor) -> torch.Tensor:
        """Each row ``x[tokens[i]]`` through local expert ``local_experts[i]``; returns ``(A, C)`` in row order.

        Dispatchers call the module (not a method), once per MoE forward, so FSDP2's hooks gather its weights
        when the experts are sharded over the expert-data-parallel ranks (``parallel.zero=3``). Every local
        expert runs, on however many rows it got (zero included), so each expert weight takes
        part in the graph and its gradient is zeros, never None, when no token reached it."""
        w1, w2 = self.local_weights()
        order = torch.argsort(local_experts, stable=True)
        counts = torch.bincount(local_experts, minlength=w1.size(0)).tolist()
        xs = x.index_select(0, tokens.index_select(0, order))  # (A, C), grouped by expert: one gather
        outs, start = [], 0
        for e, n in enumerate(counts):
            h = F.gelu(xs[start:start + n] @ w1[e].to(x.dtype), approximate="tanh")  # (n, H)
            outs.append(h @ w2[e].to(x.dtype))  # (n, C)
            start += n
        grouped = torch.cat(outs) if outs else xs
        return grouped.new_empty(grouped.shape).index_copy(0, order, grouped)  # back to row order: one scatter


class MoE(nn.Module):
    """Mixture-of-experts feed-forward block: ``(B, T, C) -> (B, T, C)``; see the module docstring."""

    def __init__(self, d_model: int, d_hidden: int, num_experts: int, *, top_k: int = 2,
                 capacity_factor: float = 0.0, drop_policy: str = "probs", aux_loss_coef: float = 0.01,
                 z_loss_coef: float = 0.0, balance: str = "aux", shared_experts: int = 0,
                 bias_update_rate: float = 1e-3) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"moe.top_k={top_k} must be between 1 and moe.num_experts={num_experts}")
        if drop_policy not in POLICIES or balance not in BALANCES or capacity_factor < 0:
            raise ValueError(f"moe: drop_policy in {POLICIES}, balance in {BALANCES}, capacity_factor >= 0; got "
                             f"{drop_policy!r}, {balance!r}, {capacity_factor}")
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.aux_loss_coef, self.z_loss_coef, self.balance = aux_loss_coef, z_loss_coef, balance
        self.bias_update_rate = bias_update_rate
        self.router = nn.Linear(d_model, num_experts, bias=False)
        nn.init.normal_(self.router.weight, std=0.02)
        self.experts = GroupedExperts(num_experts, d_model, d_hidden)
        self.shared = nn.ModuleList(_SharedMLP(d_model, d_hidden) for _ in range(shared_experts))
        self.register_buffer("expert_bias", torch.zeros(num_experts))
        self.dispatcher: Any = LocalDispatcher()
        self.grad_scale = 1.0  # the main loss's scale, set by the engine before each backward
        self.load = torch.zeros(num_experts, dtype=torch.float64)  # assignments since the last bias update
        self.last_stats: dict[str, Any] = {}
        # Training forwards since the engine last read it: dropped, assignments, aux loss, z-loss, forwards.
        self.stats_acc = torch.zeros(5, dtype=torch.float64)

    def route(self, x: torch.Tensor) -> tuple[Routing, torch.Tensor]:
        """Routing of the ``(N, C)`` tokens and the balancing losses (a scalar, zero when none apply)."""
        n, e, k = x.size(0), self.num_experts, self.top_k
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.router.weight.float())  # (N, E), float32 whatever the autocast
        probs = logits.softmax(-1)  # (N, E)
        scores = probs.detach() + self.expert_bias if self.balance == "bias" else probs.detach()
        top = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]  # (N, k)
        gates = probs.gather(1, top)  # (N, k)
        if k > 1:
            gates = gates / gates.sum(-1, keepdim=True)
        tokens = torch.arange(n, device=x.device).repeat_interleave(k)  # (N k,)
        experts, weights = top.reshape(-1), gates.reshape(-1)
        counts = torch.bincount(experts, minlength=e)
        aux = z = logits.new_zeros(())
        if self.balance == "aux" and self.aux_loss_coef:
            f = counts.to(probs.dtype) / (n * k)
            aux = self.aux_loss_coef * e * (f * probs.mean(0)).sum()
        if self.z_loss_coef:
            z = self.z_loss_coef * torch.logsumexp(logits, -1).pow(2).mean()
        losses = aux + z
        routing = Routing(tokens, experts, weights, counts)
        if self.capacity_factor:
            routing = self._drop(routing, probs.detach()[tokens, experts], math.ceil(self.capacity_factor * n * k / e))
        routing.stats = {"aux_loss": float(aux.detach()), "z_loss": float(z.detach())}
        return routing, losses

    def _drop(self, r: Routing, priority: torch.Tensor, capacity: int) -> Routing:
        """Keep at most ``capacity`` assignments per expert, by the drop policy."""
        if self.drop_policy == "probs":  # highest router probability first, then earlier token, per expert
            order = torch.argsort(-priority, stable=True)
        else:
            order = torch.arange(len(r.experts), device=r.experts.device)
        order = order[torch.argsort(r.experts[order], stable=True)]  # grouped by expert, policy order within
        experts = r.experts[order]
        first = torch.searchsorted(experts, experts, right=False)
        rank_in_expert = torch.arange(len(experts), device=experts.device) - first
        keep = order[rank_in_expert < capacity]
        keep = keep.sort().values  # original assignment order
        return Routing(r.tokens[keep], r.experts[keep], r.weights[keep], r.counts,
                       dropped=len(r.experts) - len(keep), stats=r.stats)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # (N, C)
        routing, losses = self.route(tokens)
        expert_out = self.dispatcher(tokens, routing, self.experts)  # (A, C), assignment order
        out = torch.zeros_like(tokens).index_add(0, routing.tokens,
                                                 expert_out * routing.weights.to(expert_out.dtype)[:, None])
        for mlp in self.shared:
            out = out + mlp(tokens)
        self._record(routing, losses)
        if losses.requires_grad:
            out = _AuxLossInjector.apply(out, losses, self)
        return out.reshape(shape)

    def _record(self, routing: Routing, losses: torch.Tensor) -> None:
        """This forward's figures (training forwards only): ``load`` (counts since the last bias update),
        ``stats_acc`` (summed until the engine's ``MoeMonitor`` reads them at the step) and ``last_stats``."""
        if not self.training:
            return
        assignments = len(routing.tokens) + routing.dropped
        self.load += routing.counts.detach().to(torch.float64).cpu()
        self.last_stats = {"tokens_per_expert": routing.counts.tolist(), "dropped": routing.dropped,
                           "assignments": assignments, **routing.stats}
        self.stats_acc += torch.tensor([routing.dropped, assignments, routing.stats["aux_loss"],
                                        routing.stats["z_loss"], 1.0], dtype=torch.float64)

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
    """MaxVio: how far the most loaded expert is above the mean load, as a fraction of it."""
    mean = float(load.mean())
    return float(load.max()) / mean - 1.0 if mean > 0 else 0.0
