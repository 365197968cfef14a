"""Tensor (and sequence) parallelism for any model, built on DTensor's ``parallelize_module``.

plait's part is the plan and the checks around it; DTensor turns a plan into the right forward and
backward collectives, sharded state dicts that ``torch.distributed.checkpoint`` reshards, and
``full_tensor()`` for export.

A plan maps module-name patterns to styles, matched like ``parallelize_module`` matches them: dotted
names whose atoms may be ``fnmatch`` wildcards (``model.layers.*.self_attn.q_proj``). Styles:

==================  ==============================================  ==========================================
style               forward / backward communication                modules
==================  ==============================================  ==========================================
``colwise``         none / all-reduce of the input gradient         ``nn.Linear`` (output features sharded)
``rowwise``         all-reduce of the output / none                 ``nn.Linear`` (input features sharded),
                                                                    ``nn.Embedding`` (vocabulary sharded)
``colwise_rep``     all-gather of the output / none                 ``nn.Linear`` (a head whose output stays whole)
``rowwise_rep``     all-reduce of the output (replicated input)     ``nn.Linear``
``vocab``           all-reduce of the partial embeddings / none     ``nn.Embedding`` (vocabulary-parallel)
``sequence_parallel``  norms on sequence shards (SequenceParallel)  norms and dropouts
``replicate``       none (the module stays whole on every rank)     any
==================  ==============================================  ==========================================

Hugging Face names are accepted too (``colwise_gather_output``, ``rowwise_split_input``,
``embedding_rowwise``), so ``parallel.tp_plan = "auto"`` can use the plan a Hugging Face model ships:
``model._tp_plan`` (the full model's, with its prefix), else ``config.base_model_tp_plan`` under the
model's ``base_model_prefix``. A class whose registered spec has a ``parallelize`` (plait's GPT;
``plait.parallel.train_spec``) uses that function instead. ``validate_plan`` checks a plan before any collective: every
pattern matches a module, the modules are of a supported kind, their widths, attention heads and
key-value heads divide by the tp degree. The Linear and Embedding styles assume torch's own forward of those
modules (``F.linear`` / ``F.embedding`` on the sharded DTensor weight): a subclass with a forward of its own
(torchtitan's ``Embedding``, which reads ``weight.to_local()`` itself) is refused by name; give it a
``ParallelStyle`` object (taken as is) or a ``parallelize_fn``. With ``parallel.sequence_parallel`` an explicit
plan for another model than plait's GPT or a Hugging Face decoder must split the sequence itself
(``splits_sequence``), or it is refused.

Training under loss parallelism (plait's GPT with ``parallel.loss_parallel``) must run the forward
*and* the backward inside ``loss_context(model)``.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from plait.config import ConfigError
from plait.parallel.data.reducer import local_grad
from plait.parallel.tensor.float8 import float8_plan
from plait.parallel.units import tied_uses

_LOSS_PARALLEL_ATTR = "_plait_loss_parallel"

# style -> (factory of the torch ParallelStyle (None: leave the module whole), module kinds it takes)
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.Dropout)
STYLES: dict[str, tuple[Callable[[], ParallelStyle] | None, tuple[type, ...]]] = {
    "colwise": (lambda: ColwiseParallel(), (nn.Linear,)),
    "rowwise": (lambda: RowwiseParallel(), (nn.Linear, nn.Embedding)),
    "colwise_rep": (lambda: ColwiseParallel(output_layouts=Replicate()), (nn.Linear,)),
    "rowwise_rep": (lambda: RowwiseParallel(input_layouts=Replicate()), (nn.Linear,)),
    "vocab": (lambda: RowwiseParallel(input_layouts=Replicate()), (nn.Embedding,)),
    "sequence_parallel": (lambda: SequenceParallel(), (nn.Module,)),
    "replicate": (None, (nn.Module,)),
}
ALIASES = {"colwise_gather_output": "colwise_rep", "rowwise_split_input": "rowwise_rep",
           "embedding_rowwise": "vocab", "local": "replicate"}

Plan = dict[str, "str | ParallelStyle"]


class TensorParallelError(ConfigError):
    """The model cannot be split over the requested tensor-parallel degree; the message says why."""


class PrepareGatheredInput(PrepareModuleInput):
    """``PrepareModuleInput`` for the input several column-parallel Linears share (attention's q, k and v; an MLP's
    gate and up), all-gathered from sequence shards. Under autocast each Linear would cast the float32 gather to
    half precision itself and keep its own copy for backward (autocast caches the casts of parameters only); the
    shard is cast first instead, so the Linears share one gathered half-precision tensor, kept once, and the
    all-gather moves half the bytes. A cast commutes with a gather: forward computes what autocast computes.
    Forward: one all-gather of the shard (in the autocast dtype under autocast); backward: the Linears' input
    gradients summed in that dtype and reduce-scattered once (as Megatron-LM and FSDP2's bf16 policy do), then
    cast back to float32."""

    def _prepare_input_arg(self, input: Any, mesh: DeviceMesh, input_layout: Any, desired_layout: Any) -> Any:
        if (input_layout is not None and input_layout != desired_layout and isinstance(input, torch.Tensor)
                and input.dtype == torch.float32 and input.device.type in ("cpu", "cuda", "xpu")
                and torch.is_autocast_enabled(input.device.type)):
            input = input.to(torch.get_autocast_dtype(input.device.type))
        return super()._prepare_input_arg(input, mesh, input_layout, desired_layout)


def _matches(pattern: str, name: str) -> bool:
    p_atoms, n_atoms = pattern.split("."), name.split(".")
    return len(p_atoms) == len(n_atoms) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(p_atoms, n_atoms,
                                                                                          strict=True))


def matched_modules(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    """Modules of ``model`` whose dotted name matches ``pattern`` (atoms may be wildcards)."""
    return [(n, m) for n, m in model.named_modules() if n and _matches(pattern, n)]


def hf_plan(model: nn.Module) -> Plan | None:
    """The tensor-parallel plan a Hugging Face model ships, with full module names; None without one."""
    plan = getattr(model, "_tp_plan", None)
    if plan:
        return dict(plan)
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if base:
        prefix = getattr(model, "base_model_prefix", "")
        has_prefix = bool(prefix) and hasattr(model, prefix) and getattr(model, prefix) is not model
        return {(f"{prefix}.{k}" if has_prefix else k): v for k, v in base.items()}
    return None


def _style_name(style: str | ParallelStyle) -> str | None:
    if isinstance(style, ParallelStyle):
        return None
    if not isinstance(style, str):
        raise TensorParallelError(f"a tensor-parallel style must be a name or a torch ParallelStyle; got {style!r}")
    name = ALIASES.get(style, style)
    if name not in STYLES:
        raise TensorParallelError(f"unknown tensor-parallel style {style!r}; plait supports "
                                  f"{', '.join(sorted(STYLES))} (and a torch ParallelStyle object); pass a "
                                  "parallelize_fn for anything else")
    return name


def _head_counts(model: nn.Module) -> dict[str, int]:
    config = getattr(model, "config", None)
    out = {}
    for key in ("num_attention_heads", "num_key_value_heads", "n_head"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            out[key] = value
    return out


def _check_module(pattern: str, name: str, module: nn.Module, style: str, tp: int) -> None:
    kinds = STYLES[style][1]
    if type(module).__name__ == "Conv1D" and style != "replicate":
        raise TensorParallelError(
            f"{name} is a fused Conv1D (GPT-2 style, weight stored (in, out)): plait's {style} style shards "
            "nn.Linear and nn.Embedding only; the fused qkv projection cannot be split by heads this way. Pass a "
            "parallelize_fn for this model, or use parallel.tp=1")
    if not isinstance(module, kinds):
        raise TensorParallelError(
            f"tp plan {pattern!r} -> {style}: {name} is a {type(module).__name__}, but {style} takes "
            f"{' or '.join(k.__name__ for k in kinds)}")
    base = next((k for k in (nn.Linear, nn.Embedding) if k in kinds and isinstance(module, k)), None)
    if base is not None and _own_forward(module, base):
        cls = type(module)
        raise TensorParallelError(
            f"tp plan {pattern!r} -> {style}: {name} is a {cls.__module__}.{cls.__qualname__}, whose forward is its "
            f"own, and plait's {style} style assumes {base.__name__}.forward (F.{base.__name__.lower()} on the sharded "
            "DTensor weight, which a forward that reads the weight itself cannot take); leave it out of the plan, "
            "give it a torch ParallelStyle object of yours, or pass parallelize_fn")
    width = None
    if isinstance(module, nn.Linear):
        width = module.out_features if style == "colwise" or style == "colwise_rep" else module.in_features
        what = "output" if style in ("colwise", "colwise_rep") else "input"
    elif isinstance(module, nn.Embedding) and style in ("rowwise", "vocab"):
        width, what = module.num_embeddings, "vocabulary"
    if width is not None and style != "replicate" and width % tp:
        raise TensorParallelError(f"{name} ({style}) splits its {what} width {width} over parallel.tp={tp}, "
                                  f"which does not divide it; choose tp among the divisors of {width}")


def _own_forward(module: nn.Module, base: type) -> bool:
    """Whether ``module`` runs a forward other than ``base``'s, which plait's styles were not written for. Hugging
    Face's modules are exempt: their shipped plans name them, for their own forwards."""
    return type(module).forward is not base.forward and not type(module).__module__.startswith("transformers.")


def validate_plan(model: nn.Module, plan: Plan, tp: int) -> dict[str, ParallelStyle | None]:
    """Check ``plan`` against ``model`` for degree ``tp`` (no communication) and resolve its styles.

    Raises ``TensorParallelError`` naming the pattern that matches nothing (with the nearest module
    names), a module of the wrong kind, or a width, head or key-value-head count that ``tp`` does not
    divide. Returns ``{pattern: ParallelStyle or None (replicate)}``.
    """
    if not plan:
        raise TensorParallelError("the tensor-parallel plan is empty; give at least one pattern -> style")
    for key, count in _head_counts(model).items():
        if count % tp:
            raise TensorParallelError(f"{type(model).__name__} has {key}={count}, which does not divide by "
                                      f"parallel.tp={tp}: tensor parallelism splits whole heads; choose tp among "
                                      f"the divisors of {count}")
    names = [n for n, _ in model.named_modules() if n]
    resolved: dict[str, ParallelStyle | None] = {}
    for pattern, style in plan.items():
        found = matched_modules(model, pattern)
        if not found:
            import difflib

            near = difflib.get_close_matches(pattern, names, n=3, cutoff=0.0)
            raise TensorParallelError(f"tp plan pattern {pattern!r} matches no module of {type(model).__name__}; "
                                      f"nearest module names: {', '.join(near)}")
        name = _style_name(style)
        if name is None:
            resolved[pattern] = style  # a ParallelStyle object: the caller takes responsibility for it
            continue
        for n, m in found:
            _check_module(pattern, n, m, name, tp)
        factory = STYLES[name][0]
        resolved[pattern] = factory() if factory is not None else None
    return resolved


def apply_tp_plan(model: nn.Module, tp_mesh: DeviceMesh, plan: Plan) -> nn.Module:
    """Shard ``model`` in place over the 1-D ``tp_mesh`` by ``plan`` (validated first) and return it.

    Contract: identical full models on every tp rank (plait broadcasts rank 0's weights first), before
    any optimizer. Inputs stay the full batch on every tp rank. Weights shared by two modules (a tied
    embedding and head) must be sharded alike or not at all: a plan that splits one of them only is
    an error, since the tie would break.
    """
    tp = tp_mesh.size()
    resolved = {name: style for pattern, style in validate_plan(model, plan, tp).items()
                for name, _ in matched_modules(model, pattern)}  # every pattern matches (validated)
    resolved = float8_plan(model, resolved)  # torchao's styles on its Float8Linears
    tied = tied_names(model)
    for name, style in resolved.items():
        if style is None:
            continue
        module = model.get_submodule(name)
        for pname, _ in module.named_parameters(recurse=False):
            others = tied.get(f"{name}.{pname}")
            if others and not all(resolved.get(o.rsplit(".", 1)[0]) is not None for o in others):
                pattern = next(p for p in plan if _matches(p, name))
                raise TensorParallelError(
                    f"{name}.{pname} is tied to {', '.join(others)}, which the plan does not shard alike; "
                    f"shard both or neither (drop {pattern!r} from the plan, or untie the weights)")
        parallelize_module(module, tp_mesh, style)
    retie(model, tied)
    return model


def retie(model: nn.Module, tied: dict[str, list[str]]) -> None:
    """``parallelize_module`` gives each module its own new DTensor parameter, which unties weights the model
    shares (a Hugging Face model's ``tie_word_embeddings``): the other names get the first name's parameter
    again, so the one tensor keeps receiving both uses' gradients. ``tied`` is ``tied_names`` of the model before
    it was sharded. The plan must shard them alike (else a ``TensorParallelError``); every tensor-parallel path
    ends here, a user's ``parallelize_fn`` included."""
    done: set[str] = set()
    for name, others in tied.items():  # in the model's parameter order: the first name of each tie first
        if name in done:
            continue
        done.update([name, *others])
        first = model.get_parameter(name)
        for other in others:
            current = model.get_parameter(other)
            if current is first:
                continue
            if getattr(current, "placements", None) != getattr(first, "placements", None):
                raise TensorParallelError(f"{name} is tied to {other}, but the plan shards them differently "
                                          f"({getattr(first, 'placements', 'whole')} and "
                                          f"{getattr(current, 'placements', 'whole')}); shard both alike or neither")
            owner, _, attr = other.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, attr, first)


def tied_names(model: nn.Module) -> dict[str, list[str]]:
    """Parameter name -> the other names of the same parameter (tied weights)."""
    groups = [list(dict.fromkeys(name for name, _ in uses)) for uses in tied_uses(model)]
    return {n: [o for o in names if o != n] for names in groups for n in names}


def splits_sequence(plan: Plan) -> bool:
    """Whether ``plan`` itself runs modules on sequence shards (a ``sequence_parallel`` style or torch's
    ``SequenceParallel``)."""
    return any(ALIASES.get(v, v) == "sequence_parallel" if isinstance(v, str) else isinstance(v, SequenceParallel)
               for v in plan.values())


def resolve_tp(model: nn.Module, tp_plan: Plan | str | None, parallelize_fn: Callable | None,
               registered: Callable | None, sequence_parallel: bool = False
               ) -> Callable[[nn.Module, DeviceMesh], nn.Module]:
    """The function that shards ``model`` over a tp mesh: ``parallelize_fn`` if given, else an explicit
    plan, else (``"auto"``) the class's registered function, else the plan a Hugging Face model ships.
    Raises ``TensorParallelError`` when none applies (GPT-2's fused ``Conv1D`` attention, a plain model), and for
    ``sequence_parallel`` with an explicit plan that splits no sequence: plait adds sequence parallelism to its
    GPT's and Hugging Face decoders' plans only, and a plan of another model must say where the sequence is split
    (its norms ``sequence_parallel``, the inputs around them gathered and sliced)."""
    if parallelize_fn is not None:
        return parallelize_fn
    if isinstance(tp_plan, dict):
        if sequence_parallel and not splits_sequence(tp_plan):
            raise TensorParallelError(
                f"parallel.sequence_parallel=true, and the tp plan given for {type(model).__name__} splits no "
                "sequence (plait adds it to its GPT's and Hugging Face decoders' plans only): give the norms the "
                "sequence_parallel style and gather/slice the inputs around them in the plan (torch "
                "PrepareModuleInput, RowwiseParallel(output_layouts=Shard(1))), or set "
                "parallel.sequence_parallel=false")
        return lambda m, mesh: apply_tp_plan(m, mesh, tp_plan)
    if tp_plan not in (None, "auto"):
        raise TensorParallelError(f"tp_plan must be 'auto' or a dict of patterns to styles; got {tp_plan!r}")
    if registered is not None:
        return registered
    plan = hf_plan(model)
    if plan:
        return lambda m, mesh: apply_tp_plan(m, mesh, plan)
    conv1d = [n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"]
    why = (f"; its attention uses fused Conv1D projections ({conv1d[0]}, ...) that a column/row plan cannot split "
           "by heads") if conv1d else ""
    raise TensorParallelError(
        f"{type(model).__name__} has no tensor-parallel plan (no plan registered for its class, no "
        f"config.base_model_tp_plan){why}. Set parallel.tp_plan to a table of module patterns -> styles, pass "
        "parallelize_fn=fn(model, tp_mesh) to setup, or use parallel.tp=1")


def mark_loss_parallel(model: nn.Module, enabled: bool) -> None:
    """Record that ``model``'s logits stay vocabulary-sharded (loss computed under ``loss_parallel``)."""
    setattr(model, _LOSS_PARALLEL_ATTR, enabled)


def uses_loss_parallel(model: nn.Module) -> bool:
    """Whether the model's tensor-parallel plan left its logits vocabulary-sharded."""
    return bool(getattr(model, _LOSS_PARALLEL_ATTR, False))


def loss_context(model: nn.Module | bool) -> contextlib.AbstractContextManager:
    """Context for forward + backward of a tensor-parallel model: ``loss_parallel()`` when it is on.

    Takes the model (or the flag ``uses_loss_parallel(model)``); a plain ``nullcontext`` for models
    not built with loss parallelism or not tensor-parallel.
    """
    enabled = model if isinstance(model, bool) else uses_loss_parallel(model)
    return loss_parallel() if enabled else contextlib.nullcontext()


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor holding the full value of ``t`` (gathers a DTensor; communication if sharded)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded, natural-shape state dict with the FQNs of the single-process model.

    Collective over the tp mesh (every sharded entry is all-gathered); every rank gets the full dict.
    """
    return {k: local_value(v).detach().clone() for k, v in model.state_dict().items()}


def local_grads(params: Iterator[nn.Parameter] | list[nn.Parameter]) -> list[torch.Tensor]:
    """This rank's gradient shards as plain tensors, each laid out like its parameter's shard
    (``plait.parallel.data.reducer.local_grad``), for a data-parallel reducer to all-reduce in place."""
    return [g for p in params if (g := local_grad(p)) is not None]


def describe_plan(plan: dict[str, Any]) -> str:
    return ", ".join(f"{k} -> {v if isinstance(v, str) else type(v).__name__}" for k, v in plan.items())
