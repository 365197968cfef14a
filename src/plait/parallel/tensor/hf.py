"""Hugging Face tensor-parallel plans as transformers means them (``parallel.tp_plan = "auto"``).

A model's shipped plan (``model._tp_plan``, or ``config.base_model_tp_plan`` under the base model's prefix)
maps name patterns to styles. A pattern naming a module gives the module its style; a pattern naming a
*parameter* of an experts module shards only that parameter. plait applies (transformers' meaning, and
what plait does):

==================================  ==========================================================================
style                               plait
==================================  ==========================================================================
``colwise``, ``rowwise``,           ``plait.parallel.tensor.plan``'s styles (torch ``ColwiseParallel`` /
``colwise_gather_output``,          ``RowwiseParallel``; ``embedding_rowwise`` is the vocabulary-parallel
``rowwise_split_input``,            embedding; ``replicate`` leaves the module whole)
``embedding_rowwise``, ``replicate``
``moe_tp_experts``                  an experts module (fused 3-D weights) run on every rank with its weight
                                    shards: its input and routing weights pass unchanged forward and have
                                    their gradients summed over tp backward; its partial outputs are summed
                                    over tp forward (identity backward)
parameter entries of such a module  the weight as a DTensor: ``colwise`` ``Shard(ndim-2)``, ``rowwise``
                                    ``Shard(ndim-1)``, ``packed_colwise`` / ``packed_rowwise`` the fused
                                    ``[gate; up]`` dimension split so each rank holds its slice of both halves
                                    (torch's ``_StridedShard``, split factor 2)
``replicated_with_grad_allreduce``  a whole module (Qwen3's per-head ``q_norm``) whose gradient each rank only
                                    partly computes (its own heads'): its parameters become replicated DTensors
                                    whose gradients are partial sums over tp (``plait.parallel.tensor.
                                    local_tokens.LocalTokens``), summed where the gradient-sync policy reads
                                    them (the reducer, ZeRO-1/2 and FSDP2's reduce-scatter alike; transformers
                                    sums the accumulated gradient: the same sum)
``mla_kv_a_proj``                   latent attention's joint key-value down-projection, whole on every rank:
                                    the rotary key part of its output (the last ``qk_rope_head_dim`` columns,
                                    shared by every head) has its gradient summed over tp backward, as each rank
                                    holds some heads; the latent part's gradient is whole already (the colwise
                                    ``kv_b_proj`` after it sums its input's gradient)
``local_params``                    a module (GPT-OSS attention) whose own parameters have entries of their own
                                    (its ``sinks``, one per head: ``colwise`` splits them as the heads are
                                    split): its forward runs with those parameters' local shards
==================================  ==========================================================================

Families whose shipped plan leaves attention out get it from ``ADDED_PLANS``, the entries transformers ships for the
same attention in a relative (DeepSeek-V3's multi-head latent attention: DeepSeek-V2's; GPT-OSS's attention with
sinks: Granite-SWA's). Patterns of a shipped plan that match nothing in this model are skipped, as transformers
skips them (Qwen3-MoE's dense-MLP entries when every layer is sparse). Under expert parallelism (``parallel.ep >
1``) or sequence parallelism the entries inside recognised MoE blocks (``plait.parallel.expert.hf``) are left out:
those blocks stay whole on every tp rank (their experts sharded over ep where ep > 1; under sequence parallelism
each tp rank routes its own sequence shard through them, ``plait.parallel.tensor.hf_sequence``). A plan with a style
plait does not apply (``REFUSED``, or a packed style on a module) is refused, with the reason, before anything is
sharded or communicated; ``plan_refusals`` judges a plan alone. Encoders without a shipped plan (BERT, RoBERTa) get
``ENCODER_PLAN``: attention query/key/value colwise and its output rowwise, the intermediate dense colwise and the
output dense rowwise.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from plait.parallel.expert.hf import find_moe_blocks
from plait.parallel.tensor.hf_sequence import check_sequence_parallel, mark_sequence_mesh, sequence_parallel_plan
from plait.parallel.tensor.local_tokens import LocalTokens
from plait.parallel.tensor.plan import (
    ALIASES,
    STYLES,
    TensorParallelError,
    _matches,
    apply_tp_plan,
    hf_plan,
    validate_plan,
)

EXPERTS = "moe_tp_experts"
GRAD_SUM = "replicated_with_grad_allreduce"
# parameter-level style -> (placement for a weight of ndim dims, the dim it splits, parts of that dim per rank)
PARAM_STYLES: dict[str, Any] = {
    "colwise": lambda nd: (Shard(nd - 2), nd - 2, 1),
    "rowwise": lambda nd: (Shard(nd - 1), nd - 1, 1),
    "packed_colwise": lambda nd: (_StridedShard(nd - 2, split_factor=2), nd - 2, 2),
    "packed_rowwise": lambda nd: (_StridedShard(nd - 1, split_factor=2), nd - 1, 2),
}
MLA = "mla_kv_a_proj"
LOCAL = "local_params"
ADDED_PLANS: dict[str, dict[str, str]] = {
    "deepseek_v3": {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.q_b_proj": "colwise",
                    "layers.*.self_attn.kv_a_proj_with_mqa": MLA, "layers.*.self_attn.kv_b_proj": "colwise",
                    "layers.*.self_attn.o_proj": "rowwise"},
    "gpt_oss": {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
                "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
                "layers.*.self_attn.sinks": "colwise", "layers.*.self_attn": LOCAL},
}
REFUSED = {
    "all_reduce": "summing a module's partial output over tp (shared experts on shards) is not a plait style",
    "moe_identity_expert": "identity (zero-computation) experts are not a plait style",
    "embedding_colwise": "an embedding split on its hidden dimension is not a plait style (plait splits the "
                         "vocabulary)",
}
ENCODER_TYPES = ("bert", "roberta")
ENCODER_PLAN = {"encoder.layer.*.attention.self.query": "colwise", "encoder.layer.*.attention.self.key": "colwise",
                "encoder.layer.*.attention.self.value": "colwise", "encoder.layer.*.attention.output.dense": "rowwise",
                "encoder.layer.*.intermediate.dense": "colwise", "encoder.layer.*.output.dense": "rowwise"}


def _parent(pattern: str) -> str:
    return pattern.rpartition(".")[0]


def plan_refusals(plan: dict[str, Any]) -> list[str]:
    """Why plait cannot apply ``plan`` (patterns -> style names), judged from the plan alone; empty when
    every style is one plait applies in the place the plan uses it."""
    experts = {k for k, v in plan.items() if v == EXPERTS}
    out = []
    for pattern, style in plan.items():
        if not isinstance(style, str):
            continue  # a torch ParallelStyle object: the caller's own
        if style in REFUSED:
            out.append(f"{pattern} -> {style}: {REFUSED[style]}")
        elif _parent(pattern) in experts:
            if style not in PARAM_STYLES:
                out.append(f"{pattern} -> {style}: a weight of a {EXPERTS} module takes {', '.join(PARAM_STYLES)}")
        elif style in ("packed_colwise", "packed_rowwise"):
            out.append(f"{pattern} -> {style}: plait splits packed weights only inside a module the plan makes "
                       f"{EXPERTS} (whose partial outputs it sums over tp)")
        elif style not in STYLES and style not in ALIASES and style not in (EXPERTS, GRAD_SUM, MLA, LOCAL):
            out.append(f"{pattern} -> {style}: not a style plait knows")
    for pattern in experts:
        if not any(_parent(k) == pattern for k in plan):
            out.append(f"{pattern} -> {EXPERTS}: no entry shards its weights, so its outputs would be summed tp times")
    return out


def _prefix(model: nn.Module) -> str:
    prefix = getattr(model, "base_model_prefix", "")
    has = bool(prefix) and isinstance(getattr(model, prefix, None), nn.Module) and getattr(model, prefix) is not model
    return f"{prefix}." if has else ""


def encoder_plan(model: nn.Module) -> dict[str, str] | None:
    """The inferred plan of a BERT or RoBERTa model (no shipped plan), with full module names; None otherwise."""
    if getattr(getattr(model, "config", None), "model_type", None) not in ENCODER_TYPES:
        return None
    prefix = _prefix(model)
    return {f"{prefix}{k}": v for k, v in ENCODER_PLAN.items()}


def hf_tp_function(model: nn.Module, tp_plan: Any, expert_parallel: bool,
                   sequence_parallel: bool = False) -> HFPlan | None:
    """The plan plait applies to a Hugging Face model, or None where ``plait.parallel.tensor.plan`` decides: an
    explicit plan using a Hugging Face style of this module (strict: every pattern must match); with
    ``tp_plan="auto"`` the shipped plan (patterns matching nothing skipped), else the inferred encoder plan.
    ``sequence_parallel``: the residual stream split along the sequence (``plait.parallel.tensor.hf_sequence``)."""
    if isinstance(tp_plan, dict):
        hf_only = set(REFUSED) | (set(PARAM_STYLES) - set(STYLES)) | {EXPERTS, GRAD_SUM, MLA, LOCAL}
        uses = any(isinstance(v, str) and v in hf_only for v in tp_plan.values())
        return HFPlan(tp_plan, strict=True, skip_moe=expert_parallel, sp=sequence_parallel) if uses else None
    if tp_plan not in (None, "auto"):
        return None
    shipped = hf_plan(model)
    added = ADDED_PLANS.get(getattr(getattr(model, "config", None), "model_type", None), {})
    if shipped and added:
        prefix = _prefix(model)
        shipped = {**shipped, **{f"{prefix}{k}": v for k, v in added.items()}}
    if shipped:
        return HFPlan(shipped, strict=False, skip_moe=expert_parallel, sp=sequence_parallel)
    inferred = encoder_plan(model)
    return HFPlan(inferred, strict=True, skip_moe=False, sp=sequence_parallel) if inferred else None


class HFPlan:
    """A Hugging Face plan resolved against a model (``check``) and applied to it (``__call__``)."""

    def __init__(self, plan: dict[str, Any], *, strict: bool, skip_moe: bool, sp: bool = False) -> None:
        self.plan, self.strict, self.skip_moe, self.sp = dict(plan), strict, skip_moe, sp

    def check(self, model: nn.Module, tp: int) -> None:
        """Every check, without communicating: refused styles, patterns, module kinds, widths and heads."""
        self._resolve(model, tp)
        if self.sp:
            check_sequence_parallel(model)

    def __call__(self, model: nn.Module, mesh: DeviceMesh) -> nn.Module:
        module_plan, experts, grad_sum = self._resolve(model, mesh.size())
        if self.sp:
            module_plan = sequence_parallel_plan(model, module_plan, mesh.size())
            mark_sequence_mesh(model, mesh)
        special = {n: module_plan.pop(n) for n in [n for n, v in module_plan.items() if v in (MLA, LOCAL)]}
        if module_plan:
            apply_tp_plan(model, mesh, module_plan)
        for module, placements in experts:
            _shard_experts(module, mesh, placements)
        for module in grad_sum:  # a parameter hook would be lost when FSDP2 re-registers the parameters
            parallelize_module(module, mesh, LocalTokens())
        modules = dict(model.named_modules())
        for name, style in special.items():
            if style == MLA:
                _sum_rotary_grad(modules[name], _rope_dim(model), mesh.get_group())
            else:
                _shard_own_params(modules[name], mesh, self._own_placements(name, modules[name], mesh.size()))
        return model

    def _resolve(self, model: nn.Module, tp: int) -> tuple[dict[str, Any], list, list[nn.Module]]:
        refusals = plan_refusals(self.plan)
        if refusals:
            raise TensorParallelError(
                f"{type(model).__name__}'s tensor-parallel plan has a style plait does not apply ({refusals[0]}). "
                "Set parallel.tp_plan to a table of module patterns -> plait's styles, pass parallelize_fn="
                "fn(model, tp_mesh) to setup, or use parallel.tp=1")
        skip = [b.name for b in find_moe_blocks(model)] if self.skip_moe or self.sp else []
        modules = {n: m for n, m in model.named_modules() if n}
        experts_patterns = {k for k, v in self.plan.items() if v == EXPERTS}
        local_patterns = {k for k, v in self.plan.items() if v == LOCAL}
        module_plan: dict[str, Any] = {}
        experts: list[tuple[nn.Module, dict[str, Placement]]] = []
        grad_sum: list[nn.Module] = []
        for pattern, style in self.plan.items():
            if _parent(pattern) in experts_patterns or (
                    _parent(pattern) in local_patterns and not any(_matches(pattern, n) for n in modules)):
                continue  # a weight's entry: read with its experts or local-parameters module
            matched = [n for n in modules if _matches(pattern, n)]
            found = [n for n in matched if not any(n == s or n.startswith(s + ".") for s in skip)]
            if self.strict and not matched:
                validate_plan(model, {pattern: style}, tp)  # raises, naming the nearest modules
            if self.strict and len(found) < len(matched):
                raise TensorParallelError(
                    f"tp plan pattern {pattern!r} names modules inside MoE blocks ({matched[0]}), which expert "
                    "and sequence parallelism keep whole on every tp rank (their experts sharded over parallel.ep, "
                    "or each tp rank routing its own tokens); drop it")
            if style == EXPERTS:
                experts += [(modules[n], self._placements(n, modules[n], tp)) for n in found]
            elif style == GRAD_SUM:
                grad_sum += [modules[n] for n in found]
            elif style in (MLA, LOCAL):
                for n in found:
                    self._check_special(model, n, modules[n], style, tp)
                module_plan.update({n: style for n in found})
            else:
                module_plan.update({n: style for n in found})
        torch_plan = {n: v for n, v in module_plan.items() if v not in (MLA, LOCAL)}
        if torch_plan:
            validate_plan(model, torch_plan, tp)
        return module_plan, experts, grad_sum

    def _check_special(self, model: nn.Module, name: str, module: nn.Module, style: str, tp: int) -> None:
        if style == MLA:
            if not isinstance(module, nn.Linear) or not isinstance(_rope_dim(model), int):
                raise TensorParallelError(f"{name} ({type(module).__name__}) is {MLA}: plait expects a Linear and "
                                          "config.qk_rope_head_dim")
        else:
            self._own_placements(name, module, tp)

    def _own_placements(self, name: str, module: nn.Module, tp: int) -> dict[str, Placement]:
        """The placements of a local-parameters module's own parameters that have plan entries (checked)."""
        out = {}
        for pname, q in module.named_parameters(recurse=False):
            style = next((v for k, v in self.plan.items() if _matches(k, f"{name}.{pname}")), None)
            if style is None:
                continue  # replicated: the same whole tensor on every rank
            if style not in ("colwise", "rowwise"):
                raise TensorParallelError(f"{name}.{pname} -> {style}: a parameter of a {LOCAL} module takes "
                                          "colwise or rowwise")
            # colwise splits the output dim (a 1-D parameter's only one, as a colwise bias), rowwise the input dim
            dim = max(q.dim() - 2, 0) if style == "colwise" else q.dim() - 1
            if q.shape[dim] % tp:
                raise TensorParallelError(f"{name}.{pname} ({style}) splits its dim {dim} of size {q.shape[dim]} over "
                                          f"parallel.tp={tp}; choose tp dividing it")
            out[pname] = Shard(dim)
        if not out:
            raise TensorParallelError(f"{name} is {LOCAL} but no entry of the plan names one of its parameters")
        return out

    def _placements(self, name: str, module: nn.Module, tp: int) -> dict[str, Placement]:
        """Each weight of the experts module ``name``: its placement from its plan entry, checked."""
        if any(True for c in module.children() for _ in c.parameters()):
            raise TensorParallelError(f"{name} ({type(module).__name__}) is {EXPERTS} but holds sub-modules with "
                                      "parameters; plait shards experts modules of fused weights only")
        out = {}
        for pname, q in module.named_parameters(recurse=False):
            style = next((v for k, v in self.plan.items() if _matches(k, f"{name}.{pname}")), None)
            if style is None:
                raise TensorParallelError(
                    f"{name}.{pname} has no entry in the tp plan while {name} is {EXPERTS}: every rank's partial "
                    "output is summed over tp, so an unsharded weight would count tp times; give it a style")
            placement, dim, parts = PARAM_STYLES[style](q.dim())
            if q.shape[dim] % (parts * tp):
                raise TensorParallelError(f"{name}.{pname} ({style}) splits its dim {dim} of size {q.shape[dim]} "
                                          f"into {parts} x parallel.tp={tp} parts; choose tp dividing "
                                          f"{q.shape[dim] // parts}")
            out[pname] = placement
        return out


# -- experts on weight shards -------------------------------------------------------------------------
class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum over ``group`` (an all-reduce). Backward: the gradient unchanged (every rank's
    partial output receives the whole output's gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _SumGradOverGroup(torch.autograd.Function):
    """Forward: ``x`` unchanged (it is the same on every rank). Backward: the gradient summed over ``group``
    (each rank's gradient covers only its weight shards)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


@contextlib.contextmanager
def _local_params(module: nn.Module) -> Iterator[None]:
    """The module's DTensor parameters as their local shards (differentiable views) for one forward."""
    saved = dict(module._parameters)
    try:
        for name, p in saved.items():
            if isinstance(p, DTensor):
                module._parameters[name] = p.to_local()  # type: ignore[assignment]
        yield
    finally:
        module._parameters.update(saved)


class _TensorParallelExperts:
    """Placed before a Hugging Face experts class: the model's experts forward on this rank's weight shards,
    its partial output summed over tp (see the module docstring)."""

    _plait_tp_group: Any

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                *args: Any, **kwargs: Any) -> torch.Tensor:
        group = self._plait_tp_group
        x = _SumGradOverGroup.apply(hidden_states, group)
        w = _SumGradOverGroup.apply(top_k_weights, group)
        with _local_params(self):  # type: ignore[arg-type]
            y = super().forward(x, top_k_index, w, *args, **kwargs)  # type: ignore[misc]
        return _SumOverGroup.apply(y, group)


@functools.cache
def _tp_class(cls: type) -> type:
    return type(f"TensorParallel{cls.__name__}", (_TensorParallelExperts, cls), {})


def _shard_experts(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement]) -> None:
    """This rank's shards of the experts' weights (equal on every rank before: no communication)."""
    for name, placement in placements.items():
        full = getattr(module, name)
        shard = distribute_tensor(full.detach(), mesh, [placement], src_data_rank=None)
        setattr(module, name, nn.Parameter(shard, requires_grad=full.requires_grad))
    module.__class__ = _tp_class(type(module))
    module._plait_tp_group = mesh.get_group()


def _rope_dim(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(config, "qk_rope_head_dim", None)


def _sum_rotary_grad(module: nn.Module, rope: int, group: Any) -> None:
    """Latent attention's ``kv_a_proj_with_mqa``: the rotary key columns of its output (every head's shared key
    part) get their gradient summed over ``group`` in backward; forward unchanged."""
    def hook(_module: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        latent, rotary = out.split([out.size(-1) - rope, rope], dim=-1)
        return torch.cat([latent, _SumGradOverGroup.apply(rotary, group)], dim=-1)

    module.register_forward_hook(hook)


class _LocalParams:
    """Placed before a module's class: its forward with its own DTensor parameters as their local shards."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with _local_params(self):  # type: ignore[arg-type]
            return super().forward(*args, **kwargs)  # type: ignore[misc]


@functools.cache
def _local_class(cls: type) -> type:
    return type(f"LocalParams{cls.__name__}", (_LocalParams, cls), {})


def _shard_own_params(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement]) -> None:
    """This rank's shards of the module's own parameters named in ``placements`` (equal on every rank before)."""
    for name, placement in placements.items():
        full = getattr(module, name)
        shard = distribute_tensor(full.detach(), mesh, [placement], src_data_rank=None)
        setattr(module, name, nn.Parameter(shard, requires_grad=full.requires_grad))
    module.__class__ = _local_class(type(module))
