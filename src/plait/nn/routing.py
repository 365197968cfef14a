"""Routers and balancing losses of ``plait.nn.MoE``: token choice, top-k, every shape static (no host read).

Scores (``score``), from router logits ``(N, E)`` computed in float32:

* ``softmax`` (Switch, GShard, Mixtral): ``p = softmax(logits)``; the gates are the chosen ``p``.
* ``sigmoid`` (DeepSeek-V3, arXiv:2412.19437 section 2.1.2, eq. 13-16): ``s = sigmoid(logits)``; the gates
  are the chosen ``s``. For the balancing losses the scores are normalised per token, ``p = s / sum_e s``.

Selection: a token's k experts are its k highest ``choice`` scores, ``score + bias`` under bias balancing,
ties to the lower expert index (a stable sort: the same on every rank and run). Group-limited top-k
(``num_groups`` > 1; DeepSeek-V3's node-limited routing, its ``n_group`` / ``topk_group``): the experts are cut
into ``num_groups`` equal groups of consecutive indices, each group scored by the sum of its two highest
choice scores, and only the ``topk_groups`` best groups (ties to the lower group) are chosen from. Gates are
renormalised to sum to 1 when ``top_k > 1`` (Mixtral/Qwen with softmax, DeepSeek-V3's ``norm_topk_prob`` with
sigmoid), then multiplied by ``route_scale`` (DeepSeek-V3's ``routed_scaling_factor``; 1 elsewhere). The bias
only chooses, it never weights.

Balancing losses (each a scalar that reaches the router through the backward pass, see ``plait.nn.moe``):

* ``switch_aux_loss``: Switch Transformer's (Fedus et al., arXiv:2101.03961 eq. 4-6), ``coef x E x
  sum_e f_e P_e`` over the micro-batch: ``f_e`` the share of the N k assignments routed to e (before capacity
  drops), ``P_e`` the mean of ``p_e`` over the N tokens.
* ``sequence_aux_loss``: DeepSeek-V3's complementary sequence-wise loss (eq. 17-20), ``coef x sum_e f_e P_e``
  per sequence of T tokens with ``f_e = E / (k T) x`` (assignments of the sequence to e) and ``P_e`` the mean of
  ``p_e`` over the sequence; averaged over the micro-batch's sequences. Any split of a batch into micro-batches
  or pipeline micro-batches that keeps sequences whole leaves each sequence's term unchanged.
* ``z_loss`` (ST-MoE, Zoph et al., arXiv:2202.08906 eq. 5): ``coef x mean_tokens(logsumexp(logits)^2)``.

A layer holding one of ``shards`` equal shards of each sequence (context or sequence parallelism) passes the whole
sequences' counts (``switch_aux_loss``'s ``counts``, ``sequence_aux_loss``'s ``whole``): each loss is then this shard's
term, ``f_e`` over the whole and ``P_e`` over the shard, and the mean of the terms over the shards is the loss of one
process on the whole sequences (``P_e`` of the whole is the mean of the shards').

Aux-loss-free balancing (``balance = "bias"``, DeepSeek-V3 section 2.1.2, Wang et al. arXiv:2408.15664): the
per-expert bias moves after each optimizer step by ``rate x sign(mean load - load_e)`` from the load observed
over the whole data-parallel world (``plait.nn.moe.MoE.update_bias``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

SCORES = ("softmax", "sigmoid")


@dataclass
class Routing:
    """One forward's routing, ``A = N k`` assignments in token order (token 0's k choices first), every shape
    static: a dropped assignment keeps its place with expert ``E`` (no expert) and weight 0."""

    tokens: torch.Tensor  # (A,) int64 token index in the flattened batch
    experts: torch.Tensor  # (A,) int64 global expert index; E where dropped
    weights: torch.Tensor  # (A,) float32 gate weight; 0 where dropped
    counts: torch.Tensor  # (E,) int64 assignments chosen per expert, before capacity drops
    dropped: torch.Tensor | None = None  # () int64 assignments dropped by capacity
    per_expert: int = 0  # the most assignments one expert can hold (a static bound: N, or the capacity)
    losses: torch.Tensor | None = None  # (3,) the detached aux, z and sequence losses, for the statistics


@dataclass(frozen=True)
class RouterSpec:
    """How a router scores and chooses (see the module docstring)."""

    num_experts: int
    top_k: int
    score: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    route_scale: float = 1.0

    def check(self) -> None:
        e, g = self.num_experts, self.num_groups
        if self.score not in SCORES:
            raise ValueError(f"moe.score={self.score!r}: choose one of {SCORES}")
        if g < 1 or e % g or not 1 <= self.topk_groups <= g:
            raise ValueError(f"moe.num_groups={g} must divide moe.num_experts={e}, and 1 <= moe.topk_groups="
                             f"{self.topk_groups} <= num_groups")
        if self.top_k > e // g * self.topk_groups:
            raise ValueError(f"moe.top_k={self.top_k} exceeds the experts of the moe.topk_groups={self.topk_groups} "
                             f"chosen groups ({e // g} each)")


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k highest of each row, ties to the lower index (a stable sort, unlike ``topk``)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def select(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(p, top, chosen, gates)`` for float32 ``logits (N, E)``: the per-token normalised scores the balancing
    losses use ``(N, E)``, the chosen experts ``(N, k)``, their scores (softmax or sigmoid, what capacity drops
    rank by) and their gate weights ``(N, k)``."""
    if spec.score == "softmax":
        score = p = logits.softmax(-1)
    else:
        score = logits.sigmoid()
        p = score / score.sum(-1, keepdim=True)
    choice = score.detach() if bias is None else score.detach() + bias
    if spec.num_groups > 1:
        n, e, g = choice.size(0), spec.num_experts, spec.num_groups
        grouped = choice.view(n, g, e // g)
        group_score = grouped.topk(min(2, e // g), dim=-1).values.sum(-1)  # (N, G): the two best of each group
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, _top(group_score, spec.topk_groups), True)
        choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(n, e)
    top = _top(choice, spec.top_k)  # (N, k)
    chosen = gates = score.gather(1, top)  # (N, k)
    if spec.top_k > 1:
        gates = gates / gates.sum(-1, keepdim=True)
    if spec.route_scale != 1.0:
        gates = gates * spec.route_scale
    return p, top, chosen, gates


def switch_aux_loss(p: torch.Tensor, counts: torch.Tensor, top_k: int, coef: float, shards: int = 1) -> torch.Tensor:
    """Switch's load-balancing loss over one micro-batch: ``p (N, E)``, ``counts (E,)`` assignments per expert.
    ``shards`` > 1: ``p`` is one of ``shards`` equal shards of the micro-batch's tokens (context or sequence
    parallelism) and ``counts`` the whole micro-batch's; the value is this shard's term, whose mean over the shards
    is the whole micro-batch's loss (``P_e`` is the mean of the shards' means)."""
    n, e = p.shape
    f = counts.to(p.dtype) / (n * shards * top_k)
    return coef * e * (f * p.mean(0)).sum()


def sequence_aux_loss(p: torch.Tensor, top: torch.Tensor, seq_len: int, coef: float, shards: int = 1,
                      whole: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss: ``p (N, E)`` and ``top (N, k)`` of ``N / seq_len`` whole
    sequences; the mean over the sequences of ``coef x sum_e f_e P_e``. ``shards`` > 1: the rows are one of
    ``shards`` equal shards of each sequence and ``whole`` sums a ``(B, E)`` tensor over the shards (the
    assignments of the whole sequences); the value is this shard's term, as in ``switch_aux_loss``."""
    n, e = p.shape
    k = top.size(1)
    b = n // seq_len
    hits = torch.zeros(b, e, dtype=p.dtype, device=p.device)
    hits.scatter_add_(1, top.reshape(b, seq_len * k), torch.ones(b, seq_len * k, dtype=p.dtype, device=p.device))
    if whole is not None:
        hits = whole(hits)
    f = hits * (e / (k * seq_len * shards))  # (B, E)
    prob = p.view(b, seq_len, e).mean(1)  # (B, E)
    return coef * (f * prob).sum(-1).mean()


def z_loss(logits: torch.Tensor, coef: float) -> torch.Tensor:
    return coef * torch.logsumexp(logits, -1).pow(2).mean()
