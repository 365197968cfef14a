"""Where a model is cut into pipeline stages: adapters, measured layer costs, tied weights.

An adapter knows one family of models: ``layer_names(model)`` lists the split units in order (the
FQNs of the repeated layers), and ``build_stage(model, layers, is_first=..., is_last=...)`` returns a
module that owns exactly those layers (plus the input part on the first stage and the output part on
the last) under the full model's attribute names, so every stage's ``state_dict()`` keys are the full
model's and a checkpoint taken at one pp degree loads at another. A stage's ``forward`` takes the
previous stage's output (the first stage: the model's inputs) and returns its own (the last stage: the
model's output, which the loss function receives).

Adapters, tried in order: the one in the spec registered for the model's class (plait's GPT:
``plait.parallel.train_spec``), Hugging Face
decoder models that ship a ``base_model_pp_plan`` (``plait.parallel.pipeline.hf``), ``nn.Sequential`` (its
children are the layers). Anything else takes a ``stage_fn``.

Costs: ``measure_layer_costs`` times one forward and backward of the *whole* model on a sample
micro-batch with hooks on the layers (forward from the layer's pre-hook to its hook, backward from the
gradient reaching its output to the gradient reaching its input), so it needs no knowledge of the
model beyond the layer names. The input part (embedding) is everything before the first layer, the
output part (norm, head, loss) everything after the last.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from plait.parallel.units import tied_uses
from plait.plan.schedule import PipelineConfigError


class PipelineAdapter(Protocol):
    def layer_names(self, model: nn.Module) -> list[str]: ...

    def build_stage(self, model: nn.Module, layers: list[str], *, is_first: bool, is_last: bool) -> nn.Module: ...


class SequentialStage(nn.Module):
    """Some children of an ``nn.Sequential``, under their original names, run in order."""

    def __init__(self, children: dict[str, nn.Module]) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)

    def forward(self, x: Any) -> Any:
        for child in self._modules.values():
            x = child(x)
        return x


class SequentialPipeline:
    """``nn.Sequential``: every child is a layer; stages hold consecutive children."""

    def layer_names(self, model: nn.Module) -> list[str]:
        return [name for name, _ in model.named_children()]

    def build_stage(self, model: nn.Module, layers: list[str], *, is_first: bool, is_last: bool) -> nn.Module:
        return SequentialStage({n: model.get_submodule(n) for n in layers})


class FunctionPipeline:
    """A user's ``stage_fn(model, stage_index, num_stages) -> nn.Module`` (the escape hatch). It is called for
    every stage on every rank (the split needs to see every stage to find the weights they share), and its stages
    must hold the model's own modules, not copies, wherever the model ties a weight (``check_tied_copies``)."""

    def __init__(self, stage_fn: Callable[[nn.Module, int, int], nn.Module], num_stages: int) -> None:
        self.stage_fn, self.num_stages = stage_fn, num_stages

    def layer_names(self, model: nn.Module) -> list[str]:
        return [str(i) for i in range(self.num_stages)]

    def build_stage(self, model: nn.Module, layers: list[str], *, is_first: bool, is_last: bool) -> nn.Module:
        (index,) = layers
        stage = self.stage_fn(model, int(index), self.num_stages)
        if not isinstance(stage, nn.Module):
            raise PipelineConfigError(f"stage_fn returned {type(stage).__name__} for stage {index}, not an nn.Module")
        return stage


def pipeline_adapter(model: nn.Module) -> PipelineAdapter:
    """The adapter for ``model`` (see the module docstring); raises ``PipelineConfigError`` if none fits."""
    from plait.parallel.model_specs import spec_for
    from plait.parallel.pipeline.hf import decoder_pipeline

    registered = getattr(spec_for(model), "pipeline", None)
    if registered is not None:
        return registered
    hf = decoder_pipeline(model)
    if hf is not None:
        return hf
    if isinstance(model, nn.Sequential):
        return SequentialPipeline()
    raise PipelineConfigError(
        f"plait cannot split {type(model).__name__} into pipeline stages: it is not an nn.Sequential, not a Hugging "
        "Face decoder with a base_model_pp_plan, and no spec with a pipeline adapter is registered for its class "
        "(plait.register_train_spec). Pass stage_fn=fn(model, stage_index, num_stages) -> nn.Module to setup, or "
        "use parallel.pp=1")


def split_by_names(layer_names: list[str], split: list[str], num_stages: int, head: str | None = None) -> list[range]:
    """Stage ranges from the names of the layers that start stages 2..n (``parallel.pp_split``). ``head``: the name
    of the part after the layers (the final norm) of an adapter whose stages may hold no layer (``has_parts``); then
    the first layer may start stage 2 (the first stage holds the embedding alone) and ``head`` the last stage (it
    holds the norm, head and loss alone)."""
    if len(split) != num_stages - 1:
        raise PipelineConfigError(f"parallel.pp_split names {len(split)} split points for {num_stages} stages; give "
                                  f"{num_stages - 1} layer names (each starts a stage after the first)")
    points = layer_names + ([head] if head else [])
    starts = []
    for name in split:
        if name not in points:
            import difflib

            near = difflib.get_close_matches(name, points, n=3, cutoff=0.0)
            raise PipelineConfigError(f"parallel.pp_split: {name!r} is not a split point of this model; its layers "
                                      f"are {layer_names[0]} ... {layer_names[-1]} (nearest: {', '.join(near)})")
        starts.append(points.index(name))
    if starts != sorted(set(starts)) or (starts[0] == 0 and head is None):
        after = f", after the first layer ({layer_names[0]})" if head is None else ""
        raise PipelineConfigError(f"parallel.pp_split {split} must name layers in increasing order{after}")
    bounds = [0, *starts, len(layer_names)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def has_parts(adapter: PipelineAdapter) -> bool:
    """Whether the adapter's first and last stages hold an input part (the embedding) and an output part (norm,
    head) apart from the layers, so they may hold those alone: adapters with a ``head_name``."""
    return callable(getattr(adapter, "head_name", None))


def stage_layer_ranges(model: nn.Module, adapter: PipelineAdapter, num_stages: int, split: list[str] | None,
                       costs: LayerCosts | None, *, embedding_unit: bool = False,
                       head_unit: bool = False) -> tuple[list[str], list[range]]:
    """(the layer names, each stage's range of them): a user's ``stage_fn`` one unit per stage; named split points
    (``split_by_names``); else ``partition_units`` on ``costs`` (every layer the same without), the embedding and
    the head units of their own where asked (``parallel.pp_split_embedding`` / ``pp_split_head``). Raises
    ``PipelineConfigError`` for a split the model cannot take."""
    from plait.plan.schedule import partition_units

    names = adapter.layer_names(model)
    if isinstance(adapter, FunctionPipeline):
        return names, [range(s, s + 1) for s in range(num_stages)]
    if (embedding_unit or head_unit) and not has_parts(adapter):
        raise PipelineConfigError(
            f"parallel.pp_split_embedding and pp_split_head give the embedding or the head a stage of its own, which "
            f"needs a model whose pipeline holds them apart from its layers (plait's GPT, Hugging Face decoders); "
            f"{type(model).__name__} is split by {type(adapter).__name__}: set them false")
    if split:
        head = adapter.head_name(model) if has_parts(adapter) else None
        return names, split_by_names(names, split, num_stages, head)
    if costs is None:
        costs = LayerCosts(embed=0.0, blocks=[1.0] * len(names), head=0.0)
        if embedding_unit or head_unit:  # by count, the embedding and the head count as one layer each
            costs = LayerCosts(embed=1.0, blocks=costs.blocks, head=1.0)
    return names, partition_units(costs.blocks, num_stages, first_cost=costs.embed, last_cost=costs.head,
                                  embedding_unit=embedding_unit, head_unit=head_unit)


@dataclass
class LayerCosts:
    """Measured seconds of forward + backward: the input part, each layer, and the output part + loss."""

    embed: float
    blocks: list[float]
    head: float


def _first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, list | tuple):
        return next((t for t in map(_first_tensor, x) if t is not None), None)
    return None


@dataclass
class _Timeline:
    """Timestamps of one measured forward + backward."""

    n: int
    fwd_pre: list[float] = field(default_factory=list)
    fwd_post: list[float] = field(default_factory=list)
    grad_out: list[float | None] = field(default_factory=list)
    grad_in: list[float | None] = field(default_factory=list)
    forward_done: bool = False

    def __post_init__(self) -> None:
        self.fwd_pre, self.fwd_post = [0.0] * self.n, [0.0] * self.n
        self.grad_out, self.grad_in = [None] * self.n, [None] * self.n


def _hooks(layers: list[nn.Module], tl: _Timeline) -> list[Any]:
    def stamp(where: list, i: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            if where[i] is None:
                where[i] = time.perf_counter()
        return hook

    handles = []
    for i, layer in enumerate(layers):
        def pre(_m: nn.Module, args: tuple, i: int = i) -> None:
            if tl.forward_done:  # a recomputation (activation checkpointing) during backward
                return
            tl.fwd_pre[i] = time.perf_counter()
            x = _first_tensor(args)
            if x is not None and x.requires_grad:
                x.register_hook(stamp(tl.grad_in, i))

        def post(_m: nn.Module, _args: tuple, out: Any, i: int = i) -> None:
            if tl.forward_done:
                return
            tl.fwd_post[i] = time.perf_counter()
            y = _first_tensor(out)
            if y is not None and y.requires_grad:
                y.register_hook(stamp(tl.grad_out, i))

        handles += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]
    return handles


def _measure_once(model: nn.Module, layers: list[nn.Module], run: Callable[[], torch.Tensor]) -> list[float]:
    tl = _Timeline(len(layers))
    handles = _hooks(layers, tl)
    try:
        t0 = time.perf_counter()
        loss = run()
        t1 = time.perf_counter()
        tl.forward_done = True
        loss.backward()
        t2 = time.perf_counter()
    finally:
        for h in handles:
            h.remove()
    n = len(layers)
    grad_out = [g if g is not None else t1 for g in tl.grad_out]
    grad_in = [g if g is not None else t2 for g in tl.grad_in]
    blocks = [(tl.fwd_post[i] - tl.fwd_pre[i]) + max(0.0, grad_in[i] - grad_out[i]) for i in range(n)]
    embed = (tl.fwd_pre[0] - t0) + max(0.0, t2 - grad_in[0])
    head = (t1 - tl.fwd_post[-1]) + max(0.0, grad_out[-1] - t1)
    return [embed, *blocks, head]


def measure_layer_costs(model: nn.Module, inputs: Any, target: Any, *, loss: Callable | None = None,
                        adapter: PipelineAdapter | None = None, repeats: int = 3,
                        group: dist.ProcessGroup | None = None) -> LayerCosts:
    """Profile one micro-batch through ``model`` (see the module docstring); leaves no gradients behind.

    ``inputs`` is the first stage's input (a tensor, or a tuple of positional arguments), ``target``
    the loss's, ``loss(output, target)`` defaults to next-token cross-entropy. The median of
    ``repeats`` runs after one warm-up. With a process group initialised the costs are averaged over
    ``group`` (default: the world), so every rank gets the same numbers and the same partition. Works on
    a tensor-parallel model too (every tp rank runs the same collectives in the same order).
    """
    from plait.components.losses import CausalLMLoss
    from plait.parallel.tensor.plan import loss_context

    adapter = adapter or pipeline_adapter(model)
    loss = loss or CausalLMLoss().loss
    layers = [model.get_submodule(n) for n in adapter.layer_names(model)]
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    runs = []
    with loss_context(model):
        for r in range(repeats + 1):
            costs = _measure_once(model, layers, lambda: loss(model(*args), target))
            if r:
                runs.append(costs)
    model.zero_grad(set_to_none=True)
    med = torch.tensor(runs, dtype=torch.float64).median(dim=0).values
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(med, group=group)
        med = med / dist.get_world_size(group)
    values = med.tolist()
    return LayerCosts(embed=values[0], blocks=values[1:-1], head=values[-1])


@dataclass
class Tie:
    """One parameter that several stages use (a tied embedding and head): its single-process name, the
    stages that hold it, and the shape of this rank's shard of it."""

    name: str
    stages: list[int]
    shape: torch.Size
    ids: set[int] = field(default_factory=set)  # id() of the original and of every copy
    params: list[nn.Parameter] = field(default_factory=list)  # this rank's copies (filled by the runner)


def check_tied_copies(model: nn.Module, stages: list[nn.Module]) -> None:
    """A ``PipelineConfigError`` when a module that uses a weight the model ties (a tied embedding and head) is in
    no stage: a stage built from a copy of it (``copy.deepcopy`` in a user's ``stage_fn``) would train its copy
    apart from the tied weight, silently. Ties are found by identity, so stages must hold the model's own modules."""
    held = {id(m) for stage in stages for m in stage.modules()}
    for uses in tied_uses(model):
        names = " and ".join(dict.fromkeys(n for n, _ in uses))
        for name, module in uses:
            if id(module) not in held:
                raise PipelineConfigError(
                    f"the model ties {names} (one weight), but no pipeline stage holds the model's own module for "
                    f"{name}: a stage holding a copy of it would train the copy apart from the tied weight. Build "
                    "stages from the model's own modules (stage_fn(model, ...) returning parts such as "
                    "model.get_submodule(...), not copies); plait keeps a weight tied across stages in sync itself")


def untie_across_stages(model: nn.Module, stages: list[nn.Module]) -> tuple[list[Tie], dict[int, str]]:
    """Give every stage after the first its own copy of each parameter several stages share.

    Returns the ties and ``{id(copy): single-process name}`` for the copies. Both copies start equal;
    the runner sums their gradients after backward (``PipelineRunner.sync_tied_grads``), so they get the
    same update and stay equal, as one tied parameter would. A module shared by two stages is an error.
    """
    canonical = {id(p): n for n, p in model.named_parameters()}
    owners: dict[int, list[tuple[int, nn.Module, str]]] = {}
    seen_modules: dict[int, int] = {}
    for s, stage in enumerate(stages):
        for mname, module in stage.named_modules():
            if module is stage or not any(True for _ in module.parameters(recurse=False)):
                continue
            if seen_modules.setdefault(id(module), s) != s:
                raise PipelineConfigError(f"module {mname} is used by pipeline stages {seen_modules[id(module)]} and "
                                          f"{s}; a module can live on one stage only")
            for pname, p in module.named_parameters(recurse=False):
                owners.setdefault(id(p), []).append((s, module, pname))
    ties, copies = [], {}
    for pid, uses in owners.items():
        stage_ids = sorted({s for s, _, _ in uses})
        if len(stage_ids) < 2:
            continue
        first_use = next(getattr(m, n) for s, m, n in uses if s == stage_ids[0])
        local = first_use.to_local() if hasattr(first_use, "to_local") else first_use
        tie = Tie(canonical.get(pid, ""), stage_ids, local.shape, ids={pid})
        for s, module, pname in uses:
            if s != stage_ids[0]:
                copy = nn.Parameter(first_use.detach().clone(), requires_grad=first_use.requires_grad)
                setattr(module, pname, copy)
                copies[id(copy)] = tie.name
                tie.ids.add(id(copy))
        ties.append(tie)
    return sorted(ties, key=lambda t: t.name), copies
