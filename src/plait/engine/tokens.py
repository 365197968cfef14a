"""``Plait``'s token counting (a mixin): the divisor that makes a summed loss one mean over the real tokens of the
whole optimizer step (``num_items_in_batch``), as transformers counts ``num_items_in_batch``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from plait.components.losses import IGNORE_INDEX, resolve_loss
from plait.engine.collectives import explained
from plait.parallel.capabilities import agreement
from plait.parallel.errors import PlaitError


class TokenCounting:
    """``num_items_in_batch`` and what it needs, for ``Plait`` (which provides the attributes used here)."""

    comm: Any
    topology: Any
    group: Any
    device: torch.device
    window: Any
    loss: Any

    @explained
    def num_items_in_batch(self, batches: Any, loss_fn: Any = None, *, shift: bool = True) -> torch.Tensor:
        """The divisor that makes a summed loss one mean over the real tokens of the whole optimizer step.

        ``batches``: this rank's labels of every micro-batch of the optimizer step (a tensor or a list of them:
        Hugging Face labels, ``-100`` where a token does not count), or its micro-batches (dicts with
        ``labels``, or any batch ``loss_fn`` counts; ``loss_fn`` defaults to the one given to setup). Labels are
        counted after the causal-LM shift (``labels[..., 1:]``; ``shift=False`` counts them as they are), as
        transformers counts ``num_items_in_batch``. The counts are summed over the data-parallel ranks (one
        all-reduce of one number when dp > 1; the only collective, on the device, nothing read back) and divided
        by the micro-steps and ranks ``backward`` averages over (accumulation x the ranks gradients are averaged
        over; under context parallelism the data-parallel ranks only, the value of cp=1: the model's forward divides
        a shard's loss by cp itself), so that ``loss = token_losses.sum() / n`` per micro-step, or a Hugging Face
        model's ``model(**batch, num_items_in_batch=n).loss``, through ``backward`` weighs every real token of the
        step ``1 / N``. Returns a 0-dim float32 tensor on this rank's device; every data-parallel rank must call it."""
        strategy = self._require_strategy()
        if not self.model_whole:
            raise PlaitError("num_items_in_batch: under pipeline parallelism the last stage computes the loss per "
                             "pipeline micro-batch; use the mean loss given to setup (loss_fn)")
        if not self.weighs_tokens:
            raise PlaitError("num_items_in_batch: the data-parallel ranks of this layout run at their own pace (an "
                             "asynchronous parameter server), so no step's token count is shared; use a mean loss")
        items = list(batches) if isinstance(batches, list | tuple) else [batches]
        if not items:
            raise PlaitError("num_items_in_batch() got no labels: pass every micro-batch's labels of the step")
        counts = [self._count_items(b, loss_fn, shift) for b in items]
        ranks = _items_ranks(strategy)
        divisor = ranks * self.window.accumulation
        alone = self.dp == 1 or ranks == 1  # nothing to sum over the data-parallel group
        # Host counts are added on the host and filled in on the device (a kernel, not a copy that waits for the
        # stream); counts of labels already on the device stay there: nothing is read back.
        host = sum(int(c.numpy()) for c in counts if c.device.type == "cpu")  # numpy: no tensor read is dispatched
        on_device = [c for c in counts if c.device.type != "cpu"]
        if alone and not on_device:  # one fill, the step's only op here
            return self._items_fill(host)
        total = torch.full((1,), float(host), dtype=torch.float64, device=self.device)
        for c in on_device:
            total += c.to(device=self.device, dtype=torch.float64)
        if not alone:
            self._meet()
            # the layout's data-parallel ranks (one DiLoCo replica's; every one otherwise)
            self.comm.all_reduce_sum(total, strategy.topo.dp_group, name="num_items_in_batch")
        return (total[0] / divisor).float()

    def num_items_known(self, per_rank: int) -> torch.Tensor:
        """``num_items_in_batch`` for a step whose count is known without counting: ``per_rank`` items on this
        rank over the optimizer step's micro-steps, the same on every rank whose counts ``num_items_in_batch``
        would sum (e.g. whole batches of a data set whose every target counts). Nothing is counted or
        communicated: one fill on this rank's device."""
        return self._items_fill(per_rank * _items_ranks(self._require_strategy()))

    def _items_fill(self, total: int) -> torch.Tensor:
        """The divisor for ``total`` items summed over the ranks and micro-steps backward averages over."""
        divisor = _items_ranks(self._require_strategy()) * self.window.accumulation
        return torch.full((), total / divisor, dtype=torch.float32, device=self.device)

    @property
    def weighs_tokens(self) -> bool:
        """Whether ``num_items_in_batch`` applies: the model runs whole on each rank (not a pipeline) and the
        data-parallel ranks meet at every step (not an asynchronous parameter server)."""
        strategy = self._require_strategy()
        return self.model_whole and (self.dp == 1 or agreement(strategy, self.group)[0])

    def _count_items(self, batch: Any, loss_fn: Any, shift: bool) -> torch.Tensor:
        """One micro-batch's items: labels counted (HF convention), or what the loss counts in a batch."""
        if isinstance(batch, torch.Tensor):
            return ((batch[..., 1:] if shift else batch) != IGNORE_INDEX).sum()
        loss = resolve_loss(loss_fn) if loss_fn is not None else self.loss
        count = loss.count_items(batch) if loss is not None else None
        if count is None and isinstance(batch, Mapping) and "shift_labels" in batch:
            return self._count_items(batch["shift_labels"], None, False)
        if count is None and isinstance(batch, Mapping) and "labels" in batch:
            return self._count_items(batch["labels"], None, shift)
        if count is None:
            raise PlaitError("num_items_in_batch: cannot count the items of a batch of type "
                             f"{type(batch).__name__}; pass the labels tensors (-100 where a token does not count)")
        return count


def _items_ranks(layout: Any) -> int:
    """The data-parallel ranks ``num_items_in_batch`` sums over and divides by: the layout's (one DiLoCo replica's),
    not dp x cp: the cp ranks of a group read the same micro-batches, so it is what it would be at cp=1 (a loss over
    a shard is divided by cp by the context split; a loss the user computes from the whole logits takes it as it
    is)."""
    return layout.topo.dp
