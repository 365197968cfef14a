"""Hugging Face models no one here wrote, through the keep-your-loop API, against plain PyTorch.

A ``LlamaForCausalLM`` (2 layers, hidden 64, 4 heads, 2 key-value heads) and a ``GPT2LMHeadModel``
(tied embeddings) built from small configs with random weights. The reference is one process, plain
PyTorch: the model's own loss (``model(input_ids=x, labels=x).loss``), AdamW, ``clip_grad_norm_``,
over the same global batches of 8 sequences. plait runs the same 5 optimizer steps at dp=2 (its
reducer, DDP, ZeRO-1/2/3, accumulation), tp=2 (the plan the model ships, and an explicit one) and pp=2
(split at ``model.layers.1``, GPipe and 1F1B), every rank starting from other random weights (plait
broadcasts rank 0's), with plait's own ``causal_lm`` loss.

Tolerances: the maths is the reference's, but sums run in another order (gradients averaged over
ranks or accumulated over micro-steps, sharded matmuls, the clip norm summed over shards), so float32
rounding differs: losses within ``LOSS_ATOL`` and parameters within ``PARAM_ATOL`` after 5 AdamW steps
at lr 1e-3. Largest differences measured (torch 2.13 CPU, gloo): losses 1e-6, parameters 7e-7 (Llama at
dp/ZeRO/pp), 1.2e-6 (Llama at tp=2), 2.9e-6 (GPT-2). The bounds leave about 10x margin and stay far
below one optimizer update (~1e-3); the test also checks the updates moved the weights 50x further.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import run_ranks
from references import plait_steps, reference_training

transformers = pytest.importorskip("transformers", reason="the hf extra (pip install 'plait[hf]') is not installed")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

LOSS_ATOL = 1e-5
PARAM_ATOL = 3e-5
STEPS, GLOBAL, SEQ, LR, SEED = 5, 8, 16, 1e-3, 3
LLAMA = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
GPT2 = {"vocab_size": 256, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}
EXPLICIT_PLAN = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
                 "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
                 "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
                 "model.layers.*.mlp.down_proj": "rowwise"}
PP = {"pp": 2, "microbatches": 2, "pp_split": ["model.layers.1"]}
# (model, parallel section, micro batch per rank)
CASES = {
    "dp-plait": ("llama", {}, 4),
    "dp-ddp": ("llama", {"impl": "torch"}, 4),
    "zero1": ("llama", {"zero": 1}, 4),
    "zero2": ("llama", {"zero": 2}, 4),
    "zero3": ("llama", {"zero": 3}, 4),
    "dp-accumulation": ("llama", {"zero": 2}, 2),
    "tp-auto": ("llama", {"tp": 2}, 8),
    "tp-explicit": ("llama", {"tp": 2, "tp_plan": EXPLICIT_PLAN}, 8),
    "pp-gpipe": ("llama", {**PP, "pp_schedule": "gpipe"}, 8),
    "pp-1f1b": ("llama", {**PP, "pp_schedule": "1f1b"}, 8),
    "pp-cost-balanced": ("llama", {"pp": 2, "microbatches": 2}, 8),  # split by costs measured on a sample
    "gpt2-dp": ("gpt2", {}, 4),
    "gpt2-zero3": ("gpt2", {"zero": 3}, 4),
}


def build(kind: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(11)
    return torch.utils.data.TensorDataset(torch.randint(0, 256, (3 * STEPS * GLOBAL, SEQ), generator=g))


def reference(kind: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch in one process, with the model's own loss."""
    return reference_training(build(kind, 0), dataset(), GLOBAL, STEPS, LR, SEED,
                              lambda model, batch: model(input_ids=batch[0], labels=batch[0]).loss)


def train_plait(kind: str, parallel: dict, micro: int, run_dir: str, seed: int) -> dict:
    """plait's keep-your-loop over the same data; every rank builds other weights (``seed``)."""
    import plait

    p = plait.Plait(parallel=parallel, run={"dir": run_dir}, optim={"grad_clip": 1.0},
                    train={"global_batch_size": GLOBAL, "micro_batch_size": micro, "seed": SEED},
                    observe={"progress": False, "trackers": []})
    sample = [dataset().tensors[0][:micro]] if parallel.get("pp", 1) > 1 else None
    model, opt = p.setup(build(kind, seed), optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=LR),
                         loss_fn="causal_lm", sample=sample)
    loader = p.setup_dataloader(dataset())
    comm = []
    losses = plait_steps(p, model, loader, STEPS, lambda info: comm.append(info.comm_bytes))
    state = p.full_state_dict(model)
    p.close()
    return {"losses": losses, "state": state, "comm_bytes": comm}


def _worker(rank: int, world: int, root: str) -> dict:
    out = {name: train_plait(kind, parallel, micro, f"{root}/{name}", seed=rank)
           for name, (kind, parallel, micro) in CASES.items()}
    from plait.parallel.tensor.plan import TensorParallelError

    try:
        train_plait("gpt2", {"tp": 2}, 8, f"{root}/gpt2-tp", seed=rank)
        out["gpt2-tp-error"] = None
    except TensorParallelError as e:
        out["gpt2-tp-error"] = str(e)
    return out if rank == 0 else {"gpt2-tp-error": out["gpt2-tp-error"],
                                  **{k: {"losses": v["losses"], "state": v["state"]} for k, v in out.items()
                                     if k != "gpt2-tp-error"}}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(_worker, 2, str(tmp_path_factory.mktemp("hf")), timeout=600)


@pytest.fixture(scope="module")
def references() -> dict:
    return {kind: reference(kind) for kind in ("llama", "gpt2")}


def _max_diff(state: dict, ref: dict) -> float:
    assert state.keys() == ref.keys()
    return max((state[k].float() - ref[k].float()).abs().max().item() for k in ref)


@pytest.mark.parametrize("name", sorted(CASES))
def test_layout_matches_single_process(results, references, name) -> None:
    kind = CASES[name][0]
    ref_losses, ref_state = references[kind]
    for r in results:
        assert len(r[name]["losses"]) == STEPS
        assert r[name]["losses"] == pytest.approx(ref_losses, abs=LOSS_ATOL), name
    for r in results:  # every rank holds the whole trained model (full_state_dict gathers it)
        assert _max_diff(r[name]["state"], ref_state) < PARAM_ATOL, name
    # ... while training moved the weights far more than that (5 updates of ~lr each)
    assert _max_diff(ref_state, build(kind, 0).state_dict()) > 50 * PARAM_ATOL


@pytest.mark.parametrize("name", ["zero3", "tp-auto", "pp-1f1b", "gpt2-zero3"])
def test_exported_state_loads_into_a_fresh_model_strictly(results, references, name) -> None:
    kind = CASES[name][0]
    fresh = build(kind, 99)
    fresh.load_state_dict(results[0][name]["state"], strict=True)
    assert _max_diff({k: v for k, v in fresh.state_dict().items()}, references[kind][1]) < PARAM_ATOL


def test_accumulation_communicates_once_per_optimizer_step(results) -> None:
    """Micro batch 2 x 2 micro-steps sends exactly what micro batch 4 x 1 does: nothing on the first."""
    a, b = results[0]["dp-accumulation"]["comm_bytes"], results[0]["zero2"]["comm_bytes"]
    assert a == b and all(x > 0 for x in a)


def test_gpt2_auto_tensor_parallel_is_a_clear_error(results) -> None:
    for r in results:
        msg = r["gpt2-tp-error"]
        assert msg is not None and "GPT2LMHeadModel has no tensor-parallel plan" in msg, msg
        assert "Conv1D" in msg and "parallel.tp_plan" in msg and "parallelize_fn" in msg


def test_accumulation_equals_one_big_micro_batch_in_one_process(tmp_path, references) -> None:
    """Accumulation 4 x micro 2 against 1 x micro 8, in this (single) process."""
    a = train_plait("llama", {}, 2, str(tmp_path / "a"), seed=0)
    b = train_plait("llama", {}, 8, str(tmp_path / "b"), seed=0)
    assert a["losses"] == pytest.approx(b["losses"], abs=LOSS_ATOL)
    assert _max_diff(a["state"], b["state"]) < PARAM_ATOL
    assert _max_diff(b["state"], references["llama"][1]) < PARAM_ATOL

