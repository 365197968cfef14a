"""A model built on the meta device whose rotary cache only its constructor computes, and whose state-dict hooks
rename its fused ``wqkv`` (``tests/fused_model.py``, shaped like torchtitan's Llama, blocks in a ``ModuleDict``),
trained through plait at dp=2, ZeRO-2, ZeRO-3, tp=2 and pp=2 (2 ranks, one spawned group) against the same model
built on the CPU (the cache made by its constructor) and trained in plain PyTorch from the weights plait gave it.

Meta initialisation: setup without ``weights=`` computes the cache (the module built again from its attributes:
it has no init of its own) and gives every layout the same weights, bit for bit, as ``initialise_like`` in one
process; a module whose construction cannot be re-run is refused on every rank before any step, naming the buffer.
State-dict hooks: ``full_state_dict`` (before and after training), ``save`` and ``load`` go through the model's own
hooks at every layout (the checkpoint holds ``wq``/``wk``/``wv``, never ``wqkv``); the ZeRO-3 checkpoint resumes at
tp=2 and the tp=2 one at pp=2 and train on like the reference; a directory export at ZeRO-3 and tp=2 loads into a
fresh CPU model through its load hook, and, given as ``weights=``, into the meta-built model at dp=2 and pp=2. A save
that fails leaves no directory and the earlier checkpoint loads.

Tolerances: the initial weights are equal across layouts and to ``initialise_like`` exactly (one function of seed
and module name); the losses and the parameters after 2 AdamW steps (lr 1e-3, clipped at 1.0) within ``ATOL`` of
the reference (``tests/fused_model.py`` says why); the exported weights equal the trained ones exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fused_model import ATOL, GLOBAL, LOSS_RTOL, LR, SEED, STEPS, TP_PLAN, FusedDecoder, dataset, user_loss
from helpers import run_ranks
from torch import nn

from plait.config import ConfigError

PP = {"pp": 2, "microbatches": 2, "pp_schedule": "gpipe"}
LAYOUTS = {"dp2": ({}, 4), "zero2": ({"zero": 2}, 4), "zero3": ({"zero": 3}, 4), "tp2": ({"tp": 2}, 8),
           "pp2": (PP, 8)}
RESUME = {"zero3": "tp2", "tp2": "pp2"}  # checkpoint saved at -> resumed at
WEIGHTS_AT = ("dp2", "pp2")  # layouts set up from the ZeRO-3 export (weights=PATH)


class Stage(nn.Module):
    """The user's pipeline stage under the model's names: the embedding and block 0, or block 1 and the head."""

    def __init__(self, model: FusedDecoder, first: bool) -> None:
        super().__init__()
        self.first = first
        self.layers = nn.ModuleDict({k: model.layers[k] for k in (("0",) if first else ("1",))})
        if first:
            self.tok_embeddings = model.tok_embeddings
        else:
            self.norm, self.output = model.norm, model.output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.first else x
        for layer in self.layers.values():
            h = layer(h)
        return h if self.first else self.output(self.norm(h))


def stage_fn(model: FusedDecoder, index: int, num_stages: int) -> nn.Module:
    return Stage(model, index == 0)


def _plait(parallel: dict, micro: int, run_dir: str):
    import plait

    return plait.Plait(parallel=parallel, run={"dir": run_dir}, optim={"grad_clip": 1.0},
                       train={"global_batch_size": GLOBAL, "micro_batch_size": micro, "seed": SEED},
                       observe={"progress": False, "trackers": []})


def train(name: str, root: str, load: str | None = None) -> dict:
    """The meta-built model set up at layout ``name`` without weights (or loaded from checkpoint ``load``), trained
    in the user's loop (``forward_backward`` under pp): its whole state before and after, the losses; saved."""
    parallel, micro = LAYOUTS[name]
    p = _plait(parallel, micro, f"{root}/run-{name}-{bool(load)}")
    pp = "pp" in parallel
    with torch.device("meta"):
        built = FusedDecoder()
    model, opt = p.setup(built, optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=LR),
                         tp_plan=TP_PLAN if "tp" in parallel else None, stage_fn=stage_fn if pp else None,
                         loss_fn="causal_lm" if pp else None)
    loader = p.setup_dataloader(dataset())
    if load is not None:
        p.load(load, model=model, optimizer=opt, dataloader=loader)
    initial = {k: v.clone() for k, v in p.full_state_dict(model).items()}
    losses = []
    for batch in loader:
        if pp:
            p.forward_backward(model, batch)
        else:
            p.backward(user_loss(model, batch))
        info = p.step()
        if info is not None:
            losses.append(info.global_loss)
        if p.steps == (STEPS + 1 if load else STEPS):
            break
    out = {"initial": initial, "losses": losses, "state": p.full_state_dict(model)}
    if load is None:
        p.save(f"{root}/ckpt-{name}", model=model, optimizer=opt, dataloader=loader)
        if name in ("zero3", "tp2"):
            p.export(model, f"{root}/export-{name}")
    p.close()
    return out


def from_weights(name: str, root: str) -> dict:
    """The meta-built model set up at layout ``name`` from the ZeRO-3 export (``weights=``, a Hugging Face
    directory under the state dict's names): its whole state."""
    parallel, micro = LAYOUTS[name]
    p = _plait(parallel, micro, f"{root}/run-{name}-weights")
    pp = "pp" in parallel
    with torch.device("meta"):
        built = FusedDecoder()
    model, _ = p.setup(built, weights=f"{root}/export-zero3", tp_plan=TP_PLAN if "tp" in parallel else None,
                       stage_fn=stage_fn if pp else None, loss_fn="causal_lm" if pp else None)
    state = p.full_state_dict(model)
    p.close()
    return state


class Unbuildable(nn.Module):
    """A cache made in ``__init__`` from an argument the module does not keep: nothing can compute it again."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("cache", torch.arange(n, dtype=torch.float32), persistent=False)


def refused(root: str) -> str:
    p = _plait({"zero": 3}, 4, f"{root}/run-refused")
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Unbuildable(4))
    try:
        p.setup(model)
        return "set up"
    except ConfigError as e:
        return str(e)
    finally:
        p.barrier()  # no rank was left inside a collective
        p.close()


def _worker(rank: int, world: int, root: str) -> dict:
    out = {name: train(name, root) for name in LAYOUTS}
    out.update({("resume", saved): train(at, root, load=f"{root}/ckpt-{saved}") for saved, at in RESUME.items()})
    out.update({("weights", at): from_weights(at, root) for at in WEIGHTS_AT})
    out["refused"] = refused(root)
    return out


@pytest.fixture(scope="module")
def group(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("meta_hooks")
    return {"root": root, "results": run_ranks(_worker, 2, str(root), timeout=600)}


@pytest.fixture(scope="module")
def reference(group) -> tuple[list[float], dict]:
    """The CPU-built model (its cache from its constructor) from plait's initial weights, trained in plain PyTorch
    over the global batches plait's loader forms: (losses of STEPS + 1 steps, state after STEPS)."""
    from plait.data.loader import DistributedBatchSampler

    model = FusedDecoder()
    model.load_state_dict(group["results"][0]["dp2"]["initial"])  # its own load hook merges wq/wk/wv into wqkv
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    data, losses, after = dataset(), [], {}
    for step, idx in enumerate(DistributedBatchSampler(len(data), GLOBAL, dp_rank=0, dp_size=1, seed=SEED).batches(0)):
        if step == STEPS:
            after = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if step == STEPS + 1:
            break
        loss = user_loss(model, data[idx])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, after


def _close(got: dict, want: dict, atol: float) -> float:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    diff = max((got[k].float() - want[k].float()).abs().max().item() for k in want)
    assert diff <= atol, diff
    return diff


def test_meta_init_equal_everywhere(group) -> None:
    from plait.parallel.meta_init import initialise_like

    with torch.device("meta"):
        built = FusedDecoder()
    expected = initialise_like(built, SEED).state_dict()
    assert any(".wq.weight" in k for k in expected) and not any("wqkv" in k for k in expected)
    for result in group["results"]:
        for name in LAYOUTS:
            _close(result[name]["initial"], expected, 0.0)


def test_trains_like_the_cpu_built_model(group, reference) -> None:
    losses, after = reference
    for name in LAYOUTS:
        got = group["results"][0][name]
        assert got["losses"] == pytest.approx(losses[:STEPS], rel=LOSS_RTOL), name
        _close(got["state"], after, ATOL)
        _close(group["results"][1][name]["state"], got["state"], 0.0)  # every rank gathers the same


def test_checkpoint_names_and_resume(group, reference) -> None:
    root = group["root"]
    from torch.distributed.checkpoint import FileSystemReader

    keys = set(FileSystemReader(str(root / "ckpt-zero3")).read_metadata().state_dict_metadata)
    assert "model.layers.0.attention.qkv.wq.weight" in keys and not any("wqkv" in k and k.startswith("model.")
                                                                         for k in keys)
    losses, _ = reference
    for saved, at in RESUME.items():
        got = group["results"][0]["resume", saved]
        _close(got["initial"], group["results"][0][saved]["state"], 0.0)  # loaded exactly what was saved
        assert got["losses"] == pytest.approx(losses[STEPS:], rel=LOSS_RTOL), (saved, at)


def test_export_loads_into_a_fresh_model(group) -> None:
    from safetensors.torch import load_file

    for name in ("zero3", "tp2"):
        weights = {}
        for f in sorted(Path(group["root"], f"export-{name}").glob("*.safetensors")):
            weights.update(load_file(f))
        fresh = FusedDecoder()
        fresh.load_state_dict(weights)  # strict: every name the model's state dict has, merged by its hook
        _close(fresh.state_dict(), group["results"][0][name]["state"], 0.0)


def test_weights_load_through_the_hooks(group) -> None:
    """``weights=`` names ``wq``/``wk``/``wv``, which the model's load hook merges into its ``wqkv``: every layout
    holds exactly the exported (trained) weights."""
    for result in group["results"]:
        for at in WEIGHTS_AT:
            _close(result["weights", at], group["results"][0]["zero3"]["state"], 0.0)


def test_uninitialisable_buffer_refused_on_every_rank(group) -> None:
    for result in group["results"]:
        assert "nothing initialises 1.cache" in result["refused"] and "init_fn" in result["refused"]
        assert "\n" not in result["refused"]


def test_failed_save_leaves_no_directory(tmp_path) -> None:
    """One process: a state-dict hook that fails on the second save; the first checkpoint stays and loads."""
    import plait

    model = FusedDecoder()
    fail = {"on": False}

    def hook(module, state, prefix, local_metadata):
        if fail["on"]:
            raise RuntimeError("hook failed")

    model.register_state_dict_post_hook(hook)
    p = plait.Plait(run={"dir": str(tmp_path / "run")}, observe={"progress": False, "trackers": []})
    model, opt = p.setup(model)
    p.save(tmp_path / "a", model=model, optimizer=opt)
    fail["on"] = True
    with pytest.raises(RuntimeError, match="hook failed"):
        p.save(tmp_path / "b", model=model, optimizer=opt)
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.tmp").exists()
    fail["on"] = False
    p.load(tmp_path / "a", model=model, optimizer=opt)
    p.close()
