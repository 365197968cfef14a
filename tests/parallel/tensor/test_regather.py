"""Sequence parallelism keeps the shard of the column-parallel Linears' input and gathers it again in backward
(``plait.parallel.tensor.regather``); a checkpointed block keeps the gathered input instead, since its
recomputation gathers it anyway. Counted on plait's GPT and a Hugging Face Llama under plait's plan (tp 2, this
process rank 0 of a fake process group: real shapes and collectives' calls, no peers): the bytes the Linears keep
(``saved_tensors_hooks``) and the all-gathers of forward and backward (``CommDebugMode``) against the op list.
Numerics against one process are in test_tensor.py and test_hf_sequence.py (no checkpointing) and
tests/parallel/test_selective.py (selective against none: bit-identical).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from plait.models.gpt import GPT

B, T, C, HEADS, KV, FF, V, LAYERS = 2, 16, 32, 4, 2, 64, 64, 2
# outside the blocks: the head gathers the final norm's shards (the Llama's also its logits); in backward the GPT's
# embedding (its output reduce-scattered onto the shards) and the Llama's first layer (its slice of the sequence)
# gather their gradient
REST_FWD, REST_BWD = {"gpt": 1, "llama": 2}, {"gpt": 1, "llama": 1}


def _model(family: str):
    torch.manual_seed(0)
    if family == "gpt":
        from plait.config import ModelConfig
        from plait.plan.shapes import gpt_shape

        return GPT(ModelConfig(n_layer=LAYERS, d_model=C, n_head=HEADS, seq_len=T, vocab_size=V)), \
            gpt_shape(LAYERS, C, HEADS, T, V)
    transformers = pytest.importorskip("transformers")
    from plait.plan.shapes import shape_from_hf

    config = transformers.LlamaConfig(hidden_size=C, intermediate_size=FF, num_hidden_layers=LAYERS,
                                      num_attention_heads=HEADS, num_key_value_heads=KV, vocab_size=V,
                                      tie_word_embeddings=False, max_position_embeddings=T)
    return transformers.LlamaForCausalLM(config), shape_from_hf(config, T)


def _run(family: str, mode: str) -> tuple[dict, dict, int, object]:
    """(all-gathers in forward, in backward) and the bytes saved inside q/k/v (q_proj, ...) of block 0."""
    from plait.config import load_config
    from plait.parallel.activation_checkpoint import apply_activation_checkpointing
    from plait.plan.record import fake_world, tensor_parallel

    cfg = load_config(None, ["--parallel.nproc=2", "--parallel.tp=2", "--parallel.sequence_parallel=true",
                             f"--model.n_layer={LAYERS}", f"--model.d_model={C}", f"--model.n_head={HEADS}",
                             f"--model.seq_len={T}", f"--model.vocab_size={V}"])
    ids = torch.randint(0, V, (B, T))
    with fake_world(2) as mesh:
        model, shape = _model(family)
        model, loss_context = tensor_parallel(cfg, model, mesh)
        q = next(m for n, m in model.named_modules() if n.endswith(("0.attn.q", "0.self_attn.q_proj")))
        apply_activation_checkpointing(model, mode)
        kept = []
        params = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
                  for p in model.parameters()}

        def pack(t):
            local = getattr(t, "_local_tensor", t)  # a DTensor's shard
            if getattr(q, "_in_forward", False) and local.untyped_storage().data_ptr() not in params:
                kept.append(local.untyped_storage().nbytes())
            return t

        def enter(m, _):
            m._in_forward = True

        def leave(m, *_):
            m._in_forward = False

        q.register_forward_pre_hook(enter)
        q.register_forward_hook(leave)
        with loss_context:
            with Gathers() as fwd, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = model(ids, ids) if family == "gpt" else model(input_ids=ids, labels=ids).loss
            with Gathers() as bwd:
                loss.backward()
        counts = {"fwd": fwd.count, "bwd": bwd.count}
    return counts, shape, max(kept, default=0), cfg


class Gathers(TorchDispatchMode):
    """Counts the all-gathers dispatched (functional collectives: DTensor's and plait's own)."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "all_gather" in str(func):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_the_linears_keep_the_shard_and_gather_it_again_in_backward(family):
    """No checkpointing: q keeps its input's shard (T/2 tokens; the weight shard is a parameter, not counted);
    forward gathers each block input once; backward gathers it again (shared by q, k and v; by the MLP's Linears)
    besides the row-parallel outputs' gradients: the op list's counts."""
    from plait.plan.ops import BlockOps, Setup

    counts, shape, kept, _ = _run(family, "none")
    assert kept == B * (T // 2) * C * 4  # float32 shard of the norm's output, not the (B, T, C) gathered input
    ops = BlockOps(shape, Setup(micro_batch=B, tp=2, sp=True))
    per_fwd = sum(o.comm == "all_gather" for o in ops.forward().ops)
    per_bwd = sum(o.comm == "all_gather" for o in ops.backward().ops)
    assert per_bwd == 4 and per_fwd == 2  # attention and MLP: gathered inputs; backward: row outputs + regathers
    assert counts["fwd"] == LAYERS * per_fwd + REST_FWD[family], counts
    assert counts["bwd"] == LAYERS * per_bwd + REST_BWD[family], counts


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_a_checkpointed_block_keeps_the_gathered_input_and_does_not_gather_twice(family):
    """Full recomputation: backward reruns each block's forward (its two input gathers) and gathers the row-parallel
    outputs' gradients, with no second gather of the inputs: the op list of a recomputed block."""
    from plait.plan.ops import BlockOps, Setup

    counts, shape, _, _ = _run(family, "full")
    ops = BlockOps(shape, Setup(micro_batch=B, tp=2, sp=True), recomputed=True)
    per_fwd = sum(o.comm == "all_gather" for o in ops.forward().ops)
    per_bwd = sum(o.comm == "all_gather" for o in ops.backward().ops)
    assert (per_fwd, per_bwd) == (2, 2)
    assert counts["bwd"] == LAYERS * (per_fwd + per_bwd) + REST_BWD[family], counts
