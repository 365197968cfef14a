"""plait against the transformers releases it declares (``transformers>=5.17,<6``, issue 26 item 5).

The pipeline stages of a Hugging Face decoder build the causal mask with ``create_causal_mask``, whose cache
argument is ``past_key_values`` in 5.17 (the GPU machines' release) and ``cache`` in later 5.x releases, which
warn on the old name. The installed release is called for real (no warning, a causal mask); 5.17's signature
is checked with a stand-in of it; and the installed release is one the project declares.
"""

from __future__ import annotations

import tomllib
import warnings
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")


def _config() -> object:
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    cfg._attn_implementation = "eager"  # an explicit mask tensor (sdpa may leave causality to the kernel)
    return cfg


def test_causal_mask_without_deprecation_warnings() -> None:
    from plait.parallel.pipeline.hf import _masks

    embeds, positions = torch.zeros(2, 5, 16), torch.arange(5).unsqueeze(0)  # (B, T, C), (1, T)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any FutureWarning / DeprecationWarning fails the test
        masks = _masks(_config(), embeds, positions)
    assert list(masks) == ["full_attention"]  # Llama: no sliding window
    mask = masks["full_attention"]
    assert mask.shape == (2, 1, 5, 5)
    allowed = mask[0, 0] == 0  # eager masks: 0 where a query may attend, the dtype's minimum elsewhere
    assert torch.equal(allowed, torch.ones(5, 5, dtype=torch.bool).tril())


def test_causal_mask_with_the_5_17_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 5.17 names the cache ``past_key_values`` (and has no ``cache``): plait passes that name."""
    import transformers.masking_utils as mu

    from plait.parallel.pipeline.hf import _masks

    seen = {}

    def create_causal_mask(config, inputs_embeds, attention_mask, past_key_values, position_ids=None,
                           or_mask_function=None, and_mask_function=None, block_sequence_ids=None, layer_idx=None,
                           allow_is_causal_skip=True):
        seen.update(attention_mask=attention_mask, past_key_values=past_key_values, position_ids=position_ids)
        return "mask"

    monkeypatch.setattr(mu, "create_causal_mask", create_causal_mask)
    positions = torch.arange(4).unsqueeze(0)
    assert _masks(_config(), torch.zeros(1, 4, 16), positions)["full_attention"] == "mask"
    assert seen["attention_mask"] is None and seen["past_key_values"] is None and seen["position_ids"] is positions


def test_installed_transformers_is_declared() -> None:
    from packaging.requirements import Requirement

    pyproject = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    for extra in ("hf", "dev"):
        (req,) = [Requirement(r) for r in extras[extra] if r.startswith("transformers")]
        assert str(req.specifier) == "<6,>=5.17", extra
        assert req.specifier.contains(version("transformers")), (extra, version("transformers"))


def test_sliding_window_layers_get_the_sliding_mask_and_other_kinds_are_refused() -> None:
    """GPT-OSS's layer types and Mistral's config-wide window: each layer gets the mask the base model gives it
    (a stage that gave every layer the causal mask trained a different model, silently)."""
    from plait.parallel.pipeline.hf import _mask_kind, _masks
    from plait.plan.schedule import PipelineConfigError

    cfg = transformers.GptOssConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=8, sliding_window=2,
                                    layer_types=["sliding_attention", "full_attention"])
    cfg._attn_implementation = "eager"
    assert [_mask_kind(cfg, i) for i in (0, 1)] == ["sliding_attention", "full_attention"]
    masks = _masks(cfg, torch.zeros(1, 5, 16), torch.arange(5).unsqueeze(0))
    allowed = masks["sliding_attention"][0, 0] == 0
    ones = torch.ones(5, 5, dtype=torch.bool)
    assert torch.equal(allowed, ones.tril() & ~ones.tril(-2))  # itself and the one before
    mistral = transformers.MistralConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, sliding_window=3)
    assert _mask_kind(mistral, 0) == "sliding_attention"
    cfg.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(PipelineConfigError, match="'chunked_attention'"):
        _mask_kind(cfg, 0)
