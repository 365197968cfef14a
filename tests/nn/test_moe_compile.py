"""Expert parallelism with no host read: ``train.compile`` at ``parallel.ep=2`` and the host syncs of an MoE layer.

One spawn of 2 gloo ranks:

* plait's GPT with an MoE block in each of its 2 blocks (4 experts, top-2, z-loss on), ep=2, trained 4 steps
  eagerly, 4 steps with ``train.compile=true`` (the whole model as one region) and 4 with ``train.compile=blocks``
  (each block compiled in place), from the same weights and data through ``plait.Plait``.
  Compiled equals eager: losses within 1e-5 and parameters within 1e-4 after the 4 AdamW steps at lr 1e-3
  (inductor reorders float32 sums; measured 2.4e-7 and 4.2e-6), as tests/parallel/test_compile.py allows for dense
  layouts. Graph count (dynamo's ``unique_graphs``, per run: the model with its loss; or the block, shared by
  both blocks, and the loss): the same after step 4 as after step 1, with no recompilation and no graph break,
  whatever the routing does.
* one ``plait.nn.MoE`` layer sharded over ep=2, forward and backward, dropless and with a capacity factor, for
  each experts implementation: no operation that makes a GPU wait for the host is dispatched (``.item()``,
  ``.tolist()``, ``nonzero``, indexing by a boolean mask, ``bincount``...; a dispatch mode records every operator
  plait's code issues). torch's profiler sees ``aten::_local_scalar_dense`` only inside two CPU kernels, which run
  on the device on CUDA: ``_grouped_mm``'s CPU implementation reading its group offsets and ``_assert_async``'s CPU
  implementation (the ep group's shape check). The loop over experts, which sizes its matmuls by a host read,
  is the control: the same check sees its reads.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import run_ranks

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="torch.compile's inductor backend needs a C++ compiler on CPU")

STEPS, B, LR = 4, 2, 1e-3
GPT = ["--model.n_layer=2", "--model.d_model=32", "--model.n_head=2", "--model.seq_len=16", "--model.vocab_size=64",
       "--model.dropout=0.0", "--moe.num_experts=4", "--moe.top_k=2", "--moe.z_loss_coef=0.001", "--moe.every=1",
       "--parallel.nproc=2", "--parallel.ep=2", f"--train.global_batch_size={2 * B}", f"--train.micro_batch_size={B}",
       "--optim.grad_clip=0", "--observe.progress=false", "--observe.trackers=[]"]
# operators that make the host wait for a CUDA device (a scalar read, or an output sized by the data)
SYNC_OPS = ("_local_scalar_dense", "item", "nonzero", "masked_select", "bincount", "unique", "_unique2",
            "repeat_interleave.Tensor", "equal", "is_nonzero")
DEVICE_KERNELS = {"aten::_grouped_mm", "aten::_assert_async"}
# train.compile=true picks the whole model as one region at ep=2 over plait's reducer; "blocks" is the unit that
# FSDP2, tensor and pipeline parallelism compile
UNITS = ("true", "blocks")


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (2 * B, 16), generator=torch.Generator().manual_seed(2000 + step))


def _train(rank: int, root: str, compile_: str) -> dict:
    import torch._dynamo
    import torch._dynamo.utils as dynamo_utils

    import plait
    from plait.config import load_config
    from plait.models.tiny import seeded_gpt

    torch._dynamo.reset()  # each run counts its own graphs (the units share nn.Module._call_impl's code)
    dynamo_utils.counters.clear()
    cfg = load_config(overrides=GPT + [f"--run.dir={root}/c-{compile_}", f"--train.compile={compile_}"])
    p = plait.Plait(cfg)
    model, _ = p.setup(seeded_gpt(cfg.model, 0, cfg.moe), loss_fn="causal_lm",
                       optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=LR))
    losses, graphs = [], []
    for s in range(STEPS):
        p.forward_backward(model, _batch(s)[rank * B:(rank + 1) * B])
        losses.append(p.step().global_loss)
        graphs.append(dynamo_utils.counters["stats"]["unique_graphs"])
    state = {k: v.detach().clone() for k, v in p.full_state_dict(model).items()}
    p.close()
    counters = dynamo_utils.counters
    return {"losses": losses, "state": state, "graphs": graphs, "breaks": sum(counters["graph_break"].values()),
            "recompiles": sum(counters["recompiles"].values())}


def _syncs(rank: int) -> dict:
    """Per case: the sync operators the layer dispatched, and the profiler's scalar reads by parent kernel."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile
    from torch.utils._python_dispatch import TorchDispatchMode

    from plait.nn import MoE
    from plait.parallel.expert.dispatch import shard_experts

    class Record(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func).removeprefix("aten.")
            masked = name == "index.Tensor" and any(getattr(i, "dtype", None) == torch.bool for i in args[1])
            if name.split(".")[0] in SYNC_OPS or name in SYNC_OPS or masked:  # boolean indexing: a data-sized output
                self.seen.append(name)
            return func(*args, **(kwargs or {}))

    out = {}
    for impl in ("grouped", "padded", "loop"):
        for capacity in (0.0, 1.0) if impl != "loop" else (0.0,):
            torch.manual_seed(0)
            layer = MoE(16, 32, 4, top_k=2, z_loss_coef=0.01, capacity_factor=capacity, experts=impl)
            shard_experts(layer, 2, rank, dist.group.WORLD)
            x = torch.randn(2, 8, 16, requires_grad=True)
            layer(x).sum().backward()  # warm-up
            tolist = torch.Tensor.tolist  # a host read the dispatcher does not see: recorded by hand
            with Record() as rec:
                torch.Tensor.tolist = lambda t, f=tolist: rec.seen.append("tolist") or f(t)  # type: ignore
                try:
                    layer(x).sum().backward()
                finally:
                    torch.Tensor.tolist = tolist  # type: ignore[method-assign]
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                layer(x).sum().backward()
            parents = sorted({e.cpu_parent.name if e.cpu_parent is not None else "" for e in prof.events()
                              if e.name == "aten::_local_scalar_dense" and e.cpu_parent is not None
                              and e.cpu_parent.name != "aten::item"}
                             | {e.cpu_parent.cpu_parent.name for e in prof.events()
                                if e.name == "aten::_local_scalar_dense" and e.cpu_parent is not None
                                and e.cpu_parent.name == "aten::item" and e.cpu_parent.cpu_parent is not None})
            out[f"{impl}-{capacity}"] = {"dispatched": rec.seen, "profiled": parents}
    return out


def _worker(rank: int, world: int, root: str) -> dict:
    out = {unit: _train(rank, root, unit) for unit in ("false", *UNITS)}
    return {**out, "syncs": _syncs(rank)}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(_worker, 2, str(tmp_path_factory.mktemp("moecompile")), timeout=600)


@pytest.mark.parametrize("unit", UNITS)
def test_compiled_expert_parallel_training_equals_eager(results, unit) -> None:
    for r in results:
        eager, compiled = r["false"], r[unit]
        assert compiled["losses"] == pytest.approx(eager["losses"], abs=1e-5)
        diff = max(float((compiled["state"][k] - v).abs().max()) for k, v in eager["state"].items())
        assert diff < 1e-4, (unit, diff)
        assert eager["graphs"] == [0] * STEPS  # eager traced nothing


@pytest.mark.parametrize("unit", UNITS)
def test_graph_count_stops_growing_after_warm_up(results, unit) -> None:
    for r in results:
        c = r[unit]
        assert c["graphs"][0] > 0 and c["graphs"] == [c["graphs"][0]] * STEPS, (unit, c["graphs"])
        assert c["breaks"] == 0 and c["recompiles"] == 0, (unit, c["breaks"], c["recompiles"])


def test_moe_layer_at_ep2_dispatches_no_host_sync(results) -> None:
    for r in results:
        syncs = dict(r["syncs"])
        assert "tolist" in syncs.pop("loop-0.0")["dispatched"]  # the control: the loop reads its counts
        for case, got in syncs.items():
            assert got["dispatched"] == [], (case, got["dispatched"])
            assert set(got["profiled"]) <= DEVICE_KERNELS, (case, got["profiled"])
