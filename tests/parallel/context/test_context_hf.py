"""Context parallelism on Hugging Face decoders with grouped-query attention equals one process on the whole sequence.

A small Llama (2 layers, hidden 32, 4 attention heads, 2 key-value heads, rotary positions) trains 3 AdamW steps
(clip 1.0) through ``plait.Plait.forward_backward`` at cp=2 with ``ring``, ``alltoall`` and ``allgather``, and so
do a Qwen2 (q/k/v biases) with ``ring`` and a Mistral (no sliding window) with ``alltoall``, all in one spawned
group of 2 ranks, on dict batches whose labels hold ``-100`` over uneven prompt lengths. plait routes each
``LlamaAttention`` (``Qwen2Attention``, ``MistralAttention``) through its cp attention (the layer's own
projections and rotary embedding at the global positions plait passes as ``position_ids``). Compared with plain
PyTorch in one process over the whole batch (``F.cross_entropy`` over every real token): the logged loss of every
step, every parameter's gradient at step 1 and every parameter after 3 steps. float32; tolerances those of the GPT
test (losses 2e-5, gradients 1e-7, parameters 3e-5). With the routing removed the Llama's loss is off by 2e-3.
Under ``ring`` and ``allgather`` every key/value transfer (the ring's shifts, the all-gather's input, forward and
backward) carries the 2 key/value heads, not the 4 query heads they are repeated to.

The same group checks that a transformers model whose attention plait cannot route (GPT-2) is refused with one
message naming its attention module, and a Mistral whose sliding window is shorter than the sequence with one
naming the window (plait's cp attention is full causal; ignoring the window would be a silent wrong result).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F
from helpers import run_ranks
from references import MP_LOSS_ATOL, MP_PARAM_ATOL

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SEQ, GLOBAL, STEPS, LR, CLIP = 128, 2, 3, 1e-3, 1.0
GRAD_ATOL = 1e-7
RUNS = (("llama", "ring"), ("llama", "alltoall"), ("llama", "allgather"), ("qwen2", "ring"), ("mistral", "alltoall"))
KV_SENT = 2 * GLOBAL * 2 * (SEQ // 2) * (32 // 4)  # keys and values of one layer's shard: B x 2 kv heads x S x D


def llama(kind: str = "llama", window: int | None = None):
    """A small decoder of ``kind`` (llama, qwen2: q/k/v biases, mistral: sliding window ``window``), GQA 4/2."""
    import transformers

    config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                             "mistral": ("MistralConfig", "MistralForCausalLM")}[kind]
    torch.manual_seed(0)
    extra = {"sliding_window": window} if kind == "mistral" else {}
    cfg = getattr(transformers, config_cls)(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                            attention_dropout=0.0, tie_word_embeddings=False, **extra)
    cfg._attn_implementation = "sdpa"
    return getattr(transformers, model_cls)(cfg)


def batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 256, (GLOBAL, SEQ), generator=g)
        labels = ids.clone()
        for r, prompt in enumerate(torch.randint(0, 100, (GLOBAL,), generator=g).tolist()):
            labels[r, :prompt if r % 2 else 0] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=False)


def reference(kind: str) -> tuple[list[float], dict, dict]:
    model, losses, first = llama(kind), [], {}
    opt = adamw(model)
    for batch in batches():
        target = torch.full_like(batch["labels"], -100)
        target[:, :-1] = batch["labels"][:, 1:]
        logits = model(input_ids=batch["input_ids"]).logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1), ignore_index=-100)
        loss.backward()
        first = first or {n: q.grad.detach().clone() for n, q in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, first, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _plait(run_dir: str, impl: str, name: str = ""):
    import plait

    return plait.Plait(parallel={"cp": 2, "cp_impl": impl}, optim={"grad_clip": CLIP},
                       train={"global_batch_size": GLOBAL, "micro_batch_size": GLOBAL},
                       run={"dir": f"{run_dir}/{impl}{name}"}, observe={"progress": False, "trackers": []})


def _train(run_dir: str, kind: str, impl: str) -> dict:
    p = _plait(run_dir, impl, kind)
    model, opt = p.setup(llama(kind), optimizer=adamw, loss_fn="causal_lm")
    names = {id(q): n for n, q in model.named_parameters()}
    grads: dict = {}

    def first_grads(o, args, kwargs) -> None:
        if not grads:
            grads.update({names[id(q)]: q.grad.detach().clone() for g in o.param_groups for q in g["params"]})
    opt.register_step_pre_hook(first_grads)
    sent = _count_sent(p, impl)
    losses = []
    for batch in batches():
        p.forward_backward(model, batch)
        losses.append(p.step(log=True).global_loss)
    out = {"losses": losses, "grads": grads, "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
           "layout": p.strategy.describe(), "sent": sent}
    p.close()
    return out


def _count_sent(p, impl: str) -> list[int]:
    """The element counts of the keys and values this rank sends: the ring's shifts (its first hop each forward)
    or the all-gather's input, recorded as they go."""
    import plait.parallel.context.allgather as allgather

    sent: list[int] = []
    if impl == "ring":
        ring = p.layout.split.attention.ring
        shift = ring.shift
        ring.shift = lambda t, tag=0: (sent.append(t.numel()) if tag == 0 else None, shift(t, tag))[1]
    elif impl == "allgather":
        gather = allgather._gather
        allgather._gather = lambda x, group: (sent.append(x.numel()), gather(x, group))[1]
    return sent


def _unrecognised(run_dir: str) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel

    from plait.config import ConfigError

    p = _plait(run_dir, "ring", "-gpt2")
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=32, n_layer=1, n_head=4))
    try:
        p.setup(model, optimizer=adamw, loss_fn="causal_lm")
    except ConfigError as e:
        return str(e)
    finally:
        p.close()
    return "no error"


def _window(run_dir: str) -> str:
    """The message of a Mistral whose sliding window (64) is shorter than the sequence."""
    from plait.config import ConfigError

    p = _plait(run_dir, "ring", "-mistral")
    model, _ = p.setup(llama("mistral", window=SEQ // 2), optimizer=adamw, loss_fn="causal_lm")
    try:
        p.forward_backward(model, batches()[0])
    except ConfigError as e:
        return str(e)
    finally:
        p.close()
    return "no error"


def _group(rank: int, world: int, run_dir: str) -> dict:
    return {"runs": {(kind, impl): _train(run_dir, kind, impl) for kind, impl in RUNS},
            "error": _unrecognised(run_dir), "window": _window(run_dir)}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_context_parallel_hf_llama_gqa_equals_one_process(tmp_path: Path) -> None:
    ranks = run_ranks(_group, 2, str(tmp_path), timeout=600)
    refs = {kind: reference(kind) for kind in {kind for kind, _ in RUNS}}
    for kind, impl in RUNS:
        ref_losses, ref_grads, ref_state = refs[kind]
        impl = (kind, impl)
        for rank in ranks:
            run = rank["runs"][impl]
            assert "context-parallel" in run["layout"], impl
            assert max(abs(a - b) for a, b in zip(run["losses"], ref_losses, strict=True)) < MP_LOSS_ATOL, impl
            assert _max_diff(run["grads"], ref_grads) < GRAD_ATOL, impl
            assert _max_diff(run["state"], ref_state) < MP_PARAM_ATOL, impl
            if impl[1] != "alltoall":  # only the 2 key/value heads travel, not 4 repeated to the query heads
                assert run["sent"] and set(run["sent"]) == {KV_SENT}, (impl, sorted(set(run["sent"])))
    error = ranks[0]["error"]
    assert "GPT2Attention" in error and "parallel.cp=1" in error, error
    window = ranks[0]["window"]
    assert "sliding window of 64 tokens, shorter than the sequence (128)" in window, window
