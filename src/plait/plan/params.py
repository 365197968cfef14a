"""The parameters one rank holds: names, full shapes, local shapes under tensor parallelism, and layers.

The list follows the model's registration order (the order the data-parallel reducer and ZeRO bucket
them in, reversed) for plait's GPT and for Llama-style Hugging Face decoders, and shards them as the
tensor-parallel plans plait applies do: plait's GPT plan (``plait.models.gpt.parallelize``: q, k, v and the MLP's
first layer column-parallel with their biases, the two output projections row-parallel with replicated
biases, the token table vocabulary-parallel, norms and positions replicated) and the plan a Hugging Face
model ships (block projections only; ``lm_head`` column-parallel). ``layer`` is -1 for the embedding,
``n_layer`` for the final norm and head, else the block index. A MoE block of plait's GPT holds a router,
the routed experts' two batched weights (``expert``: sharded over ``parallel.ep`` on dim 0) and shared
experts; ``param_list(..., ep=N)`` gives the rank's local experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plait.plan.shapes import ModelShape


@dataclass(frozen=True)
class Param:
    """One parameter: ``shape`` is the full one, ``shard_dim`` the dim tensor parallelism splits (None:
    replicated), ``layer`` where it lives (see the module docstring)."""

    name: str
    shape: tuple[int, ...]
    layer: int
    shard_dim: int | None = None
    expert: bool = False

    def numel(self) -> int:
        return math.prod(self.shape)

    def local_shape(self, tp: int) -> tuple[int, ...]:
        if self.shard_dim is None or tp == 1:
            return self.shape
        s = list(self.shape)
        s[self.shard_dim] = math.ceil(s[self.shard_dim] / tp)
        return tuple(s)

    def local_numel(self, tp: int) -> int:
        return math.prod(self.local_shape(tp))


def _gpt_block(s: ModelShape, i: int, ep: int = 1) -> list[Param]:
    c, f, pre = s.d_model, s.d_ff, f"blocks.{i}."
    out = [Param(pre + "ln1.weight", (c,), i), Param(pre + "ln1.bias", (c,), i)]
    for name in ("q", "k", "v"):
        width = c if name == "q" else s.kv_dim
        out += [Param(f"{pre}attn.{name}.weight", (width, c), i, 0), Param(f"{pre}attn.{name}.bias", (width,), i, 0)]
    out += [Param(pre + "attn.proj.weight", (c, c), i, 1), Param(pre + "attn.proj.bias", (c,), i),
            Param(pre + "ln2.weight", (c,), i), Param(pre + "ln2.bias", (c,), i)]
    if s.is_moe(i):
        return out + _moe_mlp(s, i, pre + "mlp.", ep)
    return out + [Param(pre + "mlp.fc.weight", (f, c), i, 0), Param(pre + "mlp.fc.bias", (f,), i, 0),
                  Param(pre + "mlp.proj.weight", (c, f), i, 1), Param(pre + "mlp.proj.bias", (c,), i)]


def _moe_mlp(s: ModelShape, i: int, pre: str, ep: int) -> list[Param]:
    """``plait.nn.MoE``: router, this rank's ``E / ep`` experts, shared experts (in registration order)."""
    c, h, e = s.d_model, s.expert_hidden, s.num_experts // ep
    out = [Param(pre + "router.weight", (s.num_experts, c), i),
           Param(pre + "experts.w1", (e, c, h), i, expert=True), Param(pre + "experts.w2", (e, h, c), i, expert=True)]
    for j in range(s.shared_experts):
        out += [Param(f"{pre}shared.{j}.fc.weight", (h, c), i), Param(f"{pre}shared.{j}.fc.bias", (h,), i),
                Param(f"{pre}shared.{j}.proj.weight", (c, h), i), Param(f"{pre}shared.{j}.proj.bias", (c,), i)]
    return out


def _hf_block(s: ModelShape, i: int) -> list[Param]:
    c, f, pre = s.d_model, s.d_ff, f"model.layers.{i}."
    out = []
    for name, width in (("q_proj", c), ("k_proj", s.kv_dim), ("v_proj", s.kv_dim)):
        out.append(Param(f"{pre}self_attn.{name}.weight", (width, c), i, 0))
        if s.bias:
            out.append(Param(f"{pre}self_attn.{name}.bias", (width,), i, 0))
    out.append(Param(pre + "self_attn.o_proj.weight", (c, c), i, 1))
    if s.bias:
        out.append(Param(pre + "self_attn.o_proj.bias", (c,), i))
    mlp = ["gate_proj", "up_proj"] if s.gated_mlp else ["fc_in"]
    out += [Param(f"{pre}mlp.{name}.weight", (f, c), i, 0) for name in mlp]
    out.append(Param(pre + "mlp.down_proj.weight", (c, f), i, 1))
    norms = ["input_layernorm", "post_attention_layernorm"]
    out += [Param(f"{pre}{n}.weight", (c,), i) for n in norms]
    if s.norm == "layernorm":
        out += [Param(f"{pre}{n}.bias", (c,), i) for n in norms]
    return out


def param_list(shape: ModelShape, layers: range | None = None, *, first: bool = True, last: bool = True,
               ep: int = 1) -> list[Param]:
    """Parameters of the stage owning blocks ``layers`` (default: all), with the embedding when ``first``
    and the final norm and head when ``last``; a tied head on a last stage that is not also the first gets
    its own copy of the token table (plait unties embeddings across pipeline stages). MoE blocks hold
    ``num_experts / ep`` experts."""
    s, c, v = shape, shape.d_model, shape.vocab_size
    layers = range(s.n_layer) if layers is None else layers
    gpt = s.name == "gpt"
    out: list[Param] = []
    if first:
        out.append(Param("tok_emb.weight" if gpt else "model.embed_tokens.weight", (v, c), -1, 0 if gpt else None))
        if s.learned_positions:
            out.append(Param("pos_emb.weight" if gpt else "model.embed_positions.weight",
                             (s.positions or s.seq_len, c), -1))
    for i in layers:
        out += _gpt_block(s, i, ep) if gpt else _hf_block(s, i)
    if last:
        norm = "ln_f" if gpt else "model.norm"
        out.append(Param(f"{norm}.weight", (c,), s.n_layer))
        if s.norm == "layernorm":
            out.append(Param(f"{norm}.bias", (c,), s.n_layer))
        if not s.tied_embeddings or not first:
            out.append(Param("head.weight" if gpt else "lm_head.weight", (v, c), s.n_layer, 0))
    return out


def local_numel(params: list[Param], tp: int) -> int:
    """Elements this rank holds of ``params`` under tensor parallelism of degree ``tp``."""
    return sum(p.local_numel(tp) for p in params)
