"""The shape of a decoder-only transformer: what the cost and memory models need to know about a model.

Three ways in, one ``ModelShape`` out:

* plait's GPT from ``[model]`` keys (``gpt_shape``): pre-LayerNorm blocks, 4x GELU MLP, biases, learned
  positions, tied embeddings;
* a Hugging Face config (``shape_from_hf``): ``hidden_size``, ``num_hidden_layers``,
  ``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size``, ``vocab_size``,
  ``tie_word_embeddings`` (GPT-2's ``n_embd``/``n_layer``/``n_head``/``n_inner`` too); Llama-style
  configs get a gated (SwiGLU) MLP, RMSNorm and rotary positions;
* any ``model.factory`` / ``model.name`` (``plait.plan.record.shape_from_config``): the model is built on
  the meta device
  (no memory, so a 400B-parameter model is fine here) and read through its registered spec's shape (plait's
  GPT: ``plait.models.gpt.shape``) or its ``config`` (Hugging Face); its exact parameter count is kept.

Parameter count (``ModelShape.param_count``), per block: attention ``C (C + 2 C_kv) + C^2`` weights
(``C_kv = n_kv_head * C / n_head``), MLP ``2 C F`` (gated: ``3 C F``), biases where the model has them,
two norms; plus the token table ``V C``, learned positions ``P C``, the final norm and an untied head ``V C``.
A mixture-of-experts block (plait's GPT with ``[moe]``: ``plait.nn.MoE`` in every ``moe.every``-th block)
has instead of the MLP a router ``C E``, ``E`` experts of ``2 C H`` weights (no biases) and ``S`` shared
experts of ``2 C H + H + C``; a token runs ``top_k`` experts, so its active MLP weights are
``C E + (k + S) 2 C H``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from plait.config import Config, ConfigError

GATED_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo", "olmo2",
                     "granite", "cohere", "starcoder2_gated", "deepseek_v3")


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a decoder-only transformer (see the module docstring)."""

    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    d_ff: int
    vocab_size: int
    seq_len: int
    gated_mlp: bool = False
    tied_embeddings: bool = True
    learned_positions: bool = True
    bias: bool = True
    norm: str = "layernorm"
    dropout: float = 0.0
    name: str = "gpt"
    positions: int = 0  # rows of the learned position table (0: seq_len)
    exact_params: int = 0  # the model's own count when it was built (0: the formula's)
    num_experts: int = 0  # MoE blocks' experts (0: a dense model); see the module docstring
    top_k: int = 1
    moe_every: int = 1  # blocks every-1, 2 every-1, ... are MoE
    expert_hidden: int = 0
    shared_experts: int = 0
    capacity_factor: float = 0.0  # moe.capacity_factor (0: dropless)
    moe_dispatch: str = "alltoall"  # moe.dispatcher: static buffers (alltoall) or sized by the routing
    moe_imbalance: float = 1.0  # the busiest expert-parallel rank's rows over the balanced share

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection: ``n_kv_head * head_dim``."""
        return self.n_kv_head * self.head_dim

    @property
    def norm_params(self) -> int:
        return 2 * self.d_model if self.norm == "layernorm" else self.d_model

    def block_matmul_params(self) -> int:
        """Weights of one block's matrix multiplications (no biases, no norms)."""
        c, f = self.d_model, self.d_ff
        return c * (c + 2 * self.kv_dim) + c * c + (3 if self.gated_mlp else 2) * c * f

    def is_moe(self, index: int) -> bool:
        """Whether block ``index`` has a mixture-of-experts feed-forward."""
        return self.num_experts > 0 and (index + 1) % self.moe_every == 0

    @property
    def moe_blocks(self) -> int:
        return sum(self.is_moe(i) for i in range(self.n_layer))

    def dense_mlp_params(self) -> int:
        """The dense MLP's weights and biases (what a MoE block replaces)."""
        c, f = self.d_model, self.d_ff
        biases = ((2 * f if self.gated_mlp else f) + c) if self.bias else 0
        return (3 if self.gated_mlp else 2) * c * f + biases

    def expert_params(self) -> int:
        """The routed experts' weights of one MoE block (what expert parallelism shards)."""
        return self.num_experts * 2 * self.d_model * self.expert_hidden

    def moe_mlp_params(self) -> int:
        """Router, routed experts and shared experts of one MoE block."""
        c, h = self.d_model, self.expert_hidden
        return c * self.num_experts + self.expert_params() + self.shared_experts * (2 * c * h + h + c)

    def mean_active_block_matmul_params(self) -> float:
        """Matmul weights a token runs through per block, averaged over the blocks (dense: all of them)."""
        dense = self.block_matmul_params()
        if not self.num_experts:
            return float(dense)
        c, h = self.d_model, self.expert_hidden
        moe = dense - (3 if self.gated_mlp else 2) * c * self.d_ff + c * self.num_experts \
            + (self.top_k + self.shared_experts) * 2 * c * h
        return (dense * (self.n_layer - self.moe_blocks) + moe * self.moe_blocks) / self.n_layer

    def block_params(self) -> int:
        """All parameters of one (dense) block: weights, biases and both norms."""
        c, f = self.d_model, self.d_ff
        biases = (c + 2 * self.kv_dim + c + ((2 * f if self.gated_mlp else f) + c)) if self.bias else 0
        return self.block_matmul_params() + biases + 2 * self.norm_params

    def embedding_params(self) -> int:
        """Token table and learned positions (the input side)."""
        pos = (self.positions or self.seq_len) * self.d_model if self.learned_positions else 0
        return self.vocab_size * self.d_model + pos

    def head_params(self) -> int:
        """Final norm and, when untied, the output head."""
        return self.norm_params + (0 if self.tied_embeddings else self.vocab_size * self.d_model)

    def param_count(self) -> int:
        """Parameters counted once (a tied head shares the token table); the model's own count if known."""
        if self.exact_params:
            return self.exact_params
        moe = self.moe_blocks * (self.moe_mlp_params() - self.dense_mlp_params())
        return self.embedding_params() + self.n_layer * self.block_params() + moe + self.head_params()

    def formula_params(self) -> int:
        """The formula's count, even when the model's own count is known (for checking one against the other)."""
        return replace(self, exact_params=0).param_count()


def gpt_shape(n_layer: int, d_model: int, n_head: int, seq_len: int, vocab_size: int,
              dropout: float = 0.0) -> ModelShape:
    """plait's GPT (``plait.models.gpt``): 4x GELU MLP, biases, LayerNorm, learned positions, tied head."""
    return ModelShape(n_layer=n_layer, d_model=d_model, n_head=n_head, n_kv_head=n_head, d_ff=4 * d_model,
                      vocab_size=vocab_size, seq_len=seq_len, dropout=dropout, name="gpt")


def _hf_get(cfg: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        value = cfg.get(n) if isinstance(cfg, dict) else getattr(cfg, n, None)
        if value is not None:
            return value
    return default


def shape_from_hf(config: Any, seq_len: int) -> ModelShape:
    """A shape from a Hugging Face config object or dict; ``seq_len`` is the training sequence length.

    Raises ``ConfigError`` naming the missing key when the config is not a decoder's."""
    hidden = _hf_get(config, "hidden_size", "n_embd", "d_model")
    layers = _hf_get(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _hf_get(config, "num_attention_heads", "n_head")
    vocab = _hf_get(config, "vocab_size")
    for key, value in (("hidden_size", hidden), ("num_hidden_layers", layers), ("num_attention_heads", heads),
                       ("vocab_size", vocab)):
        if value is None:
            raise ConfigError(f"the model's config has no {key}: plait simulates decoder-only transformers whose "
                              "config gives hidden_size, num_hidden_layers, num_attention_heads and vocab_size")
    experts = _hf_get(config, "num_local_experts", "num_experts", "n_routed_experts")
    if experts:
        raise ConfigError(f"the model's config has {experts} experts per layer: the simulator models plait's own "
                          "mixture of experts ([moe] with model.name=gpt), not a Hugging Face MoE model's experts yet")
    model_type = str(_hf_get(config, "model_type", default=""))
    act = str(_hf_get(config, "hidden_act", "activation_function", default=""))
    gated = bool(_hf_get(config, "gated_mlp", default=model_type in GATED_MODEL_TYPES or act in ("silu", "swiglu")))
    llama_like = gated or model_type in GATED_MODEL_TYPES
    ff = _hf_get(config, "intermediate_size", "n_inner", "ffn_dim", default=None) or 4 * int(hidden)
    bias = bool(_hf_get(config, "attention_bias", "bias", default=not llama_like))
    positions = int(_hf_get(config, "max_position_embeddings", "n_positions", default=seq_len))
    return ModelShape(
        n_layer=int(layers), d_model=int(hidden), n_head=int(heads),
        n_kv_head=int(_hf_get(config, "num_key_value_heads", default=heads)), d_ff=int(ff), vocab_size=int(vocab),
        seq_len=seq_len, gated_mlp=gated, tied_embeddings=bool(_hf_get(config, "tie_word_embeddings", default=True)),
        learned_positions=not llama_like and model_type not in ("bloom",), bias=bias,
        norm="rmsnorm" if llama_like else "layernorm",
        dropout=float(_hf_get(config, "attention_dropout", "attn_pdrop", default=0.0) or 0.0),
        name=model_type or "hf", positions=positions)


def count_params(model: Any) -> int:
    """Parameters of ``model`` counted once (tied weights once), meta tensors included."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def shape_from_model(model: Any, seq_len: int) -> ModelShape:
    """The shape of a built Hugging Face model through its ``config``; the exact parameter count is the model's.
    Raises ``ConfigError`` for a model without one. (A model class with a registered spec, plait's GPT, gives its
    own: ``plait.parallel.train_spec.model_shape`` asks it first.)"""
    if getattr(model, "config", None) is None:
        raise ConfigError(
            f"plait simulate needs a transformer's shape, and the model ({type(model).__name__}) has neither a "
            "Hugging Face .config nor a registered spec giving its shape (plait.register_train_spec); build it from a "
            "Hugging Face config (e.g. AutoModelForCausalLM.from_config) or use model.name=gpt")
    return replace(shape_from_hf(model.config, seq_len), exact_params=count_params(model))


def with_moe(shape: ModelShape, cfg: Config) -> ModelShape:
    """``shape`` with the ``[moe]`` section's experts (plait's GPT: ``plait.models.gpt.model._moe_layer``)."""
    moe = getattr(cfg, "moe", None)
    if moe is None or moe.num_experts <= 0:
        return shape
    hidden = moe.d_hidden or max(1, 4 * shape.d_model // moe.top_k)
    return replace(shape, num_experts=moe.num_experts, top_k=moe.top_k, moe_every=moe.every, expert_hidden=hidden,
                   shared_experts=moe.shared_experts, capacity_factor=moe.capacity_factor,
                   moe_dispatch=moe.dispatcher, moe_imbalance=max(1.0, moe.imbalance))
