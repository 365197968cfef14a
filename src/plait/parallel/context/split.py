"""Context parallelism's model side (``apply_context``) and its micro-step (``ContextSplit``): each micro-batch's
sequence split over the context-parallel ranks.

``apply_context`` routes the model's attention layers through the cp attention: by the ``ContextRouting`` of the spec
registered for its class (plait's GPT, whose pipeline stages also take their shard's positions from it;
``plait.parallel.train_spec``), else Hugging Face Llama, Qwen2, Mistral, Mixtral and Qwen3-MoE (``attention.route_hf``).
The engine gives whole micro-batches (the cp ranks of a group read the same ones) and ``ContextSplit``:

1. splits the batch with the loss's own ``split``, so the causal-LM labels are shifted *before* the sequence is
   cut (no target crosses a shard);
2. keeps this rank's load-balanced shard of every (B, T, ...) tensor (``sharding``) and gives the model the
   global ``position_ids`` of its tokens (a batch's own, packed ones are sharded the same way); a padding
   ``attention_mask`` becomes masking by ids in the cp attention (``sharding.padding_docs``);
3. runs the stages' micro-step with the model's attention routed through the cp attention, and the loss divided by
   real-token counts of the whole sequence / cp: the engine's ``num_items_in_batch`` (over the optimizer step; the
   value it has at cp=1, ``plait.engine.tokens``) or, without it, this micro-batch's count, never a mean of the
   shards' means;
4. gradients: the gradient-sync policy averages them over dp x cp (the composition gives it the ``dp_cp`` ranks; under
   HSDP its shard groups span ``dp_shard x cp``), which with the counts above is the gradient of one process on the
   whole sequence; expert gradients are summed over the ranks holding the same experts, cp's included, and MoE
   balancing statistics over the shards of each sequence (``plait.parallel.expert``).

Compiled (``train.compile``: the whole model, and with the loss under ``forward_backward``, or its blocks): the cp
attention composes at either unit, so cp does not ask for blocks (``compose.compile_blocks_because``). Dynamo
traces the cut of the user's forward and the ``alltoall`` and ``allgather`` attention (it rewrites their c10d
collectives into functional ones, forward and backward: no graph break; plait's GPT under ``alltoall`` is one graph
with its loss); the ring's point-to-point transfers are not traceable, so the ring attention runs eagerly between
the graphs, one break per attention layer (``ring.ring_attention``).

The user's own loop (``model(...)``, ``p.backward(loss)``) cuts the batch in the model's forward instead
(``user_forward``, installed by ``install``); backward then runs under that forward's cut. A rank's loss is its
shard's share (sum / (the whole count / cp)); ``reduce_loss`` averages it over the cp group into the whole
sequence's: at log steps (``StepInfo.loss``), and for ``p.evaluate``, one all-reduce of the values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from plait.components.losses import IGNORE_INDEX, Loss
from plait.config import Config, ConfigError
from plait.parallel.context.attention import ContextAttention, route_hf
from plait.parallel.context.sharding import ContextError, check_length, padding_docs, shard, shard_index
from plait.parallel.context.user_forward import UserForward, install
from plait.parallel.model_specs import spec_for
from plait.parallel.tensor.plan import local_value
from plait.topology import MeshAxis, Topology


class Shard(NamedTuple):
    """One rank's part of a micro-batch, already split into the model's inputs and the target."""

    args: tuple
    kwargs: dict
    target: torch.Tensor


class Cut(NamedTuple):
    """How a micro-batch was cut: this rank's global positions (S,), the whole sequence's document ids (B, T) or
    None, and whether those stand for a padding mask (every layer masks by them): ``ContextAttention.active``'s."""

    index: torch.Tensor
    docs: torch.Tensor | None
    padded: bool


class ShardLoss(Loss):
    """The user's loss over a ``Shard``: its ``split`` is done (before the cut), its ``loss`` is the user's."""

    presplit = True  # a pipeline splits the shard with this loss, not with the one given to setup

    def __init__(self, base: Loss) -> None:
        super().__init__(name=base.name)
        self.base = base

    def split(self, batch: Any) -> tuple[tuple, dict, Any]:
        return batch.args, batch.kwargs, batch.target

    def loss(self, output: Any, target: Any) -> torch.Tensor:
        return self.base.loss(output, target)


def check_context(cfg: Config, degrees: dict[str, int]) -> None:
    """What context parallelism cannot compose with, each for a reason named in the message."""
    p = cfg.parallel
    if p.cp <= 1:
        return
    if p.mode != "collective":
        raise ConfigError(f"parallel.mode={p.mode} with context parallelism is not supported: a parameter server is "
                          "data parallelism with its own consistency, composed with no other layout; set "
                          "parallel.cp=1, or leave parallel.mode at its default")


def apply_context(model: nn.Module, topo: Topology, cfg: Config, whole: bool) -> ContextAttention | None:
    """Route ``model``'s attention through the cp attention (None: cp = 1, nothing to do). ``whole``: the model runs
    whole on each rank (else its pipeline stages are found here after the split: ``route_stages``)."""
    if topo.degree(MeshAxis.CP) == 1:
        return None
    attention = ContextAttention(topo.group(MeshAxis.CP), cfg.parallel.cp_impl)
    # the routing of the model's class; kept for its stages after a pipeline split and for its position ids' form
    attention.routing = getattr(spec_for(model), "context", None)
    routed = attention.routing.route(model, attention) if attention.routing is not None else 0
    if whole and not (routed or route_hf(model, attention)):
        raise ContextError(f"parallel.cp > 1 routes the attention of plait's GPT, of Hugging Face Llama, Qwen2 and "
                           f"Mistral and of a class whose registered spec routes it (plait.register_train_spec); "
                           f"{type(model).__name__} has no attention layer plait recognises: use one of those models "
                           "or parallel.cp=1")
    return attention


def route_stages(model: nn.Module, attention: ContextAttention) -> None:
    """A pipeline's stages under cp: routed by the spec of the model's class (their first stage takes its shard's
    positions from the cp attention), which must route them."""
    if attention.routing is None or not attention.routing.route(model, attention):
        raise ContextError("parallel.cp > 1 with parallel.pp > 1 runs plait's GPT, or a model whose registered spec "
                           "routes its pipeline stages (they embed each shard's global positions); "
                           f"{type(model).__name__}'s stages are not routed: use parallel.pp=1 with cp, or "
                           "parallel.cp=1")


class ContextSplit:
    """One micro-step on this rank's shard of the sequence (see the module docstring)."""

    def __init__(self, attention: ContextAttention, topo: Topology, stages: Any) -> None:
        self.attention, self.stages = attention, stages
        self.cp, self.cp_rank = topo.degree(MeshAxis.CP), topo.coord(MeshAxis.CP)
        self.group, self.device = topo.group(MeshAxis.CP), topo.device
        self._losses: dict[int, ShardLoss] = {}
        self.user: UserForward | None = None  # the user's forward, cut into shards (``install``)

    def install(self, model: nn.Module) -> None:
        """The user's ``model(...)`` cut into shards around the forward the layout routed (DDP, autocast)."""
        self.user = install(model, self.attention)

    def _shard_loss(self, loss: Loss) -> ShardLoss:
        if id(loss) not in self._losses:
            self._losses[id(loss)] = ShardLoss(loss)
        return self._losses[id(loss)]

    def _split(self, batch: Any, loss: Any) -> tuple[Shard, Cut, torch.Tensor]:
        """This rank's shard of ``batch``, how it was cut, and the divisor of its summed loss: (the engine's
        ``num_items_in_batch`` or the whole sequence's real tokens) / cp."""
        if not isinstance(loss, Loss) or not loss.counts_items:
            raise ContextError(f"parallel.cp > 1 needs a loss that counts its tokens, so the shards' losses add up to "
                               f"the whole sequence's: use loss causal_lm (got {getattr(loss, 'name', loss)!r})")
        args, kwargs, target = loss.split(batch)  # the causal-LM shift happens here, before the cut
        B, T = target.shape[:2]
        check_length(T, self.cp, "the batch's sequence length")
        index = shard_index(T, self.cp, self.cp_rank, device=target.device)  # (T / cp,)
        items = (loss.items if loss.items is not None else (target != IGNORE_INDEX).sum().float()) / self.cp
        mask, docs = kwargs.pop("attention_mask", None), kwargs.get("doc_ids")
        if mask is not None:
            docs = padding_docs(mask, docs, T)
        kwargs = {k: shard(v, index, T) for k, v in kwargs.items()}
        if self.stages.model_whole:  # this rank's global positions (pipeline stages take theirs from the attention)
            row = self.attention.routing is not None and self.attention.routing.row_positions
            kwargs.setdefault("position_ids", index if row else index.expand(B, -1))
        part = Shard(tuple(shard(a, index, T) for a in args), kwargs, shard(target, index, T))
        return part, Cut(index, docs, mask is not None), items

    def forward_backward(self, model: nn.Module, batch: Any, loss: Any, scale: float,
                         before_backward: Callable[[float], None] | None = None,
                         times: dict[str, float] | None = None) -> torch.Tensor:
        part, cut, items = self._split(batch, loss)
        # a pipeline averages its micro-batches' losses, which here are each already over the micro-step's items; the
        # MoE balancing losses of each pipeline micro-batch keep their 1 / parts
        parts = getattr(self.stages, "loss_parts", 1)
        balance = before_backward
        if before_backward is not None and parts != 1:
            balance = lambda s: before_backward(s / parts)  # noqa: E731
        with self.attention.active(*cut), loss.per_items(items):
            value = self.stages.forward_backward(model, part, self._shard_loss(loss), scale * parts, balance, times)
        return value * parts if parts != 1 else value

    def backward(self, loss: torch.Tensor, scale: float) -> None:
        """The backward of a loss from the user's own forward, under that forward's cut: activation checkpointing
        calls the attention layers again here, and they need its document ids."""
        cut = self.user.last if self.user is not None else None
        if cut is None:
            self.stages.backward(loss, scale)
            return
        self.user.last = None
        with self.attention.active(*cut):
            self.stages.backward(loss, scale)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch: Any, loss: Any) -> torch.Tensor:
        """This rank's share of the whole sequence's mean loss (its shard's sum / (the whole count / cp)), as in
        training: ``reduce_loss``, which ``p.evaluate`` applies, averages the shares over cp into the whole's."""
        part, cut, items = self._split(batch, loss)
        with self.attention.active(*cut), loss.per_items(items):
            value = local_value(self.stages.evaluate(model, part, self._shard_loss(loss)))
        return value * getattr(self.stages, "loss_parts", 1)  # a pipeline's mean over its micro-batches

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Losses (any shape) averaged over the cp group, then the stages': a rank's is its shard's share of the whole
        sequence's loss, or the whole one where the user computed it from gathered logits (the same on every cp
        rank), so the mean is the whole sequence's either way. One all-reduce, where the engine reduces (log steps,
        ``p.evaluate``)."""
        t = loss.detach().to(self.device, torch.float64, copy=True)  # on the device NCCL reduces on
        dist.all_reduce(t, group=self.group)
        return self.stages.reduce_loss((t / self.cp).to(loss.device))

    def report(self, impl: str) -> dict[str, Any]:
        return {"context_parallel": {"cp": self.cp, "impl": impl}}
