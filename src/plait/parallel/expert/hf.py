"""Expert parallelism for Hugging Face mixture-of-experts models (transformers 5): Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE, DeepSeek-V3, GPT-OSS, and any family registered with ``register_moe_adapter``.

What a family must look like (its adapter names the parts). A sparse MoE *block* (``MixtralSparseMoeBlock``)
holds a router (``gate``) and an experts module (``experts``) whose weights are fused 3-D parameters with the
expert index first: ``gate_up_proj (E, 2I, C)`` and ``down_proj (E, C, I)``. The block's forward computes
``(router_logits, top_k_weights, top_k_index) = gate(x)`` and calls ``experts(x (N, C), top_k_index (N, k),
top_k_weights (N, k))``, which returns the weighted sum of each token's experts ``(N, C)``.

What plait changes (``shard_hf_experts``). Only the experts module: rank ``i`` of the ``ep`` group keeps the
experts ``[i E/ep, (i+1) E/ep)`` (marked as expert-parallel parameters with their global shape, so
``plait.parallel.expert.sync.ExpertSync`` reduces their gradients and checkpoints them as global
DTensors), and its forward becomes: the model's own routing (unchanged, computed by the model's own router
before the call) as one assignment per (token, choice), plait's dispatcher (``moe.dispatcher``: the
all-to-all of ``plait.parallel.expert.dispatch``, or the all-gather reference) moves each assignment to the rank
holding its expert, the model's own experts forward runs there on the rows received (each row one
assignment with weight 1, under the experts implementation the model's config chose), the results come
back, and each token's output is the sum of its assignments' results times the router's weights, added
in expert order as the model's eager loop adds them. The router, its top-k and normalisation, any shared
expert and the model's auxiliary load-balancing loss (computed by the model from the router logits) are
not touched, so the loss a user's loop computes is the model's own.

A model with a mixture-of-experts module no adapter recognises (a fused 3-D expert weight or an ``experts``
module list outside every recognised block) is refused before any collective, naming that module.

The blocks compose with every other dimension: ZeRO 1-3 (the experts sharded again over the ranks holding the same
experts, ``plait.parallel.expert.sync``), tensor parallelism (the blocks whole on every tp rank; under sequence
parallelism each tp rank routes its own sequence shard through them, ``plait.parallel.tensor.hf_sequence``) and
context parallelism; where a rank routes a shard of each sequence (cp, sp) the model's auxiliary loss is still the
whole sequences' (``plait.parallel.expert.apply.WholeRouterLogits``).

Under a pipeline the model's forward does not run (each stage runs its layers), so the auxiliary loss the
model computes from every layer's router logits cannot be formed: ``output_router_logits=True`` with
``parallel.pp > 1`` is refused (``check_pipeline_router_loss``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.nn.experts import count_ids
from plait.nn.routing import Routing
from plait.parallel.expert.dispatch import DISPATCHERS, ExpertParallelError, keep_experts

__all__ = ["MoeAdapter", "check_hf_experts", "check_pipeline_router_loss", "find_moe_blocks",
           "register_moe_adapter", "shard_hf_experts"]


@dataclass(frozen=True)
class MoeAdapter:
    """How one family's sparse MoE block is laid out: the block's class name, the attribute of its experts
    module and of its router, and the experts' fused weights (expert index first; biases of ``(E, width)``
    included). ``grouped``: for an experts class without transformers' implementation switch, the attributes
    (``has_bias``, ``is_transposed``...) under which transformers' own grouped-GEMM experts function runs it
    (GPT-OSS: the function its ``base_model_ep_plan`` names), so its expert-parallel forward reads no host."""

    family: str
    block: str
    experts: str = "experts"
    router: str = "gate"
    weights: tuple[str, ...] = ("gate_up_proj", "down_proj")
    grouped: tuple[tuple[str, Any], ...] = ()

    def matches(self, module: nn.Module) -> bool:
        return type(module).__name__ == self.block


_ADAPTERS: list[MoeAdapter] = []


def register_moe_adapter(adapter: MoeAdapter) -> None:
    """Teach plait another family's MoE block (one with the layout the module docstring describes); a later
    registration for the same block class replaces an earlier one."""
    _ADAPTERS[:] = [a for a in _ADAPTERS if a.block != adapter.block] + [adapter]


for _family, _block in (("Mixtral", "MixtralSparseMoeBlock"), ("Qwen2-MoE", "Qwen2MoeSparseMoeBlock"),
                        ("Qwen3-MoE", "Qwen3MoeSparseMoeBlock"), ("OLMoE", "OlmoeSparseMoeBlock"),
                        ("DeepSeek-V3", "DeepseekV3MoE")):
    register_moe_adapter(MoeAdapter(_family, _block))
# GPT-OSS: interleaved [gate, up] columns of (E, C, 2I) weights with biases, its own clamped SwiGLU (_apply_gate)
register_moe_adapter(MoeAdapter(
    "GPT-OSS", "GptOssMLP", router="router",
    weights=("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"),
    grouped=(("has_gate", True), ("has_bias", True), ("is_transposed", True), ("is_concatenated", False),
             ("has_post_expert_norm", False))))


def _supported() -> str:
    return ", ".join(f"{a.family} ({a.block})" for a in _ADAPTERS)


@dataclass
class MoeBlock:
    """One recognised block: its name in the model, the block, its adapter and its number of experts."""

    name: str
    block: nn.Module
    adapter: MoeAdapter
    num_experts: int

    @property
    def experts(self) -> nn.Module:
        return getattr(self.block, self.adapter.experts)


def _check_block(name: str, block: nn.Module, adapter: MoeAdapter) -> MoeBlock:
    """The block's parts as the adapter names them, or an error saying which part is not as expected."""
    experts = getattr(block, adapter.experts, None)
    router = getattr(block, adapter.router, None)
    weights = [getattr(experts, w, None) for w in adapter.weights] if isinstance(experts, nn.Module) else []
    params = [w for w in weights if isinstance(w, nn.Parameter) and w.dim() >= 2]
    sizes = {int(w.shape[0]) for w in params}
    if not isinstance(router, nn.Module) or len(params) != len(adapter.weights) or len(sizes) != 1 \
            or not any(w.dim() == 3 for w in params) or getattr(experts, "num_experts", None) not in sizes:
        raise ExpertParallelError(
            f"{name} ({type(block).__name__}) is not laid out as plait's {adapter.family} adapter expects (a router "
            f"'{adapter.router}' and an experts module '{adapter.experts}' with num_experts and fused weights "
            f"{', '.join(adapter.weights)}, the expert index first): this transformers version changed the block; "
            "register a matching plait.parallel.expert.hf.MoeAdapter or set parallel.ep=1")
    return MoeBlock(name, block, adapter, sizes.pop())


def find_moe_blocks(model: nn.Module) -> list[MoeBlock]:
    """The model's recognised MoE blocks in module order (empty when it has none)."""
    out = []
    for name, m in model.named_modules():
        adapter = next((a for a in _ADAPTERS if a.matches(m)), None)
        if adapter is not None:
            out.append(_check_block(name, m, adapter))
    return out


def _inside(name: str, prefixes: list[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def unrecognised_moe(model: nn.Module, blocks: list[MoeBlock]) -> tuple[str, nn.Module] | None:
    """The first module outside every recognised block that holds experts: fused expert weights (two or more
    3-D parameters with the same leading size > 1, the expert index, in a module that is not a convolution)
    or an ``experts`` list of modules. Returned as the module holding them (the MoE block), or None."""
    known = [b.name for b in blocks]
    modules = dict(model.named_modules())
    for name, m in modules.items():
        if _inside(name, known) or isinstance(m, nn.modules.conv._ConvNd):
            continue
        leading = [q.shape[0] for q in m.parameters(recurse=False) if q.dim() == 3 and q.shape[0] > 1]
        fused = len(leading) >= 2 and len(set(leading)) == 1
        listed = name.rsplit(".", 1)[-1] == "experts" and isinstance(m, nn.ModuleList) and len(m) > 1
        if fused or listed:
            parent = name.rpartition(".")[0]
            return (parent, modules[parent]) if parent and name.endswith("experts") else (name, m)
    return None


def check_hf_experts(model: nn.Module, ep: int) -> list[MoeBlock]:
    """Before any collective: the model's MoE blocks can be sharded over ``ep`` ranks (every block
    recognised, every expert count divisible by ``ep``). Raises ``ExpertParallelError`` naming the module or
    setting; returns the blocks. Every other dimension composes with them (the module docstring)."""
    blocks = find_moe_blocks(model)
    other = unrecognised_moe(model, blocks)
    if other is not None:
        name, m = other
        raise ExpertParallelError(
            f"parallel.ep={ep}: plait does not recognise the mixture-of-experts module {name} "
            f"({type(m).__name__}) of {type(model).__name__}, so it cannot shard its experts. Supported: "
            f"{_supported()}; register an adapter for a block of the same shape "
            "(plait.parallel.expert.hf.register_moe_adapter), or set parallel.ep=1")
    if not blocks:
        raise ExpertParallelError(
            f"parallel.ep={ep} but {type(model).__name__} has no mixture-of-experts layer to shard (a plait.nn.MoE, "
            f"or a Hugging Face block: {_supported()}): set moe.num_experts for plait's GPT, use plait.nn.MoE in "
            "your model, or set parallel.ep=1")
    for b in blocks:
        if b.num_experts % ep:
            fits = [e for e in range(1, b.num_experts + 1) if b.num_experts % e == 0]
            raise ExpertParallelError(f"{b.name} has {b.num_experts} experts, not divisible by parallel.ep={ep}: "
                                      f"every expert-parallel rank holds the same number of experts; use ep in {fits}")
    return blocks


def check_pipeline_router_loss(model: nn.Module) -> None:
    """A pipeline runs the model's layers stage by stage, never its forward, so the auxiliary loss a Hugging
    Face MoE model adds from all its layers' router logits (``output_router_logits=True``) would be lost:
    refused, before any collective, rather than trained without."""
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False) is True:
        raise ExpertParallelError(
            f"{type(model).__name__} has config.output_router_logits=True: its auxiliary load-balancing loss is "
            "computed by the model's forward from every layer's router logits, which no pipeline stage sees, so "
            "parallel.pp > 1 would train without it. Set config.output_router_logits=False (no auxiliary loss), "
            "or use parallel.pp=1 (expert, data, ZeRO and tensor parallelism keep the model's loss)")


# -- the expert-parallel forward --------------------------------------------------------------------
class _ExpertParallelForward:
    """Placed before a Hugging Face experts class (``shard_hf_experts``): the same module, its forward
    dispatching over the ``ep`` ranks. ``_plait_dispatcher`` moves the rows; ``_plait_run`` runs the model's
    own experts forward (the next class in the MRO, or transformers' grouped one where the adapter says so) on
    the rows this rank received."""

    _plait_dispatcher: Any
    _plait_forward: Any = None  # transformers' experts function for a class without the implementation switch

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        n, k = top_k_index.shape
        experts = top_k_index.reshape(-1)  # (A,) global expert of each assignment, A = N k
        tokens = torch.arange(n, device=hidden_states.device).repeat_interleave(k)  # (A,)
        weights = top_k_weights.reshape(-1)  # (A,)
        # a token's k experts are distinct, so an expert gets at most n of this rank's assignments
        routing = Routing(tokens, experts, weights, count_ids(experts, self._plait_dispatcher.ep * self.num_experts),
                          per_expert=n)
        y = self._plait_dispatcher(hidden_states, routing, self._plait_run)  # (A, C), assignment order
        order = torch.argsort(experts, stable=True)  # a token's experts summed in index order, as the model does
        weighted = (y * weights[:, None]).to(hidden_states.dtype)
        return torch.zeros_like(hidden_states).index_add(0, tokens[order], weighted[order])  # (N, C)

    def _plait_run(self, x: torch.Tensor, rows: torch.Tensor, local_experts: torch.Tensor,
                   cap: int | None = None) -> torch.Tensor:
        """Each row ``x[rows[i]]`` through local expert ``local_experts[i]`` by the model's experts forward
        (``(R, C)`` in row order); rows whose id is ``num_experts`` or more are padding and come back as zeros.

        Experts classes with transformers' implementation switch (``_is_expert_parallel``) take padding rows as
        sentinels (grouped_mm skips them, eager skips the sentinel expert), each real row with weight 1: no
        host read. A class without it runs on the real rows only (one host read of how many there are)."""
        xs = x.index_select(0, rows)  # (R, C)
        valid = local_experts < self.num_experts
        if self._plait_forward is not None or hasattr(self, "_is_expert_parallel"):
            run = self._plait_forward or super().forward  # type: ignore[misc]
            fn = run if self._plait_forward is None else lambda *a: run(self, *a)
            out = fn(xs, local_experts[:, None], valid.to(xs.dtype)[:, None])
            return torch.where(valid[:, None], out, 0.0)
        return self._compacted(xs, local_experts, valid)

    def _compacted(self, xs: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The model's forward on the real rows only. With none at all, one zero row with weight 0 runs, so
        the experts' weights get a zero gradient and the received rows stay in the graph: every rank's backward
        then runs the dispatch's collectives, whatever its routing (a rank leaving them out would hang)."""
        order = torch.argsort((~valid).to(torch.int8), stable=True)
        r = int(valid.sum())  # the host read of this path
        take = order[:max(r, 1)]
        sub, ids = xs.index_select(0, take), ids.index_select(0, take).clamp(max=self.num_experts - 1)
        weight = torch.full((len(take), 1), 1.0 if r else 0.0, dtype=xs.dtype, device=xs.device)
        out = super().forward(sub, ids[:, None], weight)  # type: ignore[misc]
        return xs.new_zeros(xs.shape).index_copy(0, take[:r], out[:r])


_EP_CLASSES: dict[type, type] = {}


def _ep_class(cls: type) -> type:
    if issubclass(cls, _ExpertParallelForward):
        return cls
    if cls not in _EP_CLASSES:
        _EP_CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (_ExpertParallelForward, cls), {})
    return _EP_CLASSES[cls]


def shard_hf_experts(model: nn.Module, ep: int, ep_rank: int, group: dist.ProcessGroup | None,
                     dispatcher: str = "alltoall") -> list[nn.Parameter]:
    """Keep rank ``ep_rank``'s slice of every recognised block's experts (the weights are already equal on
    every rank) and make the experts module dispatch over ``group`` (the ``ep`` ranks); returns the expert
    parameters. ``check_hf_experts`` has accepted the model."""
    # torch 2.13 marks the autograd-aware collectives the dispatchers use deprecated in favour of the
    # functional ones; they remain the documented differentiable c10d calls that run on gloo.
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.nn\.functional\..* is deprecated",
                            category=FutureWarning)
    cls = DISPATCHERS[dispatcher]
    params: list[nn.Parameter] = []
    for b in find_moe_blocks(model):
        n = b.num_experts // ep
        off = ep_rank * n
        ex = b.experts
        params += keep_experts(ex, b.adapter.weights, off, n)
        ex.num_experts = n  # the model's experts forward indexes this rank's experts
        ex.__class__ = _ep_class(type(ex))
        ex._plait_dispatcher = cls(group, off, n, ep, ep_rank)
        if b.adapter.grouped:
            from transformers.integrations.moe import grouped_mm_experts_forward

            for attr, value in b.adapter.grouped:
                setattr(ex, attr, value)
            ex._plait_forward = grouped_mm_experts_forward
        if b.adapter.grouped or hasattr(ex, "_is_expert_parallel"):
            ex._is_expert_parallel = True  # transformers' implementations then skip the padding rows
    return params
