"""Every family of the installed transformers that ships a tensor-parallel plan (``base_model_tp_plan``):
each style in its plan is one plait applies, or plait refuses the family with the reason, before any
collective. Configs only: no weights, no process group (a collective could not run here). The families run
end to end are in test_hf_moe.py (Llama, Qwen2, Mistral, Mixtral, Qwen3-MoE, BERT at tp=2).

The expectation is written from transformers' meaning of each style, not from plait's code: a module style
plait has (``ACCEPTED``), or, for an entry naming a weight of a ``moe_tp_experts`` module, a weight style
(``WEIGHT``); an experts module needs at least one weight entry (its outputs are summed over tp). A
``local_params`` module's own parameters (attention sinks) take ``colwise`` or ``rowwise``. Families whose plan
leaves attention out (DeepSeek-V3, GPT-OSS) are checked with plait's added entries (``ADDED_PLANS``) too.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from torch import nn

from plait.parallel.tensor.hf import ADDED_PLANS, HFPlan, hf_tp_function, plan_refusals
from plait.parallel.tensor.plan import TensorParallelError

transformers = pytest.importorskip("transformers", reason="the hf extra (pip install 'plait[hf]') is not installed")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ACCEPTED = {"colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "embedding_rowwise", "replicate",
            "moe_tp_experts", "replicated_with_grad_allreduce", "mla_kv_a_proj", "local_params"}
WEIGHT = {"colwise", "rowwise", "packed_colwise", "packed_rowwise"}
END_TO_END = ("llama", "qwen2", "mistral", "mixtral", "qwen3_moe")


def shipped_plans() -> dict[str, dict[str, str]]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    out = {}
    for model_type, name in CONFIG_MAPPING_NAMES.items():
        plan = getattr(getattr(transformers, name, None), "base_model_tp_plan", None)
        if plan:
            out[model_type] = dict(plan)
    return out


def offending(plan: dict[str, str]) -> set[str]:
    """The entries (``pattern -> style``) plait should refuse, by transformers' meaning of the styles."""
    experts = {k for k, v in plan.items() if v == "moe_tp_experts"}
    bad = {f"{k} -> {v}" for k, v in plan.items()
           if v not in (WEIGHT if k.rpartition(".")[0] in experts else ACCEPTED)}
    return bad | {f"{e} -> moe_tp_experts" for e in experts if not any(k.rpartition(".")[0] == e for k in plan)}


class ShippedOnly(nn.Module):
    """A model reduced to its config's shipped plan (no modules, no weights)."""

    base_model_prefix = ""

    def __init__(self, model_type: str, plan: dict[str, str]) -> None:
        super().__init__()
        self.config = SimpleNamespace(model_type=model_type, base_model_tp_plan=plan)


def test_every_shipped_plan_is_applied_or_refused_with_its_reason() -> None:
    plans = shipped_plans()
    assert len(plans) > 50 and all(t in plans for t in END_TO_END)
    refused = {}
    for model_type, plan in plans.items():
        model = ShippedOnly(model_type, plan)
        fn = hf_tp_function(model, "auto", expert_parallel=False)
        plan = {**plan, **ADDED_PLANS.get(model_type, {})}
        assert isinstance(fn, HFPlan) and fn.plan == plan, model_type
        bad = offending(plan)
        reasons = plan_refusals(plan)
        assert {r.split(":")[0] for r in reasons} == bad, (model_type, reasons, bad)
        if bad:
            with pytest.raises(TensorParallelError, match="has a style plait does not apply") as e:
                fn.check(model, 2)
            assert any(b in str(e.value) for b in bad), (model_type, str(e.value))
            refused[model_type] = sorted(bad)
        else:
            fn.check(model, 2)
    assert not dist.is_initialized()  # nothing above could have communicated
    assert not any(t in refused for t in END_TO_END)
    # the refused families are a minority, each for a style transformers itself documents as special (or, in
    # transformers 5.17's qwen3_omni_moe_text, a packed expert weight whose module is not moe_tp_experts)
    assert 0 < len(refused) < len(plans) / 4, refused
    styles = {b.rsplit(" -> ", 1)[1] for bad in refused.values() for b in bad}
    assert styles <= {"all_reduce", "moe_identity_expert", "embedding_colwise", "packed_colwise", "packed_rowwise"}, \
        styles


def test_encoders_without_a_shipped_plan_get_the_inferred_one() -> None:
    bert = transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                                num_attention_heads=4, intermediate_size=64))
    fn = hf_tp_function(bert, "auto", expert_parallel=False)
    assert fn is not None and fn.plan["bert.encoder.layer.*.attention.self.query"] == "colwise"
    assert fn.plan["bert.encoder.layer.*.output.dense"] == "rowwise"
    fn.check(bert, 2)
    with pytest.raises(TensorParallelError, match="num_attention_heads=4, which does not divide by parallel.tp=3"):
        fn.check(bert, 3)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64))
    assert hf_tp_function(gpt2, "auto", expert_parallel=False) is None  # plait.parallel.tensor.plan's Conv1D error
