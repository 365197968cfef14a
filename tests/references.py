"""Single-process references the multi-process tests compare with, written as a user writes plain PyTorch,
and the small pieces those comparisons share. Models and data come from ``plait.models.tiny``.

Model parallelism (tensor, sequence, pipeline; ``mp_*``): a 4-layer tiny GPT, ``MP_STEPS`` AdamW steps at
lr 1e-3 on the same batches on every rank. These layouts compute the same maths as one process but sum
in a different order (row-parallel partial sums, vocabulary-parallel softmax, micro-batch gradient
accumulation), so float32 results differ by rounding only: the observed differences are below 3e-6 for
parameters and 2e-6 for losses; the tests allow ``MP_PARAM_ATOL`` and ``MP_LOSS_ATOL`` (10x margin), far
below one optimizer update (~1e-3).

Data parallelism and ZeRO/FSDP (``dp_*``): a 2-layer tiny GPT, ``DP_STEPS`` steps over global batches of
``DP_GLOBAL_BATCH`` language-modelling windows; ``distributed_run`` is the minimal data-parallel loop
the sharded optimizers are driven by (each test states its own tolerance).

HSDP and pipelines with ZeRO (``sharded_*``): plait's GPT and a small Hugging Face Llama trained through
``plait.Plait`` against the same loop in one plain PyTorch process, within the model-parallel tolerances.

The keep-your-loop API (``reference_training``): AdamW with gradient clipping at 1.0 over the global
batches plait's loader forms for a seed.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from plait.config import ModelConfig
from plait.models.tiny import seeded_gpt, tiny_config, token_batches

# -- model parallelism ---------------------------------------------------------------------------------
MP_PARAM_ATOL = 3e-5
MP_LOSS_ATOL = 2e-5
MP_STEPS = 3
MP_LR = 1e-3


def mp_config(n_layer: int = 4) -> ModelConfig:
    return tiny_config(n_layer=n_layer, d_model=32, n_head=4, seq_len=16, vocab_size=256)


def mp_batches(batch_size: int, steps: int = MP_STEPS, seed: int = 1, vocab: int = 256, seq: int = 16):
    """The same ``steps`` (idx, targets) batches of shape (B, T) on every rank."""
    return token_batches(steps, batch_size, seq_len=seq, vocab_size=vocab, seed=seed)


def mp_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=MP_LR, weight_decay=0.1, foreach=False)


def mp_reference(cfg: ModelConfig, data) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training from the same weights and data: losses and final state dict."""
    model = seeded_gpt(cfg)
    opt = mp_optimizer(model.parameters())
    losses = []
    for idx, tgt in data:
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_pipeline(cfg: ModelConfig, data, pp_group, schedule: str, microbatches: int, *, dp_group=None, costs=None,
                   tp_mesh=None) -> tuple[list[float | None], Any]:
    """The tiny GPT pipelined over ``pp_group`` (tensor-parallel first over ``tp_mesh``, gradients averaged over
    ``dp_group``), trained on ``data``: the losses this rank sees (None off the last stage) and the runner."""
    from plait.models.gpt.parallelize import apply_tensor_parallel
    from plait.parallel.pipeline.runner import build_pipeline

    model = seeded_gpt(cfg)
    if tp_mesh is not None:
        model = apply_tensor_parallel(model, tp_mesh, sequence_parallel=True)
    runner = build_pipeline(model, pp_group, schedule=schedule, microbatches=microbatches, costs=costs)
    opt = mp_optimizer(runner.parameters())
    losses = []
    for idx, tgt in data:
        loss = runner.step(idx, tgt)
        if dp_group is not None:
            allreduce_grads_mean(runner.parameters(), dp_group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = None if loss is None else loss.item()
        if value is not None and dp_group is not None:
            value = mean_over(value, dp_group)
        losses.append(value)
    return losses, runner


def adam_slack(opt: torch.optim.Optimizer, p: torch.nn.Parameter, step: int, shift: float | torch.Tensor
               ) -> torch.Tensor:
    """How far AdamW's ``step``-th update of ``p`` (about to be taken from ``p.grad``) moves, element by element, when
    that gradient is off by ``shift`` either way (sampled across the interval): the rounding a layout's other
    summation order may leave in a gradient, amplified by AdamW's ``g / (|g| + eps)`` where the gradient is near 0
    (its slope there is lr / eps). 0 where the gradient is exactly 0: no term was summed, no order changes it."""
    group = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
    (b1, b2), eps, lr = group["betas"], group["eps"], group["lr"]
    state = opt.state.get(p, {})
    m, v, g = state.get("exp_avg", torch.zeros_like(p)), state.get("exp_avg_sq", torch.zeros_like(p)), p.grad

    def update(x: torch.Tensor) -> torch.Tensor:  # torch's AdamW step, its decoupled decay aside (the same in both)
        v_hat = (b2 * v + (1 - b2) * x * x) / (1 - b2 ** step)
        return lr * (b1 * m + (1 - b1) * x) / (1 - b1 ** step) / (v_hat.sqrt() + eps)

    shifts = torch.linspace(-1, 1, 9).view(-1, *[1] * g.dim()) * shift  # (9, 1, ...)
    moved = (update(g + shifts) - update(g)).abs().amax(0)
    return torch.where(g == 0, 0.0, moved)


def beyond_slack(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], slack: dict[str, torch.Tensor]
                 ) -> float:
    """The largest difference between ``state`` and ``ref`` beyond each element's ``slack`` (``adam_slack`` summed over
    the steps; entries without one, buffers, have none)."""
    assert state.keys() == ref.keys()
    return max(float(((state[k].float() - ref[k].float()).abs() - slack.get(k, 0.0)).max()) for k in ref)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_param_diff(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Largest |difference| over the entries this rank holds (gathers DTensors: collective over tp)."""
    return max((full(v).detach() - ref[k]).abs().max().item() for k, v in sorted(state.items()))


def allreduce_grads_mean(params, group) -> None:
    """Plain data parallelism for the tests: average each local gradient shard over ``group``."""
    from plait.parallel.tensor.plan import local_grads

    n = dist.get_world_size(group)
    for g in local_grads(list(params)):
        dist.all_reduce(g, group=group)
        g.div_(n)


def mean_over(value: float, group) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


def saved_activation_bytes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``model(x, y)`` and the bytes of the distinct storages autograd saved for its backward, parameters
    excluded."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in param_ptrs:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, y)
    return loss, sum(seen.values())


# -- data parallelism, ZeRO and FSDP -------------------------------------------------------------------
DP_CFG = tiny_config(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=256)
DP_GLOBAL_BATCH = 8
DP_STEPS = 5


def dp_model(seed: int = 0):
    return seeded_gpt(DP_CFG, seed)


def param_groups(model: torch.nn.Module, weight_decay: float = 0.1) -> list[dict]:
    """The trainer's grouping: decay on matrices, none on biases and norms."""
    params = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def dp_batches(steps: int = DP_STEPS, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return token_batches(steps, DP_GLOBAL_BATCH, seq_len=DP_CFG.seq_len, vocab_size=DP_CFG.vocab_size, seed=seed,
                         shifted=True)


def local_micro_batches(x: torch.Tensor, y: torch.Tensor, rank: int, world: int, accum: int):
    """This rank's disjoint slice of the global batch, split into ``accum`` micro-batches."""
    per = DP_GLOBAL_BATCH // world
    xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    return list(zip(xs.chunk(accum), ys.chunk(accum), strict=True))


def dp_reference(make_opt: Callable, clip: float, steps: int = DP_STEPS) -> tuple[list[float], dict]:
    """Single process, whole global batch per step: the losses and final parameters to match."""
    model = dp_model()
    opt = make_opt(model)
    losses = dp_reference_steps(model, opt, clip, steps)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def dp_reference_steps(model, opt, clip: float, steps: int, first: int = 0) -> list[float]:
    losses = []
    for x, y in dp_batches(first + steps)[first:]:
        loss = model(x, y)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def distributed_run(model: torch.nn.Module, opt, rank: int, world: int, accum: int, clip: float,
                    no_sync: Callable | None = None, steps: int = DP_STEPS, first: int = 0) -> list[float]:
    """A minimal data-parallel loop: accumulate ``accum`` micro-steps, clip, step; global mean loss.
    Runs global batches ``first .. first + steps - 1`` of the fixed sequence."""
    losses = []
    for x, y in dp_batches(first + steps)[first:]:
        micro = local_micro_batches(x, y, rank, world, accum)
        total = torch.zeros(())
        for i, (mx, my) in enumerate(micro):
            ctx = no_sync() if (no_sync is not None and i < accum - 1) else nullcontext()
            with ctx:
                loss = model(mx, my) / accum
                loss.backward()
            total += loss.detach()
        if clip > 0:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        losses.append((total / world).item())
    return losses


# -- sharded data parallelism composed: HSDP and pipelines with ZeRO (``sharded_*``) ----------------------
# plait's GPT (4 layers, width 32, tied embedding and head) and a Hugging Face ``LlamaForCausalLM`` (2 layers,
# width 64, 4 heads, 2 key-value heads, untied head) built from small configs, trained through ``plait.Plait``
# on fixed global batches of ``SHARDED_GLOBAL`` sequences, each data-parallel rank its slice of every global
# batch (the ranks of one pipeline hold the same slice). The reference is the same loop in one plain PyTorch
# process: the model's forward, cross-entropy of the next token (the Llama's own ``labels`` loss), AdamW (lr
# 1e-3, weight decay 0.1), ``clip_grad_norm_`` at 1.0. The maths is the reference's, but sums run in another
# order (gradients averaged over ranks, reduce-scattered then all-reduced across replicas, accumulated over
# pipeline micro-batches, the clip norm summed over shards), so float32 rounding differs: losses within
# ``MP_LOSS_ATOL``, parameters within ``MP_PARAM_ATOL`` after 3 AdamW steps, far below one update (~1e-3);
# ``sharded_moved`` checks that training moved the weights much further than that.
SHARDED_GLOBAL, SHARDED_SEQ, SHARDED_VOCAB, SHARDED_STEPS = 8, 16, 256, 3
SHARDED_LR, SHARDED_WD, SHARDED_CLIP = 1e-3, 0.1, 1.0
SHARDED_LLAMA = {"vocab_size": SHARDED_VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


def sharded_model(kind: str, seed: int = 0) -> torch.nn.Module:
    """plait's tiny GPT (``kind="gpt"``) or the small Llama, initialised right after ``torch.manual_seed(seed)``."""
    if kind == "gpt":
        return seeded_gpt(tiny_config(n_layer=4, d_model=32, n_head=4, seq_len=SHARDED_SEQ, vocab_size=SHARDED_VOCAB),
                          seed)
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHARDED_LLAMA))


def sharded_batches(kind: str, steps: int) -> list[Any]:
    """``steps`` global batches: ``(x, y)`` next-token pairs for the GPT, token ids ``(B, T)`` for the Llama."""
    pairs = token_batches(steps, SHARDED_GLOBAL, seq_len=SHARDED_SEQ, vocab_size=SHARDED_VOCAB, seed=11, shifted=True)
    return pairs if kind == "gpt" else [x for x, _ in pairs]


def sharded_loss(kind: str, model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The user's own loss: cross-entropy of the next token over the GPT's logits, the Llama's ``labels`` loss."""
    if kind == "gpt":
        x, y = batch
        logits = model(x)  # (B, T, V)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
    return model(input_ids=batch, labels=batch).loss


def sharded_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=SHARDED_LR, weight_decay=SHARDED_WD)


# how far float32 rounding in another summation order may move a gradient, as a fraction of its tensor's largest
# element (measured up to 9e-7 on torch 2.13's CPU kernels: tests/parallel/expert/test_hf.py): the shift
# ``adam_slack`` takes for the references below
GRAD_RTOL = 2e-6


def sharded_reference(kind: str, steps: int, precision: str = "fp32", slack: dict[str, torch.Tensor] | None = None
                      ) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Plain PyTorch in one process: the loss of every step and the state dict after every step; ``bf16``: the
    forward under bf16 autocast (plait's bf16 without FSDP2); ``bf16-params``: forward and backward on a bf16 copy
    of the float32 parameters, whose gradients (in float32) the optimizer applies to them (FSDP2's bf16 policy).
    ``slack`` (a dict) is filled with each parameter's ``adam_slack`` for gradients off by ``GRAD_RTOL`` of their
    tensor's largest element, summed over the steps."""
    import contextlib
    import copy

    model = sharded_model(kind)
    opt = sharded_adamw(model)
    losses, states = [], []
    for batch in sharded_batches(kind, steps):
        if precision == "bf16-params":
            compute = copy.deepcopy(model).bfloat16()
            loss = sharded_loss(kind, compute, batch)
            loss.backward()
            for p, q in zip(model.parameters(), compute.parameters(), strict=True):
                p.grad = q.grad.float()
        else:
            with torch.autocast("cpu", torch.bfloat16) if precision == "bf16" else contextlib.nullcontext():
                loss = sharded_loss(kind, model, batch)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), SHARDED_CLIP)
        if slack is not None:  # every name a parameter has in the state dict (a tied one has two)
            with torch.no_grad():
                moved = {id(q): adam_slack(opt, q, len(losses) + 1, GRAD_RTOL * q.grad.abs().max())
                         for q in model.parameters() if q.grad is not None}
                for n, q in model.state_dict(keep_vars=True).items():
                    if id(q) in moved:
                        slack[n] = slack.get(n, 0.0) + moved[id(q)]
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        states.append(_copy(model.state_dict()))
    return losses, states


def _slice(batch: Any, rank: int, dp: int) -> Any:
    n = SHARDED_GLOBAL // dp
    if isinstance(batch, tuple):
        return tuple(t[rank * n:(rank + 1) * n] for t in batch)
    return batch[rank * n:(rank + 1) * n]


def _micro(batch: Any, micro: int) -> list[Any]:
    size = (batch[0] if isinstance(batch, tuple) else batch).size(0)
    cut = [slice(i, i + micro) for i in range(0, size, micro)]
    return [tuple(t[c] for t in batch) if isinstance(batch, tuple) else batch[c] for c in cut]


def sharded_train(kind: str, parallel: dict[str, Any], run_dir: str, *, micro: int, steps: int = SHARDED_STEPS,
                  start: int = 0, load: str | None = None, save: str | None = None,
                  inspect: Any = None, precision: str = "fp32") -> dict[str, Any]:
    """plait's keep-your-loop on global batches ``start .. start + steps - 1``, after loading ``load`` (a
    checkpoint of step ``start``); saves to ``save`` at the end. Returns the global losses, the whole state
    (gathered on every rank), the state right after loading, and ``inspect(plait, model)``'s result."""
    import plait

    p = plait.Plait(parallel=parallel, run={"dir": run_dir}, optim={"grad_clip": SHARDED_CLIP},
                    train={"global_batch_size": SHARDED_GLOBAL, "micro_batch_size": micro, "precision": precision},
                    observe={"progress": False, "trackers": []})
    pp = parallel.get("pp", 1) > 1
    model, opt = p.setup(sharded_model(kind, seed=p.rank), optimizer=sharded_adamw,
                         loss_fn="causal_lm" if pp else None)
    out: dict[str, Any] = {}
    if load is not None:
        p.load(load, model=model, optimizer=opt)
        out["loaded"] = _copy(p.full_state_dict(model))  # one process: views of the live parameters
    losses = []
    for batch in sharded_batches(kind, start + steps)[start:]:
        for mb in _micro(_slice(batch, p.dp_rank, p.dp), micro):
            if kind == "gpt" and not pp and parallel.get("tp", 1) == 1:  # the user's own forward and loss
                p.backward(sharded_loss(kind, model, mb))
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
    return {k: v.detach().clone() for k, v in state.items()}


def state_diff(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Largest |difference| between two whole state dicts with the same keys (compared in float32)."""
    assert state.keys() == ref.keys(), sorted(set(state) ^ set(ref))
    return max((state[k].float() - ref[k].float()).abs().max().item() for k in ref)


def sharded_moved(kind: str, ref: dict[str, torch.Tensor]) -> float:
    """How far training moved the weights from their initial values (to compare the tolerances with)."""
    return state_diff(ref, sharded_model(kind).state_dict())


# -- the keep-your-loop API ----------------------------------------------------------------------------
def plait_steps(p: Any, model: torch.nn.Module, loader: Any, until: int,
                after_step: Callable[[Any], None] = lambda info: None) -> list[float]:
    """The README's loop over one pass of ``loader`` until ``p.steps == until``: ``forward_backward`` and
    ``step``; each optimizer step's loss reduced over the ranks, then ``after_step(info)``."""
    losses = []
    for batch in loader:
        p.forward_backward(model, batch)
        info = p.step()
        if info is not None:
            losses.append(p.reduce(info.loss))
            after_step(info)
        if p.steps == until:
            break
    return losses


def reference_training(model: torch.nn.Module, dataset: Any, global_batch: int, steps: int, lr: float, seed: int,
                       loss_of: Callable[[torch.nn.Module, Any], torch.Tensor]) -> tuple[list[float], dict]:
    """Losses per step and the final state dict of plain single-process training over the global batches
    plait's loader forms for ``seed`` (the order is a property of plait's sampler, tested in the loader's
    tests: the same samples per step whatever the number of ranks); ``loss_of(model, batch)`` is the test's
    own loss, not plait's."""
    from plait.data.loader import DistributedBatchSampler

    order = DistributedBatchSampler(len(dataset), global_batch, dp_rank=0, dp_size=1, seed=seed).batches(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for idx in order[:steps]:
        loss = loss_of(model, dataset[idx])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
