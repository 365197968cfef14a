"""Collectives torch issues on plait's behalf (c10d, functional collectives, DTensor, FSDP2, tensor
and pipeline parallelism) are counted in ``comm_bytes`` with the same ring model as plait's ``Comm``,
and plait's own collectives are not counted twice. Byte counts are exact integers here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_ranks

from plait.config import load_config
from plait.recipes import validate_config as validate


def _unit(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from plait.comm.accounting import TorchCollectiveCounter
    from plait.comm.collectives import Comm, CommStats

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    stats = CommStats()
    with TorchCollectiveCounter(stats):
        dist.all_reduce(torch.ones(1000))  # 4000 bytes, ring: 2 (n-1)/n of them
    out["all_reduce"] = stats.bytes_sent
    stats.reset()
    with TorchCollectiveCounter(stats):
        funcol.all_gather_tensor(torch.ones(100), 0, mesh).wait()  # 400 bytes sent to each peer
    out["all_gather"] = stats.bytes_sent
    stats.reset()
    with TorchCollectiveCounter(stats):
        dist.reduce_scatter_tensor(torch.empty(100), torch.ones(100 * world))
    out["reduce_scatter"] = stats.bytes_sent
    stats.reset()
    with TorchCollectiveCounter(stats):
        t = torch.ones(10)
        dist.send(t, 1) if rank == 0 else dist.recv(t, 0)
    out["send_recv"] = stats.bytes_sent
    stats.reset()
    x = distribute_tensor(torch.ones(8 * world, 4), mesh, [Shard(0)])
    with TorchCollectiveCounter(stats):
        x.redistribute(mesh, [Replicate()]).to_local()  # DTensor desugars into an all-gather of 8x4
    out["dtensor"] = stats.bytes_sent
    stats.reset()
    comm = Comm()
    with TorchCollectiveCounter(stats):
        comm.all_reduce_sum(torch.ones(1000), None)
    out["plait_comm"] = (stats.bytes_sent, comm.stats.bytes_sent)
    out["calls"] = stats.calls
    return out


def test_counter_counts_torch_collectives_once_with_the_ring_model(two_ranks) -> None:
    world = 2
    r0, r1 = (r["unit"] for r in two_ranks)
    for r in (r0, r1):
        assert r["all_reduce"] == 2 * (world - 1) * 4000 // world
        assert r["all_gather"] == (world - 1) * 400
        assert r["reduce_scatter"] == (world - 1) * 400 * world // world
        assert r["dtensor"] == (world - 1) * 8 * 4 * 4
        # plait's Comm counts its own all-reduce; the counter around it does not add it again.
        assert r["plait_comm"] == (0, 4000) and r["calls"] == 0
    assert (r0["send_recv"], r1["send_recv"]) == (40, 0)


BASE = [
    "--model.n_layer=2", "--model.d_model=32", "--model.n_head=4", "--model.seq_len=16",
    "--train.steps=2", "--train.global_batch_size=4", "--train.log_every=1",
    "--train.eval_every=0", "--train.eval_sequences=4", "--optim.grad_clip=1.0", "--checkpoint.every=0",
    "--observe.progress=false", "--observe.trackers=[]", "--observe.count_torch_collectives=every_step",
]


def _train(rank: int, world: int, root: str, extra: list[str]) -> dict:
    from plait.recipes import build_trainer

    cfg = validate(load_config(overrides=BASE + extra + [f"--run.dir={root}"]), world)
    Path(root).mkdir(parents=True, exist_ok=True)
    trainer = build_trainer(cfg)
    trainer.fit()
    n_params = sum(p.numel() for p in trainer.layout.model.parameters())
    rows = [json.loads(x) for x in Path(root, "metrics.jsonl").read_text().splitlines()]
    return {"bytes": [r["comm_bytes"] for r in rows if "comm_bytes" in r], "params": n_params}


def _train_all(rank: int, world: int, root: str, variants: dict[str, list[str]]) -> dict:
    return {name: _train(rank, world, f"{root}/{name}", extra) for name, extra in variants.items()}


VARIANTS = {
    # ZeRO-3, parameters kept through backward: all-gather P/2 + reduce-scatter P/2 floats.
    "fsdp": ["--train.micro_batch_size=2", "--parallel.zero=3", "--parallel.reshard_after_forward=false"],
    # Megatron: per block 2 all-reduces forward + 2 backward of (B, T, d); + embedding fwd, head bwd.
    "tp": ["--train.micro_batch_size=4", "--parallel.tp=2"],
    # 2 stages, 2 micro-batches of (2, T, d): one send per micro-batch each way, + the tied table's
    # gradient all-reduced between the first and last stage.
    "pp": ["--train.micro_batch_size=4", "--parallel.pp=2", "--parallel.microbatches=2"],
    # The default counts the first step only and adds its figure to the later ones.
    "tp_first_step": ["--train.micro_batch_size=4", "--parallel.tp=2",
                      "--observe.count_torch_collectives=first_step"],
    "tp_off": ["--train.micro_batch_size=4", "--parallel.tp=2", "--observe.count_torch_collectives=off"],
}


def _both(rank: int, world: int, root: str) -> dict:
    """The counter's unit checks, then the trainer runs, in one spawn of 2 ranks (the unit checks first, in a
    process that has run no trainer yet, as they did in a spawn of their own)."""
    return {"unit": _unit(rank, world), "trainer": _train_all(rank, world, root, VARIANTS)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(_both, 2, str(tmp_path_factory.mktemp("accounting")), timeout=300)


def test_trainer_counts_fsdp_tensor_and_pipeline_collectives(two_ranks) -> None:
    """Per step and rank, fp32, n=2 ranks (ring factors: all-reduce 1x, reduce-scatter and all-gather
    1/2x of the full buffer). Lower bounds are the layout's own traffic; the slack above them is the
    scalar all-reduces (clip norm, loss-parallel statistics) and FSDP's dim-0 padding."""
    res = [r["trainer"] for r in two_ranks]
    d, t, L, vocab, B = 32, 16, 2, 256, 4
    for r in res:
        p_bytes = 4 * r["fsdp"]["params"]
        for got in r["fsdp"]["bytes"]:
            assert p_bytes <= got <= p_bytes + 512, (got, p_bytes)
        act = B * t * d * 4
        for got in r["tp"]["bytes"]:  # before q, k, v shared one input all-reduce this was + 4 act
            assert (4 * L + 2) * act <= got <= (4 * L + 2) * act + 1024, (got, act)
        mb_act = (B // 2) * t * d * 4
        for got in r["pp"]["bytes"]:
            assert 2 * mb_act + vocab * d * 4 <= got <= 2 * mb_act + vocab * d * 4 + 512, got
        assert r["tp_first_step"]["bytes"] == [r["tp"]["bytes"][0]] * 2
        assert max(r["tp_off"]["bytes"]) < 64  # only plait's own scalar all-reduces
