"""Loss functions: how a batch becomes a forward call, and the forward's output a scalar loss.

A ``Loss`` has two parts, so pipeline parallelism can use it too (the first stage gets the model's
inputs, the last stage the target): ``split(batch) -> (args, kwargs, target)`` and
``loss(output, target) -> scalar``. Calling it, ``loss_fn(model, batch)``, runs both.

Built in:

* ``causal_lm``: next-token cross-entropy, mean over the tokens that count (or, inside ``per_items(n)``, their
  sum divided by ``n``: the whole optimizer step's real tokens weigh the same, see below). Batches are plait's
  ``(x, y)`` pairs whose ``y`` is already the next token of ``x`` (the text recipe), or Hugging Face
  dicts ``{"input_ids", "labels"?, "attention_mask"?}`` whose labels are the inputs themselves: they are
  shifted here, with ``-100`` (ignored) where no next token exists, as Hugging Face models shift inside.
  The output is logits ``(B, T, V)`` or an object with ``.logits``.
* ``hf``: the model computes its own loss: ``model(**batch).loss`` (labels in the batch); inside ``per_items(n)``
  the model gets ``num_items_in_batch=n`` (transformers' convention: it sums its token losses and divides by
  ``n``), for a model that takes it (``counts_items_for``).
* ``classification``: ``(x, y)`` with one class index per sample; cross-entropy of ``(B, K)`` logits.

Token weighting. With labels of ``-100`` (packed documents, padding, prompt masking) a mean per micro-batch lets a
micro-batch with few real tokens weigh as much as a full one. A loss that can count its items (``count_items``:
the causal-LM loss counts the targets that are not ``-100``) is computed, inside ``per_items(n)``, as the sum of its
token losses divided by ``n``: plait passes ``n`` = the real tokens of the whole optimizer step (every micro-step,
every data-parallel rank) divided by the micro-steps and ranks its backward averages over, so after that average
every real token weighs ``1 / N`` (``plait.Plait.num_items_in_batch``). Without ``per_items`` it is the mean.

A plain callable ``fn(output, target)`` is wrapped with the default split: ``(x, y, ...)`` calls
``model(x)`` with target ``y``; a dict calls ``model(**batch)`` without its ``labels``, which become the
target; a tensor calls ``model(batch)`` with no target.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.config import ConfigError

IGNORE_INDEX = -100


class LossError(ConfigError):
    """A loss function cannot be used with this model or batch; the message says what to change."""


def default_split(batch: Any) -> tuple[tuple, dict, Any]:
    """``(args, kwargs, target)`` of a batch by its shape (see the module docstring)."""
    if isinstance(batch, Mapping):
        kwargs = {k: v for k, v in batch.items() if k != "labels"}
        return (), kwargs, batch.get("labels")
    if isinstance(batch, list | tuple):
        if not batch:
            raise LossError("the batch is an empty sequence; a batch is (inputs, target), a dict, or a tensor")
        return (batch[0],), {}, batch[1] if len(batch) > 1 else None
    return (batch,), {}, None


def _logits(output: Any) -> torch.Tensor:
    logits = getattr(output, "logits", output)
    if not isinstance(logits, torch.Tensor):
        raise LossError(f"the loss needs logits: the model returned {type(output).__name__}, which is not a tensor "
                        "and has no .logits; pass a loss function for this model's output")
    return logits


class Loss:
    """A loss over ``loss(output, target)`` with the default batch ``split`` (see the module docstring)."""

    name = "custom"
    # inside ``per_items``: the divisor of the summed item losses (a 0-dim tensor); None: a mean per micro-batch
    items: torch.Tensor | None = None
    # whether ``count_items`` counts (the loss is then a sum over items inside ``per_items``)
    counts_items: bool = False

    def __init__(self, fn: Callable[[Any, Any], torch.Tensor] | None = None, name: str | None = None) -> None:
        self._fn = fn
        if name:
            self.name = name

    def count_items(self, batch: Any) -> torch.Tensor | None:
        """The items this loss sums over in ``batch`` (a 0-dim integer tensor on the batch's device, counted
        without reading it), or None for a loss that is a mean per micro-batch whatever ``per_items`` says."""
        return None

    def counts_items_for(self, model: nn.Module) -> bool:
        """Whether this loss counts items (``count_items``) with ``model``: ``counts_items`` by default."""
        return self.counts_items

    @contextlib.contextmanager
    def per_items(self, items: torch.Tensor | None) -> Iterator[None]:
        """Inside, a loss that counts items (``count_items``) returns the sum of its item losses divided by
        ``items`` instead of their mean (None: the mean)."""
        before, self.items = self.items, items
        try:
            yield
        finally:
            self.items = before

    def split(self, batch: Any) -> tuple[tuple, dict, Any]:
        return default_split(batch)

    def loss(self, output: Any, target: Any) -> torch.Tensor:
        if self._fn is None:
            raise NotImplementedError
        return self._fn(output, target)

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        args, kwargs, target = self.split(batch)
        return self.loss(model(*args, **kwargs), target)


class CausalLMLoss(Loss):
    """Next-token cross-entropy (float32), mean over tokens whose target is not ``-100`` (inside ``per_items(n)``
    their sum / ``n``)."""

    name = "causal_lm"
    counts_items = True

    def count_items(self, batch: Any) -> torch.Tensor:
        """The targets that are not ``-100`` (after the shift ``split`` applies)."""
        return (self.split(batch)[2] != IGNORE_INDEX).sum()

    def split(self, batch: Any) -> tuple[tuple, dict, Any]:
        if isinstance(batch, Mapping):
            if "input_ids" not in batch:
                raise LossError("a causal-LM dict batch needs 'input_ids' (and optionally 'labels')")
            labels = batch.get("labels", batch["input_ids"])
            target = torch.full_like(labels, IGNORE_INDEX)
            target[:, :-1] = labels[:, 1:]  # (B, T): position t predicts token t + 1
            # input_ids positional (every causal LM takes it first): a pipeline's first stage needs it so
            kwargs = {k: v for k, v in batch.items() if k not in ("labels", "input_ids")}
            return (batch["input_ids"],), kwargs, target
        args, kwargs, target = default_split(batch)
        if target is None:  # a bare (B, T) tensor of token ids
            ids = args[0]
            target = torch.full_like(ids, IGNORE_INDEX)
            target[:, :-1] = ids[:, 1:]
        return args, kwargs, target

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        logits = _logits(output)  # (B, T, V)
        flat = logits.float().view(-1, logits.size(-1))
        if self.items is None:
            return F.cross_entropy(flat, target.reshape(-1), ignore_index=IGNORE_INDEX)
        total = F.cross_entropy(flat, target.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
        return total / self.items


class HFLoss(Loss):
    """The loss a Hugging Face model computes itself from the ``labels`` in the batch."""

    name = "hf"

    def split(self, batch: Any) -> tuple[tuple, dict, Any]:
        if not isinstance(batch, Mapping) or "labels" not in batch:
            raise LossError("loss 'hf' calls model(**batch).loss: the batch must be a dict holding 'labels'")
        kwargs = dict(batch)
        if self.items is not None:  # the model sums its token losses and divides by it (transformers' convention)
            kwargs["num_items_in_batch"] = self.items
        return (), kwargs, None

    def counts_items_for(self, model: nn.Module) -> bool:
        """Whether ``model`` takes ``num_items_in_batch`` (transformers' rule: its ``accepts_loss_kwargs``, else a
        ``**kwargs`` in its ``forward``)."""
        if hasattr(model, "accepts_loss_kwargs"):
            return bool(model.accepts_loss_kwargs)
        params = inspect.signature(type(model).forward).parameters.values()
        return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)

    def count_items(self, batch: Any) -> torch.Tensor:
        """The labels that count after the model's own shift (``labels[..., 1:]``, or ``shift_labels`` as given)."""
        if isinstance(batch, Mapping) and "shift_labels" in batch:
            return (batch["shift_labels"] != IGNORE_INDEX).sum()
        return (self.split(batch)[1]["labels"][..., 1:] != IGNORE_INDEX).sum()

    def loss(self, output: Any, target: Any) -> torch.Tensor:
        loss = getattr(output, "loss", None)
        if loss is None:
            raise LossError(f"loss 'hf' reads output.loss, but the model returned {type(output).__name__} without "
                            "a loss; pass labels in the batch, or use train.loss=causal_lm")
        return loss


class ClassificationLoss(Loss):
    """Cross-entropy of ``(B, K)`` logits against ``(B,)`` class indices."""

    name = "classification"

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        logits = _logits(output)
        if target is None:
            raise LossError("loss 'classification' needs (x, y) batches with one class index per sample")
        return F.cross_entropy(logits.float(), target)


LOSSES: dict[str, type[Loss]] = {"causal_lm": CausalLMLoss, "hf": HFLoss, "classification": ClassificationLoss}


def infer_loss(model: nn.Module, batch: Any) -> Loss:
    """``train.loss=auto`` for a model without a registered loss: decided from one batch."""
    if isinstance(batch, Mapping):
        if "labels" in batch and hasattr(model, "config"):
            return HFLoss()
        if "input_ids" in batch:
            return CausalLMLoss()
    args, _, target = default_split(batch)
    if isinstance(target, torch.Tensor) and not target.is_floating_point():
        return ClassificationLoss() if target.dim() == 1 else CausalLMLoss()
    raise LossError(
        f"train.loss=auto cannot tell the loss of {type(model).__name__} from a batch of type "
        f"{type(batch).__name__}: set train.loss to causal_lm, hf, classification or package.module:function"
    )


def resolve_loss(spec: str | Loss | Callable[[Any, Any], torch.Tensor] | None) -> Loss | None:
    """A ``Loss`` from a name, a ``package.module:function`` reference, a ``Loss`` or a plain
    ``fn(output, target)``; None for ``auto``/None (decided later from the model and a batch)."""
    if spec is None or spec == "auto":
        return None
    if isinstance(spec, Loss):
        return spec
    if isinstance(spec, str):
        if spec in LOSSES:
            return LOSSES[spec]()
        if ":" not in spec:
            raise LossError(f"unknown loss {spec!r}; use auto, {', '.join(LOSSES)} or package.module:function")
        return Loss(import_object(spec, "train.loss"), name=spec)
    if callable(spec):
        return Loss(spec, name=getattr(spec, "__name__", "custom"))
    raise LossError(f"a loss must be a name, a Loss or a callable fn(output, target); got {type(spec).__name__}")


def import_object(ref: str, what: str) -> Any:
    """``package.module:attribute`` imported, with a message naming ``what`` when it cannot be."""
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{what}={ref!r}: cannot import module {module_name!r} ({e}); check the name and that "
                          "it is on PYTHONPATH or in the working directory") from None
    try:
        obj: Any = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ConfigError(f"{what}={ref!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ConfigError(f"{what}={ref!r} is not callable")
    return obj
