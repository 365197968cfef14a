"""plait's ZeRO-1/2 with tensor and sequence parallelism (Megatron-Core's distributed optimizer under tp) against one
plain PyTorch process, and its checkpoints resharded to FSDP2 x tp and to plain data parallelism.

One group of 4 gloo ranks, tp=2 x dp=2: plait's GPT (tied embedding and head, vocabulary-parallel) and a Hugging
Face Llama, each at zero=1 and zero=2, without and with sequence parallelism (the norms then replicated DTensors
whose gradients are ``Partial`` over tp), trained 3 AdamW steps (clip 1.0) through ``plait.Plait.forward_backward``
from the same weights on the global batches of ``references.sharded_*`` (zero=2 in 2 micro-batches per rank: the
accumulation path, the others in one). Compared with the same loop in one process: the global loss and the
pre-clip gradient norm of every step, every parameter's step-1 (clipped) gradient gathered whole (ZeRO's reduced
chunks all-gathered over the ZeRO group, then over tp as the parameter is placed), and every parameter after 3
steps (``p.full_state_dict``). Also checked: the model's parameters stay the tp plan's DTensors whose local tensors
are views into ZeRO's flat buffers, and each rank's optimizer states hold 1/dp of the tp-local parameters.

Checkpoint: the GPT's zero=2 x tp=2 run saves after 3 steps; zero=3 x tp=2 (FSDP2 over dp on the tp shards),
zero=0 at dp=4 (no tp) and zero=1 x tp=2 with sequence parallelism load it: the model and every optimizer state
(gathered whole) equal the saved ones exactly, and the 4th step equals the reference's.

Tolerances (``references.sharded_*``): float32 throughout; the maths is the reference's but sums run in another
order (row-parallel partial sums over tp, vocabulary-parallel softmax, gradients averaged over dp, the norm summed
over shards), so losses and norms within ``MP_LOSS_ATOL``, gradients within ``GRAD_ATOL`` (2e-7: float32 rounding of
sums of gradients up to ~1e-2; observed at most 4e-8) and parameters within ``MP_PARAM_ATOL`` after the AdamW steps
(observed at most 1.1e-5), far below one update (1e-3).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import run_ranks
from references import (
    MP_LOSS_ATOL,
    MP_PARAM_ATOL,
    SHARDED_CLIP,
    SHARDED_GLOBAL,
    full,
    sharded_adamw,
    sharded_batches,
    sharded_loss,
    sharded_model,
    state_diff,
)

pytest.importorskip("transformers")

GRAD_ATOL = 2e-7
STEPS = 3
TP = {"tp": 2}
SP = {"tp": 2, "sequence_parallel": True}
# name: (model, parallel, micro-batch per rank)
CASES = {f"{kind}-zero{z}-{tag}": (kind, {**tp, "zero": z}, 4 if z == 1 else 2)
         for kind in ("gpt", "llama") for z in (1, 2) for tag, tp in (("tp", TP), ("sp", SP))}
SAVER = "gpt-zero2-tp"
LOADERS = {"zero3-tp2": {"tp": 2, "zero": 3}, "zero0-dp4": {}, "zero1-tp2-sp": {**SP, "zero": 1}}


def _plait(parallel: dict, run_dir: str, micro: int) -> Any:
    import plait

    return plait.Plait(parallel=parallel, run={"dir": run_dir}, optim={"grad_clip": SHARDED_CLIP},
                       train={"global_batch_size": SHARDED_GLOBAL, "micro_batch_size": micro},
                       observe={"progress": False, "trackers": []})


def _steps(p: Any, model: Any, kind: str, micro: int, first: int, steps: int) -> tuple[list[float], list[float]]:
    """Global batches ``first .. first + steps - 1``, each rank its slice in micro-batches: losses and norms."""
    losses, norms = [], []
    share = SHARDED_GLOBAL // p.dp
    for batch in sharded_batches(kind, first + steps)[first:]:
        mine = tuple(t[p.dp_rank * share:(p.dp_rank + 1) * share] for t in batch) if kind == "gpt" else \
            batch[p.dp_rank * share:(p.dp_rank + 1) * share]
        for i in range(0, share, micro):
            mb = tuple(t[i:i + micro] for t in mine) if kind == "gpt" else mine[i:i + micro]
            p.forward_backward(model, mb, loss_fn="causal_lm")
        info = p.step()
        losses.append(info.global_loss)
        norms.append(float(info.grad_norm))
    return losses, norms


def _zero_grads(zopt: Any, names: dict[int, str]) -> dict[str, torch.Tensor]:
    """The whole step gradients of a ZeRO optimizer: each bucket's reduced chunks all-gathered over the ZeRO group,
    each parameter's slice placed as the parameter is and gathered over tp (collective)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    out = {}
    for b in zopt.buckets:
        parts = [torch.empty_like(b.grad_shard) for _ in range(zopt.world)]
        dist.all_gather(parts, b.grad_shard, group=zopt.group)
        flat = torch.cat(parts)
        for i, q in enumerate(b.params):
            g = b.view(i, flat)
            if isinstance(q, DTensor):
                g = DTensor.from_local(g, q.device_mesh, q.placements, shape=q.shape, stride=q.stride()).full_tensor()
            out[names[id(q)]] = g.clone()
    return out


def _held(p: Any, model: Any) -> dict:
    """What the layout holds: every parameter the plan's DTensor (sharded or replicated over tp) or plain, each
    local tensor a view into a ZeRO flat buffer, the optimizer's state elements on this rank."""
    from torch.distributed.tensor import DTensor

    zopt = p.layout.optimizer
    flats = {b.flat.untyped_storage().data_ptr() for b in zopt.buckets}
    local = [q._local_tensor if isinstance(q, DTensor) else q for q in dict.fromkeys(model.parameters())]
    st = zopt.optimizer.state
    return {"dtensors": sum(isinstance(q, DTensor) for q in model.parameters()),
            "views": all(t.untyped_storage().data_ptr() in flats for t in local),
            "local_numel": sum(t.numel() for t in local),
            "state_numel": sum(st[m]["exp_avg"].numel() for m in st), "composition": p.layout.composition}


def _train(kind: str, parallel: dict, run_dir: str, micro: int, save: str | None) -> dict:
    p = _plait(parallel, run_dir, micro)
    model, opt = p.setup(sharded_model(kind, seed=p.rank), optimizer=sharded_adamw)
    names = {id(q): n for n, q in model.named_parameters()}
    grads: dict[str, torch.Tensor] = {}

    def first_grads(o: Any, args: Any, kwargs: Any) -> None:
        if not grads:
            grads.update(_zero_grads(p.layout.optimizer, names))
    hook = p.layout.optimizer.optimizer.register_step_pre_hook(first_grads)  # after the clip, before the update
    losses, norms = _steps(p, model, kind, micro, 0, STEPS)
    hook.remove()
    out = {"losses": losses, "norms": norms, "grads": grads, "held": _held(p, model),
           "state": {k: v.clone() for k, v in p.full_state_dict(model).items()}}
    if save is not None:
        out["optim"] = _optimizer_state(p)
        p.save(save, model=model, optimizer=opt)
    p.close()
    return out


def _optimizer_state(p: Any) -> dict[str, dict[str, torch.Tensor]]:
    """The layout's optimizer states (the checkpoint's ``optim`` entries), each gathered whole (collective)."""
    _, optim = p.layout.state.state_dicts()
    return {n: {k: full(v).detach().clone() for k, v in st.items()} for n, st in sorted(optim["state"].items())}


def _resume(parallel: dict, run_dir: str, load: str) -> dict:
    p = _plait(parallel, run_dir, 2)
    model, opt = p.setup(sharded_model("gpt", seed=100 + p.rank), optimizer=sharded_adamw)  # all from the checkpoint
    p.load(load, model=model, optimizer=opt)
    out = {"loaded": {k: v.clone() for k, v in p.full_state_dict(model).items()}, "optim": _optimizer_state(p)}
    out["losses"], out["norms"] = _steps(p, model, "gpt", 2, STEPS, 1)
    out["state"] = {k: v.clone() for k, v in p.full_state_dict(model).items()}
    p.close()
    return out


def _group(rank: int, world: int, root: str) -> dict:
    out = {name: _train(kind, parallel, f"{root}/{name}", micro, f"{root}/ckpt" if name == SAVER else None)
           for name, (kind, parallel, micro) in CASES.items()}
    for name, parallel in LOADERS.items():
        out[name] = _resume(parallel, f"{root}/{name}", f"{root}/ckpt")
    return out


def _reference(kind: str, steps: int) -> dict:
    """The plain loop in one process: losses, pre-clip norms, step-1 clipped gradients, the state after each step."""
    model = sharded_model(kind)
    opt = sharded_adamw(model)
    out: dict[str, Any] = {"losses": [], "norms": [], "states": []}
    for batch in sharded_batches(kind, steps):
        loss = sharded_loss(kind, model, batch)
        loss.backward()
        out["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), SHARDED_CLIP)))
        out.setdefault("grads", {n: q.grad.detach().clone() for n, q in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
        out["states"].append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(_group, 4, str(tmp_path_factory.mktemp("zero_tp")), timeout=900)


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    return {"gpt": _reference("gpt", STEPS + 1), "llama": _reference("llama", STEPS)}


def _grad_diff(grads: dict, ref: dict) -> float:
    assert grads.keys() == ref.keys(), sorted(set(grads) ^ set(ref))
    return max((grads[k] - ref[k]).abs().max().item() for k in ref)


@pytest.mark.parametrize("name", list(CASES))
def test_zero_with_tensor_parallelism_matches_one_process(ranks, references, name) -> None:
    kind, parallel, _ = CASES[name]
    ref = references[kind]
    assert ref["norms"][0] > SHARDED_CLIP  # the clip scales the step-1 gradients: the global norm decides them
    for r in ranks:
        run = r[name]
        assert run["losses"] == pytest.approx(ref["losses"][:STEPS], abs=MP_LOSS_ATOL), name
        assert run["norms"] == pytest.approx(ref["norms"][:STEPS], abs=MP_LOSS_ATOL), name
        assert _grad_diff(run["grads"], ref["grads"]) < GRAD_ATOL, name
        assert state_diff(run["state"], ref["states"][STEPS - 1]) < MP_PARAM_ATOL, name
        held = run["held"]
        assert held["composition"] == "WholeModel/Zero" and held["dtensors"] > 0 and held["views"], (name, held)
        # this rank's optimizer states: 1/dp of its tp-local parameters (each bucket padded to dp chunks)
        assert held["local_numel"] / 2 <= held["state_numel"] <= held["local_numel"] / 2 + 64, (name, held)
    if parallel.get("sequence_parallel"):  # the norms are replicated DTensors: more DTensors than without sp
        assert ranks[0][name]["held"]["dtensors"] > ranks[0][name.replace("-sp", "-tp")]["held"]["dtensors"]


@pytest.mark.parametrize("name", list(LOADERS))
def test_zero_tp_checkpoint_reshards(ranks, references, name) -> None:
    ref = references["gpt"]
    for r in ranks:
        saved, run = r[SAVER], r[name]
        assert run["loaded"].keys() == saved["state"].keys()
        for k, v in saved["state"].items():
            assert torch.equal(run["loaded"][k], v), (name, k)
        assert run["optim"].keys() == saved["optim"].keys(), (name, sorted(set(run["optim"]) ^ set(saved["optim"])))
        for n, st in saved["optim"].items():
            assert st.keys() == run["optim"][n].keys(), (name, n)
            for k, v in st.items():
                assert torch.equal(run["optim"][n][k].reshape(v.shape), v), (name, n, k)
        assert run["losses"] == pytest.approx(ref["losses"][STEPS:], abs=MP_LOSS_ATOL), name
        assert run["norms"] == pytest.approx(ref["norms"][STEPS:], abs=MP_LOSS_ATOL), name
        assert state_diff(run["state"], ref["states"][STEPS]) < MP_PARAM_ATOL, name
