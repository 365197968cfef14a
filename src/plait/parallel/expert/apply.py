"""Expert parallelism's step of the composition (``apply_expert``: this rank's slice of the experts, and the shards of
each sequence the MoE layers' balancing statistics are summed over) and its config check (``check_expert``); the
gradients of the experts are ``plait.parallel.expert.sync``'s.

A Hugging Face MoE model computes its auxiliary load-balancing loss in its own forward from every layer's router
logits, as means over the tokens it saw. Where a rank sees a shard of each sequence (context parallelism; sequence
parallelism's tp ranks, whose MoE blocks route their own shards: ``plait.parallel.tensor.hf_sequence``) that would be
the shard's balance, not the sequence's: ``WholeRouterLogits`` gathers each layer's router logits over the shards
(one all-gather of ``N x E`` values per layer, only when the model outputs them: ``output_router_logits``) and puts
them in the sequences' token order, so the model's own loss is the whole sequence's on every rank, a padding
``attention_mask`` (which the model takes for that loss, whole: ``plait.parallel.context.user_forward``) included."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch import nn

from plait.config import Config
from plait.nn.moe import moe_layers
from plait.parallel.compile import check_compile
from plait.parallel.context.sharding import shard_index
from plait.parallel.expert.dispatch import check_expert_layout, shard_experts
from plait.parallel.expert.hf import find_moe_blocks, shard_hf_experts
from plait.topology import Topology


class ShardedTokens:
    """A rank's MoE layers see one of ``shards`` equal shards of every sequence (context parallelism; with sequence
    parallelism, the tensor-parallel ranks' shards too): the balancing losses take their expert counts over the whole
    sequences (``sum``: an all-reduce over ``group`` in the forward, of ``E`` counts per layer, or ``B x E`` for the
    sequence-wise loss; no gradient flows through it), so they equal one process's on the whole sequences
    (``plait.nn.moe.WholeTokens``). ``summed``: the ranks of the group whose gradients add (sequence parallelism's)."""

    def __init__(self, group: dist.ProcessGroup | None, shards: int, summed: int) -> None:
        self.group, self.shards, self.summed = group, shards, summed

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return fc.all_reduce(t, "sum", self.group)


class _GatherRows(torch.autograd.Function):
    """Forward: every rank's rows ``(N, ...)`` of ``group`` concatenated in rank order (an all-gather). Backward: the
    gradients of every rank summed, divided by ``summed``, and this rank's rows kept (an all-reduce and a slice: gloo
    has no reduce-scatter). The ranks of a context-parallel group each hold a share of the loss that the gradient sync
    averages, so their sum is the whole sequence's gradient of the rows; the ``summed`` ranks of sequence parallelism's
    tp group compute the same loss, whose gradient each counts once."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, summed: int) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        mine = dist.get_rank(group) * len(x)
        ctx.group, ctx.summed, ctx.rows = group, summed, slice(mine, mine + len(x))
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rows] / ctx.summed, None, None


class WholeRouterLogits:
    """A forward hook on a Hugging Face MoE model's base model: its ``router_logits`` (one ``(B x S, E)`` tensor per
    layer, of this rank's S tokens of each of the B sequences) replaced by those of the whole sequences, ``(B x T,
    E)`` in token order as one process has them (gathered by ``_GatherRows`` over ``tokens``, then reordered), from
    which the model computes its auxiliary loss (the module docstring): the order matters where the model weights
    the rows by a padding mask. ``cp``: the context-parallel degree, whose load-balanced split (``shard_index``)
    the reorder undoes; the tp ranks of sequence parallelism hold contiguous slices of their cp rank's shard."""

    def __init__(self, tokens: ShardedTokens, cp: int) -> None:
        self.tokens, self.cp = tokens, cp

    def __call__(self, module: nn.Module, args: Any, out: Any) -> Any:
        logits = getattr(out, "router_logits", None)
        if isinstance(logits, tuple):
            batch = out.last_hidden_state.shape[0]
            rows = [_GatherRows.apply(t, self.tokens.group, self.tokens.summed) for t in logits]
            order = self._order(rows[0].size(0) // batch, rows[0].device) if rows else None
            out.router_logits = tuple(self._in_order(r, batch, order) for r in rows)
        return out

    def _order(self, seq_len: int, device: torch.device) -> torch.Tensor | None:
        """Where each of the T token positions sits in the gathered rows of a sequence (None: already in order).
        The group's ranks are cp-major (the mesh's order): their shards of a sequence, side by side, hold the
        positions of cp rank 0's shard, then rank 1's..."""
        if self.cp == 1:
            return None
        held = torch.cat([shard_index(seq_len, self.cp, c, device=device) for c in range(self.cp)])  # (T,)
        return held.argsort()

    def _in_order(self, rows: torch.Tensor, batch: int, order: torch.Tensor | None) -> torch.Tensor:
        """(shards x B x S, E) gathered rows -> (B x T, E) rows of sequence b, token t at b x T + t."""
        shards, E = self.tokens.shards, rows.size(-1)
        whole = rows.view(shards, batch, -1, E).transpose(0, 1).reshape(batch, -1, E)  # (B, T, E) in rank order
        if order is not None:
            whole = whole.index_select(1, order)
        return whole.reshape(-1, E)


def token_axes(topo: Topology, sequence_parallel: bool) -> tuple[str, ...]:
    """The mesh axes whose ranks hold other tokens of the same sequences: cp, and tp under sequence parallelism (each
    tp rank's MoE layers route its own sequence shard)."""
    return ("cp", "tp") if sequence_parallel and topo.degree("tp") > 1 else ("cp",)


def apply_expert(model: nn.Module, topo: Topology, dispatcher: str, sequence_parallel: bool = False) -> nn.Module:
    """This rank's slice of the experts (dispatched by ``moe.dispatcher``): plait's MoE layers or a Hugging Face
    model's sparse blocks; and plait's MoE layers' balancing statistics summed over the shards of each sequence
    (``ShardedTokens``). The model unchanged at ep = 1 with whole sequences."""
    layers = moe_layers(model)
    if topo.ep > 1:
        shard = shard_experts if layers else shard_hf_experts
        shard(model, topo.ep, topo.coord("ep"), topo.ep_group, dispatcher)
    axes = token_axes(topo, sequence_parallel)
    shards = math.prod(topo.degree(a) for a in axes)
    if shards > 1:
        tokens = ShardedTokens(topo.group(*axes), shards, shards // topo.degree("cp"))
        for layer in layers:
            layer.tokens = tokens
        if not layers and find_moe_blocks(model):
            getattr(model, "base_model", model).register_forward_hook(WholeRouterLogits(tokens, topo.degree("cp")))
    return model


def check_expert(cfg: Config, degrees: dict[str, int]) -> None:
    """The MoE settings and expert parallelism's own (every config: an MoE model may run at ep = 1)."""
    check_expert_layout(cfg.moe, cfg.parallel)
    check_compile(cfg.train.compile, degrees["ep"], cfg.moe.dispatcher)
