"""Selective activation checkpointing and activation offload composed with the layouts: equal to no
checkpointing (no offload) in the same layout, bit for bit.

One spawn of 2 gloo ranks trains, for ``STEPS`` AdamW steps through ``plait.Plait``, each case of ``CASES`` twice
from the same weights and data: with ``train.activation_checkpointing=none`` and with the case's setting
(selective with the default policy, or activation offload). Layouts: tensor parallel with sequence parallelism
(plait's GPT under its own plan, a Hugging Face Llama under transformers' plan), the pipeline (the Llama, 1F1B),
ZeRO-3 on FSDP2 (the Llama in bf16 through FSDP2's mixed-precision policy), ZeRO-2, expert parallelism (plait's
MoE GPT, all-to-all dispatch), and train.compile (aot_eager: dynamo traces the selective policy). Each
layout is proven against one plain PyTorch process elsewhere; what is proven here is that the recomputation
(and the host round trip) changes nothing: the recomputed operators run the same kernels on the same inputs,
the recomputed collectives (sequence parallelism's all-gathers, the experts' all-to-alls) return the same
data, and the dropout masks are replayed. Tolerance: exact (losses, the global gradient norm of every step,
every parameter after 3 steps, and each rank's local gradients after the first backward where there is no
data parallelism, whose reduction may still be in flight then), except under compile, where the graph with
selective recomputation is partitioned differently: within ``COMPILE_ATOL`` (rounding; 10x below one AdamW
update at lr 1e-3).
"""

from __future__ import annotations

import pytest
import torch
from helpers import run_ranks
from references import SHARDED_GLOBAL, SHARDED_LR, sharded_batches, sharded_model

STEPS = 3
COMPILE_ATOL = 1e-4
GPT_MOE = ["--model.n_layer=2", "--model.d_model=32", "--model.n_head=2", "--model.seq_len=16",
           "--model.vocab_size=256", "--model.dropout=0.0", "--moe.num_experts=4", "--moe.top_k=2", "--moe.every=1"]
SELECTIVE = ["--train.activation_checkpointing=selective"]
OFFLOAD = ["--train.activation_offload=true"]
# name: (model, layout overrides, the setting compared with none)
CASES = {
    "gpt-tp2-sp": ("gpt", ["--parallel.tp=2", "--parallel.sequence_parallel=true"], SELECTIVE),
    "llama-tp2-sp": ("llama", ["--parallel.tp=2", "--parallel.sequence_parallel=true"], SELECTIVE),
    "llama-pp2": ("llama", ["--parallel.pp=2", "--parallel.microbatches=2", "--parallel.pp_schedule=1f1b"],
                  SELECTIVE),
    "llama-zero3-bf16": ("llama", ["--parallel.zero=3", "--train.precision=bf16"], SELECTIVE),
    "gpt-zero2": ("gpt", ["--parallel.zero=2"], SELECTIVE),
    "moe-ep2": ("moe", ["--parallel.ep=2"], SELECTIVE),
    "gpt-compile": ("gpt", ["--train.compile=true", "--train.compile_backend=aot_eager"], SELECTIVE),
    "llama-tp2-sp-offload": ("llama", ["--parallel.tp=2", "--parallel.sequence_parallel=true"], OFFLOAD),
    "gpt-zero3-offload": ("gpt", ["--parallel.zero=3"], OFFLOAD),
}


def _model(kind: str) -> torch.nn.Module:
    if kind != "moe":
        return sharded_model(kind)
    from plait.config import load_config
    from plait.models.tiny import seeded_gpt

    cfg = load_config(overrides=GPT_MOE)
    return seeded_gpt(cfg.model, 0, cfg.moe)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _train(kind: str, overrides: list[str], run_dir: str, world: int) -> dict:
    import plait
    from plait.config import load_config

    cfg = load_config(overrides=(GPT_MOE if kind == "moe" else []) + overrides + [
        f"--run.dir={run_dir}", f"--parallel.nproc={world}", f"--train.global_batch_size={SHARDED_GLOBAL}",
        f"--optim.lr={SHARDED_LR}", "--optim.grad_clip=1.0", "--observe.progress=false", "--observe.trackers=[]"])
    p = plait.Plait(cfg)
    model, _ = p.setup(_model(kind), optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=SHARDED_LR),
                       loss_fn="causal_lm")
    micro = SHARDED_GLOBAL // p.dp
    losses, norms, grads = [], [], {}
    for step, batch in enumerate(sharded_batches("llama" if kind == "moe" else kind, STEPS)):
        part = tuple(t[p.dp_rank * micro:(p.dp_rank + 1) * micro] for t in batch) if isinstance(batch, tuple) \
            else batch[p.dp_rank * micro:(p.dp_rank + 1) * micro]
        p.forward_backward(model, part)
        if step == 0 and p.dp == 1:  # with data parallelism the gradients may still be in flight here
            grads = {n.replace("_checkpoint_wrapped_module.", ""): _local(q.grad)
                     for n, q in model.named_parameters() if q.grad is not None}
        info = p.step()
        losses.append(info.global_loss)
        norms.append(info.grad_norm)
    from plait.parallel.offload import activation_offload_of

    offload = activation_offload_of(model)
    out = {"losses": losses, "norms": norms, "grads": grads,
           "state": {k: v.clone() for k, v in p.full_state_dict(model).items()},
           "moved": offload.stats.to_host if offload is not None else 0}
    p.close()
    return out


def _worker(rank: int, world: int, root: str) -> dict:
    out = {}
    for name, (kind, layout, setting) in CASES.items():
        out[name] = {mode: _train(kind, layout + extra, f"{root}/{name}-{mode}", world)
                     for mode, extra in (("none", []), ("with", setting))}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(_worker, 2, str(tmp_path_factory.mktemp("selective")), timeout=600)


@pytest.mark.parametrize("name", list(CASES))
def test_equals_no_checkpointing(results, name) -> None:
    atol = COMPILE_ATOL if "compile" in name else 0.0
    for rank, got in enumerate(results):
        none, other = got[name]["none"], got[name]["with"]
        assert other["losses"] == pytest.approx(none["losses"], abs=atol, rel=0), (name, rank)
        assert other["norms"] == pytest.approx(none["norms"], abs=atol, rel=0), (name, rank)
        assert none["grads"].keys() == other["grads"].keys(), (name, rank)
        for key in ("grads", "state"):
            for n, v in none[key].items():
                assert torch.allclose(other[key][n].float(), v.float(), atol=atol, rtol=0), (name, rank, key, n)
        if name.endswith("offload"):
            assert other["moved"] > 0 and none["moved"] == 0, (name, rank)
