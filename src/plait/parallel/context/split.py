"""Context parallelism's model side (``apply_context``) and its micro-step (``ContextSplit``): each micro-batch's
sequence split over the context-parallel ranks.

``apply_context`` routes the model's attention layers through the cp attention (``attention``: plait's GPT, Hugging
Face Llama, Qwen2 and Mistral; a pipeline's GPT stages take their shard's positions). The engine gives whole
micro-batches (the cp ranks of a group read the same ones) and ``ContextSplit``:

1. splits the batch with the loss's own ``split``, so the causal-LM labels are shifted *before* the sequence is
   cut (no target crosses a shard);
2. keeps this rank's load-balanced shard of every (B, T, ...) tensor (``sharding``) and gives the model the
   global ``position_ids`` of its tokens (a batch's own, packed ones are sharded the same way);
3. runs the stages' micro-step with the model's attention routed through the cp attention, and the loss divided by
   real-token counts of the whole sequence: the engine's ``num_items_in_batch`` (over the optimizer step) or,
   without it, this micro-batch's count / cp, never a mean of the shards' means;
4. gradients: the gradient-sync policy averages them over dp x cp (the composition gives it the ``dp_cp`` ranks),
   which with the counts above is the gradient of one process on the whole sequence.

Evaluation runs the same shards and sums the shards' (sum / count) over the cp group: one all-reduce of one number.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from plait.components.losses import IGNORE_INDEX, Loss
from plait.config import Config, ConfigError
from plait.parallel.context.attention import ContextAttention, route_gpt, route_hf
from plait.parallel.context.sharding import ContextError, check_length, shard, shard_index
from plait.parallel.pipeline.gpt import GPTStage
from plait.parallel.tensor.plan import local_value
from plait.topology import MeshAxis, Topology


class Shard(NamedTuple):
    """One rank's part of a micro-batch, already split into the model's inputs and the target."""

    args: tuple
    kwargs: dict
    target: torch.Tensor


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
    unsupported = [f"parallel.{k}={v}" for k, v, off in (("ep", p.ep, 1), ("mode", p.mode, "collective")) if v != off]
    if unsupported:
        raise ConfigError(f"parallel.cp={p.cp} composes with data parallelism, ZeRO 1-3, tensor (and sequence) "
                          f"parallelism, pipelines and activation checkpointing; {', '.join(unsupported)} with "
                          "context parallelism is not supported yet: set parallel.cp=1, or leave those at their "
                          "defaults")
    if degrees.get("dp_shard", 1) > 1 and degrees.get("dp_replicate", 1) > 1:
        raise ConfigError(f"parallel.dp_shard={p.dp_shard} (hybrid sharding) with parallel.cp={p.cp} is not "
                          "supported yet: set parallel.dp_shard=0 (ZeRO-3 then shards over every dp x cp rank)")
    if cfg.train.compile:
        raise ConfigError(f"train.compile={cfg.train.compile!r} with parallel.cp > 1 is not supported yet; set "
                          "train.compile=false")


def apply_context(model: nn.Module, topo: Topology, cfg: Config, whole: bool) -> ContextAttention | None:
    """Route ``model``'s attention through the cp attention (None: cp = 1, nothing to do). ``whole``: the model runs
    whole on each rank (else its pipeline stages are found here after the split: ``route_stages``)."""
    if topo.degree(MeshAxis.CP) == 1:
        return None
    attention = ContextAttention(topo.group(MeshAxis.CP), cfg.parallel.cp_impl)
    attention.gpt = route_gpt(model, attention)
    if whole and not (attention.gpt or route_hf(model, attention)):
        raise ContextError(f"parallel.cp > 1 routes the attention of plait's GPT and of Hugging Face Llama, Qwen2 "
                           f"and Mistral; {type(model).__name__} has no attention layer plait recognises: use one "
                           "of those models or parallel.cp=1")
    return attention


def route_stages(model: nn.Module, attention: ContextAttention) -> None:
    """A pipeline's stages under cp: plait's GPT stages only (they take their shard's positions from here)."""
    stages = [m for m in model.modules() if isinstance(m, GPTStage)]
    if not stages:
        raise ContextError("parallel.cp > 1 with parallel.pp > 1 runs plait's GPT (its pipeline stages embed each "
                           f"shard's global positions); {type(model).__name__}'s stages are not plait's GPT: use "
                           "parallel.pp=1 with cp, or parallel.cp=1")
    for stage in stages:  # positional inputs only: the first stage reads its shard's positions here
        stage.positions = lambda: attention.positions


class ContextSplit:
    """One micro-step on this rank's shard of the sequence (see the module docstring)."""

    def __init__(self, attention: ContextAttention, topo: Topology, stages: Any) -> None:
        self.attention, self.stages = attention, stages
        self.cp, self.cp_rank = topo.degree(MeshAxis.CP), topo.coord(MeshAxis.CP)
        self.group = topo.group(MeshAxis.CP)
        self._losses: dict[int, ShardLoss] = {}

    def _shard_loss(self, loss: Loss) -> ShardLoss:
        if id(loss) not in self._losses:
            self._losses[id(loss)] = ShardLoss(loss)
        return self._losses[id(loss)]

    def _split(self, batch: Any, loss: Any, divide: int) -> tuple[Shard, torch.Tensor, torch.Tensor, Any]:
        """This rank's shard of ``batch``, its global positions, the divisor of its summed loss (the engine's
        ``num_items_in_batch`` or the whole sequence's real tokens / ``divide``) and the whole sequence's
        ``doc_ids`` (packed documents; None without), which the cp attention masks by."""
        if not isinstance(loss, Loss) or not loss.counts_items:
            raise ContextError(f"parallel.cp > 1 needs a loss that counts its tokens, so the shards' losses add up to "
                               f"the whole sequence's: use loss causal_lm (got {getattr(loss, 'name', loss)!r})")
        args, kwargs, target = loss.split(batch)  # the causal-LM shift happens here, before the cut
        if "attention_mask" in kwargs:
            raise ContextError("parallel.cp > 1 does not take an attention_mask yet; leave it out of the batch")
        B, T = target.shape[:2]
        check_length(T, self.cp, "the batch's sequence length")
        index = shard_index(T, self.cp, self.cp_rank, device=target.device)  # (T / cp,)
        items = loss.items
        if items is None:
            items = (target != IGNORE_INDEX).sum().float() / divide
        docs = kwargs.get("doc_ids")
        kwargs = {k: shard(v, index, T) for k, v in kwargs.items()}
        if self.stages.model_whole:  # this rank's global positions (pipeline stages take theirs from the attention)
            kwargs.setdefault("position_ids", index if self.attention.gpt else index.expand(B, -1))
        part = Shard(tuple(shard(a, index, T) for a in args), kwargs, shard(target, index, T))
        return part, index, items, docs

    def forward_backward(self, model: nn.Module, batch: Any, loss: Any, scale: float,
                         before_backward: Callable[[float], None] | None = None,
                         times: dict[str, float] | None = None) -> torch.Tensor:
        part, index, items, docs = self._split(batch, loss, divide=self.cp)
        # a pipeline averages its micro-batches' losses, which here are each already over the micro-step's items
        parts = getattr(self.stages, "loss_parts", 1)
        with self.attention.active(index, docs), loss.per_items(items):
            value = self.stages.forward_backward(model, part, self._shard_loss(loss), scale * parts, before_backward,
                                                 times)
        return value * parts if parts != 1 else value

    def backward(self, loss: torch.Tensor, scale: float) -> None:
        raise ContextError("under parallel.cp > 1 plait splits each sequence itself: run each micro-step with "
                           "p.forward_backward(model, batch), not model(...) and p.backward(loss)")

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch: Any, loss: Any) -> torch.Tensor:
        """The whole sequence's mean loss on every cp rank: each shard's sum / the whole count, summed over cp."""
        part, index, items, docs = self._split(batch, loss, divide=1)
        with self.attention.active(index, docs), loss.per_items(items):
            value = local_value(self.stages.evaluate(model, part, self._shard_loss(loss))).float().reshape(1)
        value *= getattr(self.stages, "loss_parts", 1)  # a pipeline's mean over its micro-batches
        dist.all_reduce(value, group=self.group)
        return value[0]

    def report(self, impl: str) -> dict[str, Any]:
        return {"context_parallel": {"cp": self.cp, "impl": impl}}
