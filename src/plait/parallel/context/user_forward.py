"""The user's own forward under ``parallel.cp > 1``: ``model(...)`` on the whole micro-batch the loader gave.

``install`` wraps the forward of the model ``setup`` returns (a class whose registered spec routes it, plait's
GPT (``plait.parallel.train_spec.ContextRouting``: the names of its token ids and targets), or a Hugging Face causal
LM whose attention ``attention.route_hf`` routes), as torchtitan's and Accelerate's cp keep the user's forward. Inside
``p.forward_backward`` and ``p.evaluate`` the context split has already cut the batch (the cp attention is ``active``)
and the call passes through; any other call is cut here:

1. its tensors are taken by name (``input_ids``/``inputs_embeds`` or the spec's (GPT's ``idx``), ``labels``/
   ``shift_labels`` or the spec's (GPT's ``targets``), ``attention_mask``, ``position_ids``, ``doc_ids``); Hugging
   Face labels are shifted on the whole sequence and passed as ``shift_labels`` (transformers' own argument for labels
   shifted by the caller, what Accelerate's cp passes), so no target crosses a shard;
2. every (B, T, ...) tensor is cut to this rank's load-balanced shard (``sharding``), the model gets the global
   ``position_ids`` of its tokens, and a padding ``attention_mask`` becomes masking by ids in the cp attention
   (``sharding.padding_docs``); the decoder itself gets none, but a Hugging Face causal LM is given the whole (B, T)
   mask and its base model's pre-hook takes it out of the decoder's call (``install``): the causal LM's auxiliary MoE
   loss leaves the padding tokens out of the router logits, which are gathered whole, in token order
   (``plait.parallel.expert.apply.WholeRouterLogits``);
3. the loss is the model's sum over the shard's tokens divided by ``num_items_in_batch`` / cp, where
   ``num_items_in_batch`` is the caller's (from ``p.num_items_in_batch``, the value it has at cp=1: the cp ranks of
   a group read the same micro-batches, ``plait.engine.tokens``) or the whole micro-batch's real tokens,
   counted on the device (nothing read back). Backward's average over dp x cp then gives one process's gradient.
   The loss a rank returns is its shard's share (plus an MoE model's auxiliary term, taken over the whole sequences
   on every cp rank); their mean over cp is the whole sequence's loss, what ``StepInfo.loss`` (at log steps),
   ``global_loss`` and ``p.evaluate`` report (``ContextSplit.reduce_loss``);
4. called without labels (a loss the user computes from the logits), the logits come back whole, (B, T, V) in token
   order, gathered over cp by ``gather_sequence``, whose backward sums every rank's gradient and keeps this rank's
   shard (a reduce-scatter): the user's loss is the same on every cp rank (with ``p.num_items_in_batch`` as at
   cp=1), each rank's gradient is cp times its shard's share of it, and the average over cp divides that back.
   With labels nothing is gathered: ``.logits`` is
   the shard's (B, T / cp, V), in the shard's order, and no rank holds the whole sequence's logits (at long context
   the largest tensor of the step);
5. outside training (``model.eval()`` or ``torch.no_grad()``) the loss is the whole sequence's on every cp rank (the
   mean over cp of the shares of 3., one all-reduce of one number: a sum of the shards' losses would count an MoE
   model's auxiliary term cp times) and the logits are gathered whole, neither differentiable (plait's GPT given
   ``targets`` returns its loss so too).

The cut of a training call is kept (``last``) for ``p.backward``: ``ContextSplit.backward`` runs under it, since
activation checkpointing calls the attention layers again in backward and they need that call's document ids.

Refused with one message each: a model that is neither (its class named), a 4-D ``attention_mask``, generation
arguments (a cache, ``use_cache=True``, ``logits_to_keep``), per-layer outputs, ``return_dict=False``, and labels
for a model whose loss function does not take ``shift_labels``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from plait.components.losses import IGNORE_INDEX
from plait.parallel.context.allgather import _gather, _reduce_to_owners
from plait.parallel.context.attention import ContextAttention
from plait.parallel.context.sharding import ContextError, check_length, padding_docs, shard, shard_index
from plait.parallel.model_specs import spec_for

# Hugging Face arguments whose results a shard cannot give: (name, the value that is fine)
_HF_REFUSED = (("cache", None), ("past_key_values", None), ("use_cache", False), ("logits_to_keep", 0),
               ("output_hidden_states", False), ("output_attentions", False), ("return_dict", True))


class SequenceGather(torch.autograd.Function):
    """(B, S, V) shards of every cp rank -> (B, T, V) in token order. Forward: one all-gather over cp; backward: the
    gradients of every rank summed and this rank's shard kept (a reduce-scatter under NCCL; gloo has none: an
    all-reduce of the whole and this rank's slice)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        whole, perm = _gather(x, group)
        ctx.group, ctx.perm = group, perm
        return whole

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_to_owners(grad, ctx.perm, ctx.group), None


def gather_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's (B, S, V) logits -> the whole sequence's (B, T, V) in token order (see ``SequenceGather``)."""
    if isinstance(x, DTensor):
        raise ContextError("under parallel.cp > 1 with tensor parallelism the logits are sharded over the vocabulary; "
                           "pass labels to the model (it computes its loss on its shard), or run the micro-step with "
                           "p.forward_backward(model, batch)")
    return SequenceGather.apply(x, group)


def _kind(model: nn.Module) -> str | None:
    """"spec" (a class whose registered spec routes it: plait's GPT), "hf" (a transformers model taking input_ids,
    position_ids and labels), or None."""
    if getattr(spec_for(model), "context", None) is not None:
        return "spec"
    params = inspect.signature(type(model).forward).parameters
    transformers = any(c.__module__.startswith("transformers.") for c in type(model).__mro__)
    if transformers and {"input_ids", "position_ids", "labels"} <= set(params):
        return "hf"
    return None


class UserForward:
    """The forward ``install`` puts on the user's model (see the module docstring)."""

    def __init__(self, model: nn.Module, attention: ContextAttention, inner: Callable[..., Any]) -> None:
        self.model, self.attention, self.inner = model, attention, inner
        self.group, self.cp, self.rank = attention.group, attention.ring.size, attention.ring.rank
        self.kind = _kind(model)
        self.routing = spec_for(model).context if self.kind == "spec" else None
        self.signature = inspect.signature(type(model).forward)
        # the cut of the last training forward: ``ContextSplit.backward`` runs its backward under it, where
        # activation checkpointing calls the attention layers again (with its document ids)
        self.last: tuple[torch.Tensor, Any, bool] | None = None
        self.whole_mask = False  # the model takes the whole attention_mask (its decoder drops it: ``install``)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.attention.positions is not None:  # p.forward_backward / p.evaluate: the split cut the batch
            return self.inner(*args, **kwargs)
        if self.kind is None:
            raise ContextError(f"under parallel.cp > 1 plait cuts the sequences in the forward of plait's GPT and of "
                               f"Hugging Face causal LMs; {type(self.model).__name__}.forward is neither, so plait "
                               "cannot tell its inputs from its labels: run each micro-step with "
                               "p.forward_backward(model, batch) and evaluate with p.evaluate(model, batch)")
        named = self._named(args, kwargs)
        training = self.model.training and torch.is_grad_enabled()
        return self._own(named, training) if self.kind == "spec" else self._hf(named, training)

    def _named(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The call's arguments by name (``**kwargs`` merged in)."""
        bound = self.signature.bind(self.model, *args, **kwargs).arguments
        named = {k: v for k, v in list(bound.items())[1:]}  # without self
        for name, p in self.signature.parameters.items():
            if p.kind == inspect.Parameter.VAR_KEYWORD:
                named.update(named.pop(name, {}))
        return named

    def _cut(self, named: dict[str, Any], ids: torch.Tensor, training: bool
             ) -> tuple[dict[str, Any], torch.Tensor, Any, bool]:
        """This rank's shard of every (B, T, ...) argument, its global positions (the caller's, cut, or its own), the
        whole sequence's document ids for the cp attention and whether they stand for a padding mask (kept for the
        backward of a training call)."""
        B, T = ids.shape[:2]
        check_length(T, self.cp, "the batch's sequence length")
        index = shard_index(T, self.cp, self.rank, device=ids.device)  # (T / cp,)
        mask, docs = named.pop("attention_mask", None), named.get("doc_ids")
        if mask is not None:
            docs = padding_docs(mask, docs, T)
        positions = named.pop("position_ids", None)
        part = {k: shard(v, index, T) for k, v in named.items()}
        if positions is None:  # plait's GPT takes one (S,) row (``row_positions``), Hugging Face decoders (B, S)
            part["position_ids"] = index if self.routing is not None and self.routing.row_positions \
                else index.expand(B, -1)
        else:
            part["position_ids"] = positions.index_select(positions.dim() - 1, index.to(positions.device))
        if training:
            self.last = (index, docs, mask is not None)
        return part, index, docs, mask is not None

    def _items(self, labels: torch.Tensor, given: Any) -> Any:
        """The divisor of the shard's summed loss: the caller's (``p.num_items_in_batch``: what it would be at
        cp=1), else the whole micro-batch's real tokens (counted on the device), / cp: the shards' losses are
        averaged over cp (by backward's average in training, by ``_whole_loss`` outside it)."""
        items = given if given is not None else (labels != IGNORE_INDEX).sum().float()
        return items / self.cp

    def _whole_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Outside training: the shards' losses averaged over cp, not differentiable. A mean, not a sum: an MoE
        model's auxiliary term is the whole sequence's on every cp rank, once in each shard's loss."""
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=self.group)
        return loss / self.cp

    def _logits(self, logits: torch.Tensor, training: bool) -> torch.Tensor:
        if training:
            return gather_sequence(logits, self.group)
        with torch.no_grad():
            return gather_sequence(logits.detach(), self.group)

    def _own(self, named: dict[str, Any], training: bool) -> torch.Tensor:
        """A model its spec routes (plait's GPT): logits gathered whole, or with its targets (already the next
        tokens) its mean cross-entropy over the targets that count, computed as the shards' sums / the whole count."""
        targets = named.pop(self.routing.targets, None)
        part, index, docs, padded = self._cut(named, named[self.routing.inputs], training)
        with self.attention.active(index, docs, padded):
            logits = self.inner(**part)  # (B, S, V)
        if targets is None:
            return self._logits(logits, training)
        target = targets.index_select(1, index.to(targets.device))
        total = F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), ignore_index=IGNORE_INDEX,
                                reduction="sum")
        loss = total / self._items(targets, None)
        return loss if training else self._whole_loss(loss)

    def _hf(self, named: dict[str, Any], training: bool) -> Any:
        """A Hugging Face causal LM: its own loss on the shard over labels shifted whole (see the module docstring)."""
        name = type(self.model).__name__
        for arg, fine in _HF_REFUSED:
            value = named.get(arg)
            if isinstance(value, torch.Tensor) or value not in (fine, None):
                raise ContextError(f"parallel.cp > 1 runs {name} on sequence shards for training and evaluation; "
                                   f"{arg}={named[arg]!r} (generation, per-layer outputs, tuple outputs) is not "
                                   "supported under cp: leave it out, or run it with parallel.cp=1")
        ids = named.get("input_ids")
        ids = ids if ids is not None else named.get("inputs_embeds")
        if ids is None:
            raise ContextError(f"{name} under parallel.cp > 1 needs input_ids or inputs_embeds of the whole sequence")
        labels, shifted = named.pop("labels", None), named.pop("shift_labels", None)
        if labels is not None and shifted is None:  # transformers' shift, on the whole sequence
            shifted = F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
        if shifted is not None:
            self._check_loss(name)
            named["num_items_in_batch"] = self._items(shifted, named.get("num_items_in_batch"))
        named.setdefault("use_cache", False)  # a cache of a shard's keys serves no generation
        mask = named.get("attention_mask")
        part, index, docs, padded = self._cut(named, ids, training)
        if shifted is not None:
            part["labels"] = part["shift_labels"] = shifted.index_select(1, index.to(shifted.device))
        if padded and self.whole_mask:  # for the auxiliary MoE loss over the whole router logits (not the decoder's)
            part["attention_mask"] = mask
        with self.attention.active(index, docs, padded):
            out = self.inner(**part)
        if training:
            if shifted is None:
                out.logits = self._logits(out.logits, training)
            return out
        if out.loss is not None:
            out.loss = self._whole_loss(out.loss)
        out.logits = self._logits(out.logits, training)
        return out

    def _check_loss(self, name: str) -> None:
        """Labels need transformers' causal-LM loss, which takes ``shift_labels`` and ``num_items_in_batch``: a loss
        that shifted the shard's labels itself would pair tokens across the cut."""
        from transformers.loss.loss_utils import ForCausalLMLoss

        if getattr(self.model, "loss_function", None) is not ForCausalLMLoss:
            raise ContextError(f"parallel.cp > 1 computes {name}'s loss on each shard with labels shifted before the "
                               "cut, which needs transformers' ForCausalLMLoss, not this model's loss function; call "
                               "the model without labels and compute the loss from its logits (gathered whole), or "
                               "use parallel.cp=1")


def _no_mask(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """A Hugging Face decoder's forward pre-hook under cp: its ``attention_mask`` (the whole sequence's, which its
    causal LM takes for the auxiliary MoE loss) taken out; the cp attention masks the padding by ids."""
    if kwargs.get("attention_mask") is None:
        return None
    return args, {**kwargs, "attention_mask": None}


def install(model: nn.Module, attention: ContextAttention) -> UserForward:
    """Route ``model(...)`` through ``UserForward`` (around whatever forward the layout set: DDP, autocast); returns
    it. A Hugging Face causal LM's decoder (its ``base_model``) loses any ``attention_mask`` it is given
    (``_no_mask``)."""
    route = UserForward(model, attention, model.forward)
    decoder = getattr(model, "base_model", model)
    if route.kind == "hf" and decoder is not model:
        decoder.register_forward_pre_hook(_no_mask, with_kwargs=True)
        route.whole_mask = True

    def forward(*args: Any, **kwargs: Any) -> Any:  # a function: copy.deepcopy(model) shares it, copies no group
        return route(*args, **kwargs)

    model.forward = forward
    return route
