"""A Hugging Face Llama in your own loop: ZeRO-2 on 2 workers, then tensor parallelism with the plan the
model ships (``parallel.tp_plan = "auto"``), or a pipeline split at a layer.

    plait run --nproc 2 examples/hf_llama.py                    # ZeRO-2 (the default here)
    plait run --nproc 2 examples/hf_llama.py --layout tp2       # tensor parallel, Llama's own plan
    plait run --nproc 2 examples/hf_llama.py --layout pp2       # pipeline, stages split at model.layers.2

The model is built from a small config (random weights; nothing is downloaded) and trained on the
embedded byte-level corpus. Needs ``pip install 'plait[hf]'``.
"""

from __future__ import annotations

import argparse
import os

import torch

import plait
from plait.data.corpus import load_splits
from plait.data.text import TokenWindows

LAYOUTS = {
    "zero2": {"zero": 2},
    "tp2": {"tp": 2, "tp_plan": "auto"},
    "pp2": {"pp": 2, "pp_schedule": "1f1b", "microbatches": 2, "pp_split": ["model.layers.2"]},
}


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="zero2")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()

    p = plait.Plait(parallel=LAYOUTS[args.layout], run={"dir": f"runs/hf-llama-{args.layout}"},
                    train={"global_batch_size": 16, "micro_batch_size": 4, "steps": args.steps},
                    observe={"progress": False})
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(config)
    splits = load_splits("", 256, 0.05, 64)
    loader = p.setup_dataloader(TokenWindows(splits.train, 64, epoch_offsets=True))
    model, optimizer = p.setup(model, optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                               loss_fn="causal_lm")
    while p.steps < args.steps:
        for batch in loader:
            p.forward_backward(model, batch)  # = model(x) -> causal-LM loss -> p.backward, for every layout
            info = p.step()
            if info is not None and info.step % 10 == 0:
                loss = p.reduce(info.loss)
                p.log({"step": info.step, "loss": loss})
                if p.is_main:
                    print(f"{args.layout} step {info.step}: loss {loss:.3f}", flush=True)
            if p.steps >= args.steps:
                break
    state = p.full_state_dict(model)  # the whole model's weights under its own names, on every rank
    if p.is_main:
        fresh = LlamaForCausalLM(config)
        fresh.load_state_dict(state, strict=True)
        print(f"{args.layout}: {len(state)} tensors exported; they load into a fresh LlamaForCausalLM (strict)")
    p.close()


if __name__ == "__main__":
    main()
