"""Models larger than one process: built on the meta device, loaded from Hugging Face checkpoints shard by
shard (``setup(..., weights=PATH)``), exported shard by shard (``Plait.export(model, DIR)``).

Checkpoints are written by ``save_pretrained(max_shard_size=...)`` into several files: a ``LlamaForCausalLM``
(untied head), a ``Qwen2ForCausalLM`` with tied embeddings (``save_pretrained`` leaves the head out) and a
``MixtralForCausalLM`` (4 experts, top-2), whose experts ``save_pretrained`` writes one tensor per expert and
matrix while the model holds them fused. Each is built under ``torch.device("meta")`` on every rank and loaded:
the Llama and the Qwen2 at zero=3 dp=2, tp=2 and pp=2 (2 ranks), the Llama at dp=2 x tp=2 with zero=3, HSDP
(zero=3, dp_shard=2), pp=2 x zero=2 and pp=2 x zero=3 (4 ranks), the Mixtral at ep=2 and tp=2 (2 ranks) and
ep=2 x zero=3 (4 ranks); at zero=2 (which keeps the whole model on every rank) it is allocated whole. The reference
is one process, plain PyTorch: ``from_pretrained`` of the same directory, the model's own loss, AdamW with
clipping at 1.0 over the same global batches.

Tolerances: the first loss equals the reference's within 1e-6 relative (the same weights; only the order of sums
differs: largest measured 1.3e-7, the Mixtral's 8.6e-8 at ep=2, 0 at tp=2 and 1.3e-7 at ep=2 x zero=3); parameters
after 3 AdamW steps within ``PARAM_ATOL`` (the bound of ``test_api_hf``: 3e-5 absolute; largest measured here 2.3e-5
with tensor parallelism, 4.4e-6 without, the Mixtral's 3.1e-6 at ep=2, 7.8e-6 at tp=2 and 1.9e-6 at ep=2 x zero=3,
torch 2.13 on CPU: AdamW's first steps move each weight by about lr whatever its gradient's size, so a near-zero
gradient summed in another order moves it differently); the exported directory, loaded by ``from_pretrained``,
equals the trained single-process model within the same bound and has no missing or unexpected key, and its files
are named as ``save_pretrained`` names them (one file, or several cut at ``max_shard_bytes`` with an index; at tp=2
the Mixtral's directory export is refused in one message: each rank holds a packed expert weight as two slices). The
Mixtral loaded at ep=2, tp=2 and ep=2 x zero=3 equals ``from_pretrained``'s bit for bit. A meta-built model without
weights (the Llama at zero=3 and tp=2, the Mixtral at ep=2 and tp=2) starts from exactly the weights
``plait.parallel.meta_init.initialise_like`` gives the whole model in one process (bit for bit) and the Llama trains
(its loss on a repeated batch falls). Memory: each rank's peak RSS over setup+load, less its RSS before the model
was built, against the full model's fp32 bytes (see ``test_setup_memory_per_rank``). Bad checkpoints end in one
``WeightsError`` on every rank, before any collective (the group goes on to the next case), and through ``plait
train`` in one line with exit code 2.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import run_ranks
from references import reference_training

from plait.config import ConfigError

transformers = pytest.importorskip("transformers", reason="the hf extra (pip install 'plait[hf]') is not installed")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PARAM_ATOL = 3e-5
SHARD_BYTES = 60_000  # an export cut into several files: SMALL's embeddings alone are 64 KiB
STEPS, GLOBAL, SEQ, LR, SEED = 3, 8, 16, 1e-3, 3
SMALL = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
FAMILIES = {"llama": ("LlamaForCausalLM", "LlamaConfig", {}),
            "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {"tie_word_embeddings": True}),
            # 4 experts of width 128, top-2; the auxiliary loss off (the model's loss is then plait's causal_lm)
            "mixtral": ("MixtralForCausalLM", "MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2})}
DENSE = ("llama", "qwen2")
# the memory model: ~36M parameters, 144 MB in fp32, so the allocator's and DCP's own overheads are small
BIG = {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
       "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 64}
PP = {"pp": 2, "microbatches": 2, "pp_split": ["model.layers.1"]}
LAYOUTS2 = {"zero3": ({"zero": 3}, 4), "tp2": ({"tp": 2}, 8), "pp2": (PP, 8), "zero2": ({"zero": 2}, 4)}
# 4 ranks: dp=2 x tp=2 (ZeRO-3), HSDP (shard groups of 2, 2 replicas), pipelines of 2 stages with ZeRO-2 and
# ZeRO-3 over the stage's 2 data-parallel ranks (PipelineZero, PipelineFsdp)
LAYOUTS4 = {"dp2xtp2": ({"zero": 3, "tp": 2}, 4), "hsdp": ({"zero": 3, "dp_shard": 2}, 2),
            "pp2xzero2": ({**PP, "zero": 2}, 4), "pp2xzero3": ({**PP, "zero": 3}, 4)}
# the Mixtral: ep=2 over dp=2 (each rank 2 of the 4 experts), tp=2 (each expert's packed [gate; up] weight split
# in both blocks), and at 4 ranks ep=2 with zero=3 (the experts sharded again, on their dim 1, over the 2 ranks
# holding the same experts; the dense weights over all 4)
MOE2 = {"ep2": ({"ep": 2}, 4), "tp2": ({"tp": 2}, 8)}
MOE4 = {"ep2xzero3": ({"ep": 2, "zero": 3}, 2)}


def build(family: str, shape: dict | None = None, meta: bool = False) -> torch.nn.Module:
    cls, cfg_cls, extra = FAMILIES[family]
    config = getattr(transformers, cfg_cls)(**(shape or SMALL), **extra)
    with torch.device("meta") if meta else torch.device("cpu"):
        return getattr(transformers, cls)(config)


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(11)
    return torch.utils.data.TensorDataset(torch.randint(0, 256, (3 * STEPS * GLOBAL, SEQ), generator=g))


def _plait(parallel: dict, micro: int, run_dir: str):
    import plait

    return plait.Plait(parallel=parallel, run={"dir": run_dir}, optim={"grad_clip": 1.0},
                       train={"global_batch_size": GLOBAL, "micro_batch_size": micro, "seed": SEED},
                       observe={"progress": False, "trackers": []})


def train(family: str, parallel: dict, micro: int, run_dir: str, weights: str | None, export: str | None = None,
          steps: int = STEPS, repeat: bool = False, keep_initial: bool = False) -> dict:
    """Build on meta, set up (loading ``weights``), train ``steps`` AdamW steps (``repeat``: on the first batch
    again and again); the whole state before (without weights, or with ``keep_initial``) and after, and the
    losses. ``export``: the model is exported there (one file at the default ``max_shard_bytes``) and to
    ``export + "-shards"`` cut at ``SHARD_BYTES``."""
    p = _plait(parallel, micro, run_dir)
    model, _ = p.setup(build(family, meta=True), optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=LR),
                       loss_fn="causal_lm", weights=weights)
    initial = None  # copies: without sharding the whole state is the live parameters, which training changes
    if weights is None or keep_initial:
        initial = {k: v.detach().clone() for k, v in p.full_state_dict(model).items()}
    loader = p.setup_dataloader(dataset())
    losses, first = [], None
    for batch in loader:
        first = first if first is not None else batch
        p.forward_backward(model, first if repeat else batch)
        info = p.step()
        if info is not None:
            losses.append(p.reduce(info.loss))
        if p.steps == steps:
            break
    state = p.full_state_dict(model)
    export_error = None
    if export:
        try:
            p.export(model, export)
            p.export(model, export + "-shards", max_shard_bytes=SHARD_BYTES)
        except ConfigError as e:  # a refused export (every rank alike): the tests read the message
            export_error = str(e)
    p.close()
    return {"losses": losses, "state": state, "initial": initial, "export_error": export_error}


def bad_inputs(root: str, family: str) -> dict[str, str]:
    """Each bad checkpoint's message (every rank gets one; none hangs: the group goes on to the next)."""
    from plait.checkpoint.hf import WeightsError

    out = {}
    for case in sorted(MESSAGES):
        p = _plait({"zero": 3}, 4, f"{root}/bad-run-{case}")
        try:
            p.setup(build(family, meta=True), loss_fn="causal_lm", weights=f"{root}/bad/{case}")
            out[case] = "loaded"
        except WeightsError as e:
            out[case] = str(e)
        p.barrier()  # every rank is here: no rank was left inside a collective
        p.close()
    return out


def _status_kb(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def setup_memory(root: str, world: int, meta: bool) -> int:
    """Bytes this rank's peak RSS rose by over building and setting up the BIG Llama at zero=3: on the meta
    device with ``weights=`` (plait's path), or built whole on every rank (the path without either). The peak
    is the kernel's high-water mark, reset just before (``/proc/self/clear_refs``), after the modules used were
    imported (a first meta build, DCP's reader)."""
    import gc

    p = _plait({"zero": 3}, GLOBAL // world, f"{root}/mem-{meta}")
    # what is imported on first use is not the model's memory: transformers' model modules, DCP's reader
    build("llama", BIG, meta=True)
    import safetensors.torch  # noqa: F401
    from torch.distributed.checkpoint import HuggingFaceStorageReader  # noqa: F401
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = _status_kb("VmRSS")
    model, _ = p.setup(build("llama", BIG, meta=meta), loss_fn="causal_lm",
                       weights=f"{root}/big" if meta else None)
    peak = _status_kb("VmHWM")
    p.close()
    del model
    gc.collect()
    return (peak - before) * 1024


def _worker2(rank: int, world: int, root: str) -> dict:
    out: dict = {"memory": (setup_memory(root, world, True), setup_memory(root, world, False))}
    for family in DENSE:
        for name, (parallel, micro) in LAYOUTS2.items():
            export = f"{root}/export-{family}-{name}" if name in ("zero3", "pp2") else None
            out[family, name] = train(family, parallel, micro, f"{root}/{family}-{name}", f"{root}/{family}",
                                      export=export)
    for name, (parallel, micro) in MOE2.items():
        out["mixtral", name] = train("mixtral", parallel, micro, f"{root}/mixtral-{name}", f"{root}/mixtral",
                                     export=f"{root}/export-mixtral-{name}", keep_initial=True)
        out["init-mixtral", name] = train("mixtral", parallel, micro, f"{root}/init-mixtral-{name}", None, steps=1)
    for name in ("zero3", "tp2"):
        parallel, micro = LAYOUTS2[name]
        out["init", name] = train("llama", parallel, micro, f"{root}/init-{name}", None, steps=6, repeat=True)
    out["bad"] = bad_inputs(root, "llama")
    return out


def _worker4(rank: int, world: int, root: str) -> dict:
    out: dict = {"memory": (setup_memory(root, world, True), setup_memory(root, world, False))}
    for name, (parallel, micro) in LAYOUTS4.items():
        out["llama", name] = train("llama", parallel, micro, f"{root}/4-{name}", f"{root}/llama",
                                   export=f"{root}/export-llama-{name}" if name != "pp2xzero2" else None)
    for name, (parallel, micro) in MOE4.items():
        out["mixtral", name] = train("mixtral", parallel, micro, f"{root}/4-mixtral-{name}", f"{root}/mixtral",
                                     export=f"{root}/export-mixtral-{name}", keep_initial=True)
    return out


def _write_bad(root: Path, family: str) -> None:
    from safetensors.torch import save_file

    sd = {k: v.contiguous() for k, v in build(family).state_dict().items()}
    bad = root / "bad"
    cases = {"missing-key": {k: v for k, v in sd.items() if k != "model.norm.weight"},
             "extra-key": {**sd, "model.layers.0.mlp.gate_proj.bias": torch.zeros(128)},
             "wrong-shape": {**sd, "model.norm.weight": torch.ones(65)},
             "wrong-dtype": {**sd, "model.norm.weight": torch.ones(64, dtype=torch.int64)}}
    for case, tensors in cases.items():
        (bad / case).mkdir(parents=True)
        save_file(tensors, str(bad / case / "model.safetensors"))
    shards = sorted(p.name for p in (root / family).glob("model-*.safetensors"))
    shutil.copytree(root / family, bad / "missing-shard")
    (bad / "missing-shard" / shards[1]).unlink()
    shutil.copytree(root / family, bad / "truncated-shard")
    shard = bad / "truncated-shard" / shards[2]
    shard.write_bytes(shard.read_bytes()[:-100])


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("big")
    for family in FAMILIES:
        torch.manual_seed(0)
        build(family).save_pretrained(root / family, max_shard_size="60KB")
        assert len(list((root / family).glob("model-*.safetensors"))) >= 3  # several files, one index
    _write_bad(root, "llama")
    torch.manual_seed(0)
    build("llama", BIG).save_pretrained(root / "big", max_shard_size="5MB")
    return root


@pytest.fixture(scope="module")
def results(root) -> dict:
    # a fixed mmap threshold: every large tensor is its own mapping, returned to the system when freed, so an
    # RSS measured after earlier work is not lowered by memory malloc kept from it
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    two = run_ranks(_worker2, 2, str(root), timeout=600)
    four = run_ranks(_worker4, 4, str(root), timeout=600)
    for world, ranks in (("2", two), ("4", four)):  # the measured fractions, for the record (pytest -s)
        full = sum(v.numel() * 4 for v in build("llama", BIG, meta=True).state_dict().values())
        print(f"setup+load peak RSS over the full model's bytes at zero=3 x{world}: meta+weights "
              f"{[round(r['memory'][0] / full, 3) for r in ranks]}, whole model on every rank "
              f"{[round(r['memory'][1] / full, 3) for r in ranks]}")
    return {"2": two, "4": four}


def reference(root: Path, family: str) -> tuple[list[float], dict]:
    model = getattr(transformers, FAMILIES[family][0]).from_pretrained(root / family)
    return reference_training(model, dataset(), GLOBAL, STEPS, LR, SEED,
                              lambda m, batch: m(input_ids=batch[0], labels=batch[0]).loss)


def _max_diff(state: dict, ref: dict) -> float:
    return max((state[k].float() - ref[k].float()).abs().max().item() for k in ref)


CASES = ([("2", f, n) for f in DENSE for n in LAYOUTS2] + [("4", "llama", n) for n in LAYOUTS4]
         + [("2", "mixtral", n) for n in MOE2] + [("4", "mixtral", n) for n in MOE4])


@pytest.mark.parametrize(("world", "family", "layout"), CASES)
def test_loaded_checkpoint_trains_like_from_pretrained(root, results, world, family, layout) -> None:
    ref_losses, ref_state = reference(root, family)
    for r in results[world]:
        got = r[family, layout]
        assert len(got["losses"]) == STEPS
        assert abs(got["losses"][0] - ref_losses[0]) <= 1e-6 * abs(ref_losses[0]), (got["losses"][0], ref_losses[0])
        assert set(got["state"]) == set(ref_state)
        assert _max_diff(got["state"], ref_state) < PARAM_ATOL
        print(f"{family} {layout}: first loss relative difference {abs(got['losses'][0] / ref_losses[0] - 1):.1e}, "
              f"parameters after {STEPS} steps {_max_diff(got['state'], ref_state):.1e}")
    pretrained = getattr(transformers, FAMILIES[family][0]).from_pretrained(root / family).state_dict()
    assert _max_diff(ref_state, pretrained) > 50 * PARAM_ATOL  # the steps moved the weights far more


def _exported_files(out: Path) -> list[str]:
    """The files of a Hugging Face export, checked against ``save_pretrained``'s names: ``model.safetensors``
    alone when one file holds the model, else ``model-0000k-of-0000n.safetensors`` and the index naming them."""
    files = {p.name for p in out.iterdir()}
    if "model.safetensors" in files:
        assert files == {"model.safetensors", "config.json"}, files
        return ["model.safetensors"]
    shards = sorted(set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values()))
    assert shards == [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    assert files == {*shards, "model.safetensors.index.json", "config.json"}, files
    return shards


@pytest.mark.parametrize(("family", "layout"), [("llama", "zero3"), ("llama", "pp2"), ("qwen2", "zero3"),
                                                ("qwen2", "pp2"), ("llama", "dp2xtp2"), ("llama", "hsdp"),
                                                ("llama", "pp2xzero3"), ("mixtral", "ep2"),
                                                ("mixtral", "ep2xzero3")])
@pytest.mark.parametrize("cut", ["", "-shards"])
def test_exported_directory_loads_with_from_pretrained(root, results, family, layout, cut) -> None:
    """Every rank writes its part; the files are named as ``save_pretrained`` names them: the small model in
    ``model.safetensors`` alone at the default ``max_shard_bytes``, in several files with an index at
    ``SHARD_BYTES``."""
    _, ref_state = reference(root, family)
    world = "4" if layout in LAYOUTS4 or layout in MOE4 else "2"
    assert all(r[family, layout]["export_error"] is None for r in results[world])
    out = root / f"export-{family}-{layout}{cut}"
    shards = _exported_files(out)
    assert len(shards) >= 3 if cut else shards == ["model.safetensors"]
    model, info = getattr(transformers, FAMILIES[family][0]).from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert _max_diff(model.state_dict(), ref_state) < PARAM_ATOL


@pytest.mark.parametrize(("world", "layout"), [("2", "ep2"), ("2", "tp2"), ("4", "ep2xzero3")])
def test_expert_checkpoint_loads_each_ranks_slices_exactly(root, results, world, layout) -> None:
    """``save_pretrained`` writes a Mixtral's experts apart (``block_sparse_moe.experts.{e}.w1/w2/w3.weight``, one
    tensor per expert and matrix) where the model holds them fused (``mlp.experts.gate_up_proj (E, 2I, C)``,
    ``down_proj (E, C, I)``); each rank reads its slices of those tensors (its experts; under tp its rows of both
    the gate and the up block), merged as ``from_pretrained`` merges them: the model set up from it equals
    ``from_pretrained``'s bit for bit (a copy: exact)."""
    index = json.loads((root / "mixtral" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in index
    assert not any("gate_up_proj" in k or ".mlp." in k for k in index)
    expected = transformers.MixtralForCausalLM.from_pretrained(root / "mixtral").state_dict()
    for r in results[world]:
        got = r["mixtral", layout]["initial"]
        assert set(got) == set(expected)
        for k, v in expected.items():
            assert torch.equal(got[k], v), k


def test_materialise_keeps_what_a_layout_marked_on_a_tensor() -> None:
    """A layout marks tensors while the model is still on meta (expert parallelism: the expert mark and the
    global shape); materialising swaps storage into each tensor object, which exchanges its Python attributes too.
    They are kept: without them a meta-built model's experts were read at the wrong offset and reduced as dense
    weights at ep=2, and at ep=2 x zero=3 setup failed (no expert parameter found)."""
    from plait.parallel.meta_init import materialise
    from plait.parallel.units import EXPERT_ATTR, is_expert

    with torch.device("meta"):
        m = torch.nn.Linear(4, 2)
    w = m.weight
    setattr(w, EXPERT_ATTR, True)
    w.global_shape = (4, 2)
    materialise(m, torch.device("cpu"))
    assert m.weight is w and not w.is_meta and not m.bias.is_meta
    assert is_expert(w) and w.global_shape == (4, 2) and not is_expert(m.bias)


def test_checkpoint_conversion_plait_cannot_read_in_blocks_is_refused(root) -> None:
    """A conversion other than stacking and concatenating (here a transpose after the stack) cannot be read a
    slice at a time: one ``WeightsError`` names the model's tensor and the operation, before anything is read."""
    from transformers.core_model_loading import MergeModulelist, Transpose, WeightConverter, WeightRenaming

    from plait.checkpoint.hf import WeightsError, open_checkpoint
    from plait.checkpoint.hf_convert import converted

    ckpt = open_checkpoint(root / "mixtral")
    conversions = [WeightRenaming(".block_sparse_moe.", ".mlp."),
                   WeightConverter(".experts.*.w2.weight", ".experts.down_proj", [MergeModulelist(0), Transpose(1, 2)])]
    names = set(build("mixtral", meta=True).state_dict())
    with pytest.raises(WeightsError, match=r"model\.layers\.0\.mlp\.experts\.down_proj is stored as 4 tensors "
                                           r"\(model\.layers\.0\.block_sparse_moe\.experts\.0\.w2\.weight.*Transpose"):
        converted(ckpt, conversions, names.__contains__)


@pytest.mark.parametrize("layout", ["zero3", "tp2"])
def test_meta_model_without_weights_starts_from_the_stated_init_and_trains(results, layout) -> None:
    from plait.parallel.meta_init import initialise_like

    expected = initialise_like(build("llama", meta=True), SEED).state_dict()
    for r in results["2"]:
        got = r["init", layout]
        assert set(got["initial"]) == set(expected)
        for k, v in expected.items():
            assert torch.equal(got["initial"][k], v), k  # bit for bit: the same init at any layout
        assert got["losses"][-1] < got["losses"][0] - 0.05, got["losses"]
    # the init is the model's own (HF _init_weights: normal(0, initializer_range) for linear layers, ones for
    # norms), not storage left uninitialised
    assert expected["model.norm.weight"].eq(1).all()
    assert abs(expected["model.layers.0.mlp.up_proj.weight"].std().item() - 0.02) < 0.002


@pytest.mark.parametrize("layout", ["ep2", "tp2"])
def test_meta_moe_model_without_weights_starts_from_the_stated_init(results, layout) -> None:
    """The Mixtral built on meta without weights: its experts (each rank's, and under tp each rank's rows of both
    packed blocks) start from exactly the weights ``initialise_like`` gives the whole model in one process."""
    from plait.parallel.meta_init import initialise_like

    expected = initialise_like(build("mixtral", meta=True), SEED).state_dict()
    for r in results["2"]:
        got = r["init-mixtral", layout]["initial"]
        assert set(got) == set(expected)
        for k, v in expected.items():
            assert torch.equal(got[k], v), k
    assert abs(expected["model.layers.0.mlp.experts.gate_up_proj"].std().item() - 0.02) < 0.002  # not left empty


def test_directory_export_of_packed_expert_weights_is_refused(results) -> None:
    """tp=2 holds each packed ``[gate; up]`` expert weight as two slices per rank, which the directory writer
    (one slice per rank and tensor) cannot take: every rank gets one message pointing to the single-file export
    (instead of DCP's 'overlapping chunks' failure), and the group goes on."""
    for r in results["2"]:
        message = r["mixtral", "tp2"]["export_error"]
        assert message and re.search(r"gate_up_proj as 2 separate slices.*\.safetensors", message), message


MESSAGES = {"missing-key": r"missing: model\.norm\.weight", "extra-key": r"unexpected: model\.layers\.0\.mlp\.gate_pr",
            "wrong-shape": r"wrong shape: model\.norm\.weight \(checkpoint \[65\], model \[64\]\)",
            "wrong-dtype": r"wrong dtype: model\.norm\.weight \(checkpoint int64, model float32\)",
            "missing-shard": r"names 1 shard file\(s\) that are not in .*: model-00002-of-000\d\d\.safetensors",
            "truncated-shard": r"model-00003-of-000\d\d\.safetensors is truncated",
            "no-such-path": r"does not exist"}


def test_bad_checkpoints_end_in_one_message_on_every_rank(results) -> None:
    for r in results["2"]:
        assert set(r["bad"]) == set(MESSAGES)
        for case, pattern in MESSAGES.items():
            assert re.search(pattern, r["bad"][case]), (case, r["bad"][case])
            assert "\n" not in r["bad"][case]


@pytest.mark.parametrize("case", ["truncated-shard"])
def test_bad_checkpoint_through_plait_train(root, tmp_path, monkeypatch, capsys, case) -> None:
    """``plait train --model.weights=BAD`` for 2 ranks: exit code 2, one line naming the problem, no traceback. The
    check runs in the launcher before any worker starts, so the CLI is called in this process (every case's
    message is checked on the ranks above)."""
    from plait.cli import main

    (tmp_path / "hfmodels.py").write_text("import transformers\n\ndef llama():\n    return transformers."
                                          f"LlamaForCausalLM(transformers.LlamaConfig(**{SMALL!r}))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = main(["train", "--parallel.nproc=2", "--model.factory=hfmodels:llama",
               f"--model.weights={root / 'bad' / case}", "--data.name=text", "--model.seq_len=16",
               "--parallel.zero=3", "--train.steps=2", "--train.micro_batch_size=4", "--train.global_batch_size=8",
               f"--run.dir={tmp_path / 'run'}", "--observe.progress=false"])
    err = capsys.readouterr().err
    assert rc == 2, err[-2000:]
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-2000:]
    assert re.search(MESSAGES[case], err), err[-2000:]
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("metrics.jsonl"))  # nothing ran


def test_setup_memory_per_rank(results) -> None:
    """Peak RSS over setup+load at zero=3, less the RSS before the model was built, as a fraction of the full
    model's fp32 bytes. Each rank holds 1/world of the weights, so at 2 ranks the shard alone is one half: the
    bound there is 0.6 (the issue's "below half" cannot hold with a half in the shard); at 4 ranks it is one
    third. The model built whole on every rank (no meta, no weights=) reaches at least 0.9 of it: the check can
    fail."""
    full = sum(v.numel() * 4 for v in build("llama", BIG, meta=True).state_dict().values())
    for world, bound in (("2", 0.6), ("4", 1 / 3)):
        for r in results[world]:
            plait_path, whole = r["memory"]
            assert plait_path < bound * full, (world, plait_path / full)
            assert whole > 0.9 * full, (world, whole / full)


def test_plait_train_from_weights_exports_a_directory(root, tmp_path) -> None:
    """``plait train --model.weights=CKPT`` (the model built on the meta device) trains at zero=3 on 2 ranks and
    leaves ``RUN_DIR/model/``, which ``from_pretrained`` loads and ``weights=RUN_DIR`` resolves to."""
    from plait.checkpoint.hf import checkpoint_files

    (tmp_path / "hfmodels.py").write_text("import transformers\n\ndef llama():\n    return transformers."
                                          f"LlamaForCausalLM(transformers.LlamaConfig(**{SMALL!r}))\n")
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "plait.cli", "train", "--parallel.nproc=2", "--model.factory=hfmodels:llama",
           f"--model.weights={root / 'llama'}", "--data.name=text", "--model.seq_len=16", "--parallel.zero=3",
           "--train.steps=2", "--train.micro_batch_size=4", "--train.global_batch_size=8", "--train.eval_every=0",
           "--train.eval_sequences=8", "--optim.lr=1e-3", "--optim.warmup_steps=1", f"--run.dir={run}",
           "--observe.progress=false", "--observe.trackers=[]"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path)}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert checkpoint_files(run)[0] == run / "model"
    model, info = transformers.LlamaForCausalLM.from_pretrained(run / "model", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    start = transformers.LlamaForCausalLM.from_pretrained(root / "llama").state_dict()
    moved = _max_diff(model.state_dict(), start)
    assert 1e-4 < moved < 0.1  # started from the checkpoint (not a fresh init) and took two small steps
    # the setup memory's prediction is that of a meta-built model: nothing given or broadcast, the shard allocated
    summary = json.loads((run / "summary.json").read_text())
    for rank in summary["memory"]["setup"]["ranks"]:
        predicted = rank["predicted"]
        assert predicted["given"] == predicted["broadcast"] == predicted["allocated"] == 0
        assert predicted["peak"] == predicted["layout"] == pytest.approx(4 * summary["num_params"] / 2, abs=64)


def test_bf16_checkpoint_loads_into_fp32_weights(tmp_path) -> None:
    """A bf16 checkpoint (``save_pretrained`` after ``.to(torch.bfloat16)``) loads into a meta-built fp32 model in
    one process: every weight equals the bf16 value converted to fp32, and the non-persistent rotary buffers are
    those of a model built normally."""
    torch.manual_seed(0)
    build("llama").to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    ref = getattr(transformers, FAMILIES["llama"][0]).from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    p = _plait({}, GLOBAL, str(tmp_path / "run"))
    model, _ = p.setup(build("llama", meta=True), loss_fn="causal_lm", weights=str(tmp_path / "bf16"))
    p.close()
    for k, v in ref.state_dict().items():
        got = model.state_dict()[k]
        assert got.dtype == torch.float32 and torch.equal(got, v.float()), k
    assert torch.equal(model.model.rotary_emb.inv_freq, build("llama").model.rotary_emb.inv_freq)


def _export(model: torch.nn.Module, out: Path, max_shard_bytes: int) -> dict[str, torch.Tensor]:
    """``Plait.export(model, out)`` in one process; the model's state as exported."""
    p = _plait({}, GLOBAL, str(out) + "-run")
    model, _ = p.setup(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    p.export(model, out, max_shard_bytes=max_shard_bytes)
    p.close()
    return state


def test_export_names_its_files_as_save_pretrained_does(tmp_path) -> None:
    """``Plait.export(model, DIR)`` in one process: a model that fits one file is ``model.safetensors`` alone (no
    index), beside ``config.json``, as ``save_pretrained`` writes it; one cut into several (``max_shard_bytes``)
    is ``model-0000k-of-0000n.safetensors`` named in ``model.safetensors.index.json``. Both load with
    ``from_pretrained`` (no missing or unexpected key, the same weights) and with plait's reader. A model with a
    tensor that is not floating point (BatchNorm's step counter, which torch's consolidation leaves out) has it
    in those files too, not in one more."""
    from plait.checkpoint.hf import read_weights

    torch.manual_seed(0)
    build("llama").save_pretrained(tmp_path / "reference")
    assert {p.name for p in (tmp_path / "reference").glob("model*")} == {"model.safetensors"}
    for name, max_bytes in (("one", 1 << 30), ("several", 60_000)):
        torch.manual_seed(0)
        state = _export(build("llama"), tmp_path / name, max_bytes)
        shards = _exported_files(tmp_path / name)
        assert shards == ["model.safetensors"] if name == "one" else len(shards) >= 3
        model, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / name, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
        assert _max_diff(model.state_dict(), state) == 0 and _max_diff(read_weights(tmp_path / name), state) == 0

    for name, max_bytes in (("bn-one", 1 << 30), ("bn-several", 200)):
        torch.manual_seed(0)
        state = _export(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)),
                        tmp_path / name, max_bytes)
        files = {p.name for p in (tmp_path / name).iterdir()}
        if name == "bn-one":
            assert files == {"model.safetensors"}, files
        else:
            assert "model.safetensors.index.json" in files and len(files) >= 3, files
            assert all(re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json", f)
                       for f in files), files
        got = read_weights(tmp_path / name)
        assert got.keys() == state.keys() and all(torch.equal(got[k], v) for k, v in state.items())
