"""Hugging Face mixture-of-experts models at expert parallelism, and Hugging Face's shipped tensor-parallel
plans (``parallel.tp_plan = "auto"``), through the keep-your-loop API against plain PyTorch.

Models from small configs with random weights (2 layers, hidden 32, 4 heads, 2 key-value heads; 4 experts of
width 32, top-2; the models' own auxiliary load-balancing loss on, ``output_router_logits=True`` with
coefficient 0.1): Mixtral, Qwen2-MoE (with its shared expert), Qwen3-MoE (per-head q/k norms), OLMoE, GPT-OSS
(experts with biases and a clamped SwiGLU, attention sinks, a sliding-window layer of window 4 < the sequence) and
DeepSeek-V3 (multi-head latent attention, a sigmoid router choosing among 1 of 2 expert groups with a random
balancing bias and scaled gates, a shared expert; it has no auxiliary loss), and for the shipped plans Llama,
Qwen2 and Mistral, and BERT (masked LM, no shipped plan: plait infers one). The routers are the models' own,
untouched: DeepSeek-V3's bias is a buffer transformers never updates in training, and stays as it is.

The reference is the user's own loop in one plain PyTorch process: the model's own loss (``model(input_ids=x,
labels=x).loss``, the auxiliary loss included), each data-parallel rank's micro-batch as one accumulation
micro-step of 1/dp, ``clip_grad_norm_(1.0)``, AdamW at lr 1e-3, 3 steps. plait runs the same loop at world 2
(ep=2 of dp=2 for the six MoE families; tp=2 with the shipped or inferred plan) and world 4 for Mixtral, Qwen2-MoE,
DeepSeek-V3 and GPT-OSS (ep=2 with ZeRO-2 and ZeRO-3 at dp=4, the experts' optimizer states or weights sharded
again over the 2 ranks holding them; ep=2 with tp=2 attention, DeepSeek-V3's latent attention and GPT-OSS's sinks
by plait's added plans; ep=2 with pp=2, plait's causal-LM loss over 2 pipeline micro-batches and the auxiliary
loss off, as a pipeline refuses it), every rank starting from other random weights (plait broadcasts rank 0's).

Tolerances: fp32, the same maths summed in another order (all-to-all, sharded matmuls, gradients averaged over
ranks), so losses within ``LOSS_ATOL`` and parameters within ``PARAM_ATOL`` after 3 AdamW steps (about 3% of one
step's size), beyond each element's slack. AdamW's first update of an element is lr g / (|g| + eps): where a gradient
is within about eps = 1e-8 of 0, its slope in g is up to lr / eps = 1e5, so the gradient's rounding (up to
``GRAD_RTOL`` of its tensor's largest element) alone moves the update by up to a step. The reference computes, for
every element and step, how far AdamW's update moves across that rounding (``adam_slack``): 0 to 14 elements of
22,000 to 42,000 per model get more than ``PARAM_ATOL``. One is GPT-OSS's layer-1 expert-2 ``down_proj[26, 13]``:
9 rows' terms of 2e-5 to 9e-4 cancel to a first gradient of 6.8e-10 (float64), 6.4e-10 in the reference, 1.4e-9 at
ep2-tp2 (tp=2 sums attention's outputs in another order), so it ends 6.25e-5 from the reference there, 6.33e-5 at
tp=2 alone (its slack: 6.3e-4; the reference itself moves it by 5.8e-6 between transformers' eager and grouped_mm
experts functions). Where it ends depends on the CPU kernels torch 2.13 picks, not on transformers (5.17 and 5.24 give
the same): 6.25e-5 with AVX-512, 2.2e-5 with AVX2 (``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
ONEDNN_MAX_CPU_ISA=AVX2``), 3.25e-5 with SSE. Largest measured on torch 2.13 CPU, transformers 5.24, under those three:
losses 4.8e-7; parameters 4.0e-6 beyond their slack (GPT-OSS at ep2-tp2 with AVX-512: expert 2's gate column feeding
that element, through its later gradients), 3.0e-6 everywhere else (Llama and Mistral at tp=2 with SSE).
Checkpoints: expert weights saved at ep=2 load at ep=1 exactly (0.0) and training resumes on the uninterrupted
run's losses. A family plait cannot route (GLM-4-MoE) is refused by name.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from helpers import run_ranks

transformers = pytest.importorskip("transformers", reason="the hf extra (pip install 'plait[hf]') is not installed")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

STEPS, GLOBAL, SEQ, V, LR = 3, 4, 8, 64, 1e-3
LOSS_ATOL, PARAM_ATOL = 1e-5, 3e-5
# fp32 gradients of the same maths summed in another order differ by at most this fraction of their tensor's largest
# element (measured at step 1 on torch 2.13 CPU: <= 9.0e-7 at ep2-tp2 for GPT-OSS and DeepSeek-V3 with AVX-512, AVX2
# and SSE kernels, for Mixtral and Qwen2-MoE with AVX-512)
GRAD_RTOL = 2e-6
COMMON = {"vocab_size": V, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 64}
MOE = {"output_router_logits": True, "router_aux_loss_coef": 0.1, "num_experts_per_tok": 2}
MOE_KINDS = ("mixtral", "qwen2moe", "qwen3moe", "olmoe")


def first_two(gate: torch.nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A router sending every token to experts 0 and 1 (held by ep rank 0: rank 1 receives no token), its
    weights still the router's softmax over those two, so the router trains."""
    logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)  # (N, E)
    return logits, logits[:, :2].float().softmax(-1), torch.tensor([0, 1]).expand(len(logits), 2)


def build(kind: str, seed: int, aux: bool = True) -> torch.nn.Module:
    """The model of ``kind`` with random weights from ``seed``; ``aux=False``: no auxiliary loss."""
    tf = transformers
    torch.manual_seed(seed)
    moe = {**MOE, "output_router_logits": aux}
    if kind == "mixtral-idle":
        model = build("mixtral", seed, aux)
        for layer in model.model.layers:
            layer.mlp.gate.forward = functools.partial(first_two, layer.mlp.gate)
        return model
    if kind == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(intermediate_size=32, num_local_experts=4, **moe, **COMMON))
    if kind == "qwen2moe":
        return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                                                        shared_expert_intermediate_size=32, **moe, **COMMON))
    if kind == "qwen3moe":
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                                                        head_dim=8, **moe, **COMMON))
    if kind == "olmoe":
        return tf.OlmoeForCausalLM(tf.OlmoeConfig(intermediate_size=32, num_experts=4, **moe, **COMMON))
    if kind == "deepseekv3":
        return deepseek_v3(seed)
    if kind == "gptoss":
        return tf.GptOssForCausalLM(tf.GptOssConfig(
            num_local_experts=4, intermediate_size=32, head_dim=8, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"], rope_parameters={"rope_type": "default",
                                                                                  "rope_theta": 10000.0},
            **moe, **COMMON))
    if kind == "bert":
        return tf.BertForMaskedLM(tf.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0,
                                                attention_probs_dropout_prob=0.0))
    config = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig}[kind]
    return {"llama": tf.LlamaForCausalLM, "qwen2": tf.Qwen2ForCausalLM, "mistral": tf.MistralForCausalLM}[kind](
        config(intermediate_size=64, **COMMON))


def deepseek_v3(seed: int) -> torch.nn.Module:
    """DeepSeek-V3 (multi-head latent attention, sigmoid router over 2 groups choosing 1, a shared expert, scaled
    gates) with a random balancing bias, so the bias changes which experts are chosen."""
    tf = transformers
    torch.manual_seed(seed)
    common = {**COMMON, "num_key_value_heads": 4}
    model = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=0, n_group=2,
        topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, intermediate_size=32, **common))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(std=0.3)  # transformers initialises it to zeros: every score would tie
            layer.mlp.gate.e_score_correction_bias.normal_(std=0.1)
    return model


def batch(step: int) -> torch.Tensor:
    """The global batch of ``step``: (GLOBAL, SEQ) token ids; data-parallel rank r of dp takes the r-th of dp
    equal row blocks."""
    return torch.randint(0, V, (GLOBAL, SEQ), generator=torch.Generator().manual_seed(100 + step))


def loss_of(model: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    return model(input_ids=rows, labels=rows).loss  # the model's own loss, its auxiliary loss included


def adam_slack(opt: torch.optim.Optimizer, p: torch.nn.Parameter, step: int) -> torch.Tensor:
    """How far AdamW's ``step``-th update of ``p`` (about to be taken from ``p.grad``) moves, element by element,
    when that gradient is off by the rounding bound ``GRAD_RTOL`` x its tensor's largest element, either way
    (sampled across that interval). 0 where the gradient is exactly 0: no term was summed (a token absent, an
    expert without rows), so no order changes it."""
    group = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
    (b1, b2), eps, lr = group["betas"], group["eps"], group["lr"]
    state = opt.state.get(p, {})
    m, v, g = state.get("exp_avg", torch.zeros_like(p)), state.get("exp_avg_sq", torch.zeros_like(p)), p.grad

    def update(x: torch.Tensor) -> torch.Tensor:  # torch's AdamW step, its decoupled decay aside (the same in both)
        v_hat = (b2 * v + (1 - b2) * x * x) / (1 - b2 ** step)
        return lr * (b1 * m + (1 - b1) * x) / (1 - b1 ** step) / (v_hat.sqrt() + eps)

    shifts = torch.linspace(-1, 1, 9).view(-1, *[1] * g.dim()) * (GRAD_RTOL * g.abs().max())  # (9, 1, ...)
    moved = (update(g + shifts) - update(g)).abs().amax(0)
    return torch.where(g == 0, 0.0, moved)


def reference(kind: str, dp: int, aux: bool = True) -> tuple[list[float], dict[str, torch.Tensor],
                                                             dict[str, torch.Tensor]]:
    """Plain PyTorch in one process: each data-parallel rank's rows as an accumulation micro-step of 1/dp. Returns
    the losses, the final state and each parameter's slack (``adam_slack`` summed over the steps)."""
    model = build(kind, 0, aux)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    entries = {k: v for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, torch.nn.Parameter)}
    slack = {k: torch.zeros_like(v) for k, v in entries.items()}
    losses = []
    for s in range(STEPS):
        total = 0.0
        for rows in batch(s).chunk(dp):
            loss = loss_of(model, rows)
            (loss / dp).backward()
            total += loss.item() / dp
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with torch.no_grad():
            for k, q in entries.items():
                if q.grad is not None:
                    slack[k] += adam_slack(opt, q, s + 1)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, slack


def _plait(root: str, name: str, parallel: dict):
    import plait

    dp = torch.distributed.get_world_size() // parallel.get("tp", 1) // parallel.get("pp", 1)
    return plait.Plait(parallel=parallel, run={"dir": f"{root}/{name}"}, optim={"grad_clip": 1.0},
                       train={"global_batch_size": GLOBAL, "micro_batch_size": GLOBAL // dp, "seed": 0},
                       observe={"progress": False, "trackers": []})


def _train(p, model, steps: range, pipeline: bool = False) -> list[float]:
    losses = []
    for s in steps:
        rows = batch(s).chunk(p.topology.dp)[p.dp_rank]
        if pipeline:  # the stages run inside the schedule: plait computes the causal-LM loss
            p.forward_backward(model, rows)
        else:
            p.backward(loss_of(model, rows))
        losses.append(p.step().global_loss)
    return losses


def run_case(root: str, name: str, kind: str, parallel: dict, rank: int) -> dict:
    """3 steps of the user's loop under ``parallel`` from rank-dependent weights; losses and the full state."""
    pipeline = parallel.get("pp", 1) > 1
    p = _plait(root, name, parallel)
    model, _ = p.setup(build(kind, rank, aux=not pipeline), loss_fn="causal_lm" if pipeline else None,
                       optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=LR),
                       pp_split=["model.layers.1"] if pipeline else None)
    losses = _train(p, model, range(STEPS), pipeline)
    state = {k: v.detach().clone() for k, v in p.full_state_dict(model).items()}
    p.close()
    return {"losses": losses, "state": state}


def _setup_error(root: str, name: str, parallel: dict, model: torch.nn.Module, **kw) -> str | None:
    """The ConfigError ``setup`` raises (None if it does not)."""
    from plait.config import ConfigError

    p = _plait(root, name, parallel)
    try:
        p.setup(model, **kw)
    except ConfigError as e:
        return str(e)
    finally:
        p.close()
    return None


def _resharded(root: str, tag: str, kind: str, rank: int, saved_at: dict, loads: list[dict],
               aux: bool = True) -> dict:
    """2 steps at ``saved_at``, a save, 1 more step; each of ``loads`` from other weights: the saved state
    exactly, then the same step (``aux=False`` where the loads change dp: the auxiliary loss depends on how
    the batch is cut)."""
    p = _plait(root, f"{tag}-save", saved_at)
    model, _ = p.setup(build(kind, rank, aux), optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=LR))
    _train(p, model, range(2))
    p.save(f"{root}/{tag}-ckpt", model=model)
    saved = {k: v.detach().clone() for k, v in p.full_state_dict(model).items()}
    uninterrupted = _train(p, model, range(2, 3))
    p.close()
    from torch.distributed.checkpoint import FileSystemReader

    saved_md = FileSystemReader(f"{root}/{tag}-ckpt").read_metadata().state_dict_metadata
    out = {"uninterrupted": uninterrupted,  # what the checkpoint holds: single-process tensors, every entry
           "shapes": {k: tuple(v.size) for k, v in saved_md.items() if k.startswith("model.") and "experts" in k}}
    for parallel in loads:
        key = "-".join(f"{k}{v}" for k, v in parallel.items())
        p = _plait(root, f"{tag}-load-{key}", parallel)
        model, _ = p.setup(build(kind, rank + 7, aux), optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=LR))
        p.load(f"{root}/{tag}-ckpt", model=model)
        loaded = p.full_state_dict(model)
        out[key] = {"state_diff": max(float((loaded[k] - saved[k]).abs().max()) for k in saved),
                    "resumed": _train(p, model, range(2, 3))}
        p.close()
    return out


TWO = {**{f"ep2-{k}": (k, {"ep": 2}) for k in (*MOE_KINDS, "mixtral-idle", "deepseekv3", "gptoss")},
       **{f"tp2-{k}": (k, {"tp": 2}) for k in ("llama", "qwen2", "mistral", "mixtral", "qwen3moe", "bert")}}
FOUR = {f"{name}-{k}": (k, parallel) for k in ("mixtral", "qwen2moe", "deepseekv3", "gptoss") for name, parallel in (
    ("ep2-zero2", {"ep": 2, "zero": 2}), ("ep2-zero3", {"ep": 2, "zero": 3}), ("ep2-tp2", {"ep": 2, "tp": 2}),
    ("ep2-pp2", {"ep": 2, "pp": 2, "microbatches": 2}))}


def _worker_two(rank: int, world: int, root: str) -> dict:
    out = {name: run_case(root, name, kind, parallel, rank) for name, (kind, parallel) in TWO.items()}
    for kind in ("mixtral", "qwen2moe"):  # expert weights saved at ep=2, resharded to ep=1
        out[f"reshard-{kind}"] = _resharded(root, kind, kind, rank, {"ep": 2}, [{"ep": 1}])
    # packed expert weights split over tp (strided boxes in the checkpoint) load at tp=1 and at ep=2
    out["reshard-tp"] = _resharded(root, "tp", "mixtral", rank, {"tp": 2}, [{"tp": 1}, {"ep": 2}], aux=False)
    for kind in ("deepseekv3", "gptoss"):  # 4 expert weights for GPT-OSS: gate_up and down, each with a bias
        out[f"reshard-{kind}"] = _resharded(root, kind, kind, rank, {"ep": 2}, [{"ep": 1}])
    glm = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=0, n_group=1,
        topk_group=1, intermediate_size=32, head_dim=8, **COMMON))
    out["unrecognised"] = _setup_error(root, "glm", {"ep": 2}, glm)
    out["pp-aux"] = _setup_error(root, "ppaux", {"pp": 2, "microbatches": 2}, build("mixtral", rank),
                                 loss_fn="causal_lm")
    return out


def _worker_four(rank: int, world: int, root: str) -> dict:
    return {name: run_case(root, name, kind, parallel, rank) for name, (kind, parallel) in FOUR.items()}


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> list[dict]:
    return run_ranks(_worker_two, 2, str(tmp_path_factory.mktemp("hfmoe2")), timeout=900)


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> list[dict]:
    return run_ranks(_worker_four, 4, str(tmp_path_factory.mktemp("hfmoe4")), timeout=900)


def _max_diff(state: dict, ref: dict, slack: dict | None = None) -> float:
    """The largest |state - ref| over every entry, less that element's slack (none where ``slack`` has no entry)."""
    assert state.keys() == ref.keys()
    slack = slack or {}
    return max(float(((state[k] - ref[k]).abs() - slack.get(k, 0.0)).max()) for k in ref)


def _check(results: list[dict], name: str, kind: str, parallel: dict) -> float:
    dp = len(results) // parallel.get("tp", 1) // parallel.get("pp", 1)
    ref_losses, ref_state, slack = reference(kind, dp, aux=parallel.get("pp", 1) == 1)
    worst = 0.0
    for r in results:
        assert r[name]["losses"] == pytest.approx(ref_losses, abs=LOSS_ATOL), (name, r[name]["losses"], ref_losses)
        worst = max(worst, _max_diff(r[name]["state"], ref_state, slack))
    assert worst < PARAM_ATOL, (name, worst)
    assert _max_diff(ref_state, build(kind, 0).state_dict()) > 30 * PARAM_ATOL  # training moved the weights
    return worst


@pytest.mark.parametrize("name", sorted(TWO))
def test_world_two_matches_one_process(two, name) -> None:
    _check(two, name, *TWO[name])


@pytest.mark.parametrize("name", sorted(FOUR))
def test_world_four_matches_one_process(four, name) -> None:
    _check(four, name, *FOUR[name])


SAVED_SHAPES = {  # the single-process expert tensors (4 experts, hidden 32): (gate_up, down) and GPT-OSS's biases
    "mixtral": {"gate_up_proj": (4, 64, 32), "down_proj": (4, 32, 32)},
    "qwen2moe": {"gate_up_proj": (4, 64, 32), "down_proj": (4, 32, 32)},
    "tp": {"gate_up_proj": (4, 64, 32), "down_proj": (4, 32, 32)},
    "deepseekv3": {"gate_up_proj": (4, 32, 32), "down_proj": (4, 32, 16)},
    "gptoss": {"gate_up_proj": (4, 32, 64), "gate_up_proj_bias": (4, 64), "down_proj": (4, 32, 32),
               "down_proj_bias": (4, 32)},
}


@pytest.mark.parametrize("kind, loads", [("mixtral", ["ep1"]), ("qwen2moe", ["ep1"]), ("tp", ["tp1", "ep2"]),
                                         ("deepseekv3", ["ep1"]), ("gptoss", ["ep1"])])
def test_checkpoint_reshards(two, kind, loads) -> None:
    """Expert weights saved as the single-process (E, ...) tensors, at ep=2 (whole experts split by index) or
    tp=2 (each expert's width split, packed [gate; up] as boxes), load exactly into other layouts."""
    for r in two:
        got = r[f"reshard-{kind}"]
        for layer in (0, 1):
            for name, shape in SAVED_SHAPES[kind].items():
                assert got["shapes"][f"model.model.layers.{layer}.mlp.experts.{name}"] == shape, (kind, name)
        for tag in loads:
            assert got[tag]["state_diff"] == 0.0, (kind, tag)
            assert got[tag]["resumed"] == pytest.approx(got["uninterrupted"], abs=LOSS_ATOL), (kind, tag)


def test_unrecognised_moe_family_and_pipeline_aux_loss_are_refused(two) -> None:
    for r in two:
        msg = r["unrecognised"]
        assert msg is not None and "model.layers.0.mlp (Glm4MoeMoE)" in msg and "does not recognise" in msg, msg
        assert "Mixtral (MixtralSparseMoeBlock)" in msg and "DeepSeek-V3 (DeepseekV3MoE)" in msg, msg
        assert "GPT-OSS (GptOssMLP)" in msg and "parallel.ep=1" in msg, msg
        msg = r["pp-aux"]
        assert msg is not None and "output_router_logits" in msg and "parallel.pp" in msg, msg
