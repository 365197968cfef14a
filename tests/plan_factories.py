"""Model factories for the simulator's tests (``model.factory = "plan_factories:..."``)."""

from __future__ import annotations


def llama(hidden: int = 16384, layers: int = 126, heads: int = 128, kv_heads: int = 8, ffn: int = 53248,
          vocab: int = 128256):
    """A Llama-3-405B-shaped decoder from a Hugging Face config; on the meta device it takes no memory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=ffn, vocab_size=vocab,
                         tie_word_embeddings=False, max_position_embeddings=8192)
    return LlamaForCausalLM(config)


def not_a_transformer():
    """A model the simulator cannot read a transformer shape from."""
    import torch

    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
