"""Shared pieces of the hybrid-sharding (HSDP) and pipeline + ZeRO tests.

plait's GPT (4 layers, width 32, tied embedding and head) and a Hugging Face ``LlamaForCausalLM`` (2 layers,
width 64, 4 heads, 2 key-value heads, untied head) built from small configs, trained through ``plait.Plait``
on fixed global batches of ``GLOBAL`` sequences, each data-parallel rank its slice of every global batch (the
ranks of one pipeline hold the same slice). The reference is the same loop in one plain PyTorch process:
the model's forward, cross-entropy of the next token (the Llama's own ``labels`` loss), AdamW (lr 1e-3,
weight decay 0.1), ``clip_grad_norm_`` at 1.0.

Tolerances: the maths is the reference's, but sums run in another order (gradients averaged over ranks,
reduce-scattered then all-reduced across replicas, accumulated over pipeline micro-batches, the clip norm
summed over shards), so float32 rounding differs: losses within ``LOSS_ATOL``, parameters within
``PARAM_ATOL`` after 3 AdamW steps (the suite's model-parallel bounds, ``mp_common``), far below one update
(~1e-3); ``moved`` checks that training moved the weights much further than that.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GLOBAL, SEQ, VOCAB, STEPS, LR, WD, CLIP = 8, 16, 256, 3, 1e-3, 0.1, 1.0
LOSS_ATOL, PARAM_ATOL = 2e-5, 3e-5
LLAMA = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
QUIET = {"observe": {"progress": False, "trackers": []}}


def build(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "gpt":
        from plait.config import ModelConfig
        from plait.models.gpt import GPT

        return GPT(ModelConfig(n_layer=4, d_model=32, n_head=4, seq_len=SEQ, vocab_size=VOCAB, dropout=0.0))
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


def data(kind: str, steps: int) -> list[Any]:
    """``steps`` global batches: ``(x, y)`` next-token pairs for the GPT, token ids ``(B, T)`` for the Llama."""
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (GLOBAL, SEQ + 1), generator=g)
        out.append((x[:, :-1], x[:, 1:].contiguous()) if kind == "gpt" else x[:, :-1].contiguous())
    return out


def reference_loss(kind: str, model: torch.nn.Module, batch: Any) -> torch.Tensor:
    if kind == "gpt":
        x, y = batch
        logits = model(x)  # (B, T, V)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
    return model(input_ids=batch, labels=batch).loss


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)


def reference(kind: str, steps: int) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Plain PyTorch in one process: the loss of every step and the state dict after every step."""
    model = build(kind)
    opt = adamw(model)
    losses, states = [], []
    for batch in data(kind, steps):
        loss = reference_loss(kind, model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return losses, states


def _slice(batch: Any, rank: int, dp: int) -> Any:
    n = GLOBAL // dp
    if isinstance(batch, tuple):
        return tuple(t[rank * n:(rank + 1) * n] for t in batch)
    return batch[rank * n:(rank + 1) * n]


def _micro(batch: Any, micro: int) -> list[Any]:
    size = (batch[0] if isinstance(batch, tuple) else batch).size(0)
    cut = [slice(i, i + micro) for i in range(0, size, micro)]
    return [tuple(t[c] for t in batch) if isinstance(batch, tuple) else batch[c] for c in cut]


def train(kind: str, parallel: dict[str, Any], run_dir: str, *, micro: int, steps: int = STEPS, start: int = 0,
          load: str | None = None, save: str | None = None, inspect: Any = None) -> dict[str, Any]:
    """plait's keep-your-loop on global batches ``start .. start + steps - 1``, after loading ``load`` (a
    checkpoint of step ``start``); saves to ``save`` at the end. Returns the global losses, the whole state
    (gathered on every rank), the state right after loading, and ``inspect(plait, model)``'s result."""
    import plait

    p = plait.Plait(parallel=parallel, run={"dir": run_dir}, optim={"grad_clip": CLIP},
                    train={"global_batch_size": GLOBAL, "micro_batch_size": micro}, **QUIET)
    pp = parallel.get("pp", 1) > 1
    model, opt = p.setup(build(kind, seed=p.rank), optimizer=adamw, loss_fn="causal_lm" if pp else None)
    out: dict[str, Any] = {}
    if load is not None:
        p.load(load, model=model, optimizer=opt)
        out["loaded"] = _copy(p.full_state_dict(model))  # one process: views of the live parameters
    losses = []
    for batch in data(kind, start + steps)[start:]:
        for mb in _micro(_slice(batch, p.dp_rank, p.dp), micro):
            if kind == "gpt" and not pp and parallel.get("tp", 1) == 1:  # the user's own forward and loss
                p.backward(reference_loss(kind, model, mb))
            else:
                p.forward_backward(model, mb, loss_fn="causal_lm")
        info = p.step()
        assert info is not None, "one optimizer step per global batch"
        losses.append(info.global_loss)
    out["losses"], out["state"] = losses, _copy(p.full_state_dict(model))
    if inspect is not None:
        out["inspect"] = inspect(p, model)
    if save is not None:
        p.save(save, model=model, optimizer=opt)
    p.close()
    return out


def _copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def max_diff(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    assert state.keys() == ref.keys(), sorted(set(state) ^ set(ref))
    return max((state[k].float() - ref[k].float()).abs().max().item() for k in ref)


def moved(kind: str, ref: dict[str, torch.Tensor]) -> float:
    """How far training moved the weights from their initial values (to compare the tolerances with)."""
    return max_diff(ref, build(kind).state_dict())
