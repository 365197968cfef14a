"""Parameter server (``parallel.mode = "ps"``): consistency rules alone, then whole runs on gloo ranks.

The rules (``plait.ps.state.ShardState``) are checked in this process against hand computations:
DC-ASGD's compensation, backup workers' drops, max-staleness rejection and staleness scaling, the SSP
pull rule, exact sums. Two spawns then run several configurations each through ``plait.Plait``:

- world 3 (workers 0, 1; server 2): sync against single-process training on the same global batch
  (losses and parameters after 6 steps: equal to 1e-6, observed bit for bit: the server averages in
  worker order and clips with torch's formula), backup with 0 backup workers and ssp with staleness 0
  against sync (1e-6, observed exact),
  exact sums through the transport in sync/async/ssp/dc, a 3x slower worker in async (converges,
  staleness recorded, max-staleness rejections counted), ssp (the read gap never exceeds s), backup
  (exactly the stale gradients dropped and counted), and checkpoints (sync resume equals the
  uninterrupted run exactly; the PS checkpoint loads into plain data parallelism, and that run's
  checkpoint back into a PS run);
- world 4: 3 workers + 1 server in sync against plait's all-reduce data parallelism over 3 ranks (the
  same spawn's ranks 0-2 regroup; same global batch and weights; 1e-5), two servers against the
  single-process reference, async and dc (lambda 0) with one
  worker and three servers against single-process training, a transformers Llama against one process,
  and ``plait train``'s worker function on plait's GPT (async, two servers) and CNN (backup, one server);
  checkpoints written by the servers: each server's file holds exactly its shard's pieces, a resume
  with 1 -> 2 and 2 -> 1 servers equals the uninterrupted run (1e-5), the GPT's checkpoint loads into
  one process and equals its export, which ``plait sample`` reads.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import run_ranks

from plait.config import Config, ConfigError, from_sections
from plait.ps.checkpoint import flat_boxes, param_names
from plait.ps.state import ShardState, dc_compensate
from plait.recipes import validate_config as validate
from plait.runtime.spawn import SpawnError

STEPS = 6
BASE = {"train": {"global_batch_size": 8, "micro_batch_size": 4},
        "optim": {"lr": 0.05, "grad_clip": 0.5, "warmup_steps": 0}}


# -- the rules alone -----------------------------------------------------------------------------------
def _cfg(**kw: object) -> SimpleNamespace:
    base = dict(mode="async", staleness=0, backup_workers=0, dc_lambda=0.0, dc_adaptive=False, max_staleness=-1,
                staleness_scaling=0.0)
    return SimpleNamespace(**{**base, **kw})


def _state(w0: list[float], workers: int, **kw: object) -> ShardState:
    from plait.ps.shard import Segment

    w = torch.tensor(w0, dtype=torch.float64)
    return ShardState(w, [Segment(0, 0, len(w0))], torch.optim.SGD, {"lr": 1.0}, [{"lr": 1.0}], workers, _cfg(**kw),
                      grad_clip=0.0)


def test_dc_compensation_by_hand() -> None:
    s = _state([1.0, 2.0], 2, mode="dc", dc_lambda=0.5)
    s.pulled(0)  # worker 0 reads w = (1, 2)
    s.push(1, 0, torch.tensor([0.5, -1.0], dtype=torch.float64), 1.25, [1.0])  # w -> (0.5, 3)
    s.push(0, 0, torch.tensor([2.0, 1.0], dtype=torch.float64), 5.0, [1.0])
    # g + lambda g^2 (w - w_read) = (2 + 0.5*4*(0.5-1), 1 + 0.5*1*(3-2)) = (1, 1.5); SGD lr 1: w -= that
    assert s.w.tolist() == [0.5 - 1.0, 3.0 - 1.5]
    assert s.staleness == {0: 1, 1: 1}
    # adaptive: lambda / sqrt(ms + 1e-7), ms = 0.05 g^2 from zero
    g, w, r = torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([1.0])
    ms = 0.05 * g * g
    want = 2.0 + 0.5 / math.sqrt(0.2 + 1e-7) * 4.0 * (0.5 - 1.0)
    assert dc_compensate(g, w, r, 0.5, ms).item() == pytest.approx(want, rel=1e-6)
    assert dc_compensate(g, w, r, 0.0).item() == 2.0  # lambda 0 is plain async


def test_backup_drops_exactly_the_stale() -> None:
    s = _state([0.0], 3, mode="backup", backup_workers=1)
    g = torch.tensor([1.0], dtype=torch.float64)
    assert s.push(0, 0, g, 1.0, [1.0]) == "pending"
    assert s.push(2, 0, 2 * g, 4.0, [1.0]) == "applied"  # N - b = 2 gradients of version 0
    assert s.push(1, 0, 4 * g, 16.0, [1.0]) == "dropped"  # computed on version 0, the server is at 1
    assert (s.version, s.dropped, s.applied, s.w.item()) == (1, 1, 2, -1.5)
    assert s.may_pull(0) and s.may_pull(1)  # worker 0's version completed; worker 1's gradient was dropped
    s.finish(0)
    s.finish(2)
    assert s.push(1, 1, g, 1.0, [1.0]) == "applied"  # alone now: versions complete without the finished


def test_max_staleness_and_scaling() -> None:
    s = _state([0.0], 2, max_staleness=1, staleness_scaling=1.0)
    g = torch.tensor([1.0], dtype=torch.float64)
    for _ in range(3):
        s.push(0, s.version, g, 1.0, [1.0])  # staleness 0: lr 1
    assert s.push(1, 1, g, 1.0, [1.0]) == "rejected"  # version 3 - 1 = 2 > 1
    assert s.push(1, 2, g, 1.0, [1.0]) == "applied"  # staleness 1: lr / (1 + 1)
    assert s.w.item() == -3.5 and (s.rejected, s.applied) == (1, 4)
    assert s.worker_max_staleness == [0, 1]


def test_ssp_clocks_and_pull_rule() -> None:
    """SSP is clock-aggregated: clock c's gradients of every worker, averaged, make version c + 1; a worker
    that pushed c gradients reads only version >= c - s."""
    s = _state([0.0], 3, mode="ssp", staleness=1)
    g = torch.tensor([1.0], dtype=torch.float64)
    assert s.push(0, 0, g, 1.0, [1.0]) == "pending"  # worker 0's clock 0
    assert s.may_pull(0)  # version 0 >= 1 - 1
    assert s.push(0, 0, g, 1.0, [1.0]) == "pending"  # its clock 1, computed on version 0
    assert not s.may_pull(0)  # needs version >= 2 - 1: clock 0 of every worker
    assert s.push(1, 0, 2 * g, 4.0, [1.0]) == "pending"
    assert not s.may_pull(0) and s.version == 0
    assert s.push(2, 0, 4 * g, 16.0, [1.0]) == "applied"  # clock 0 complete: w -= (1 + 2 + 4) / 3
    assert s.version == 1 and s.w.item() == pytest.approx(-7 / 3, abs=1e-15)
    assert s.may_pull(0) and not s.by_clock.get(0)
    s.finish(2)  # a finished worker holds no clock back
    assert s.push(1, 1, 2 * g, 4.0, [1.0]) == "applied"  # clock 1: worker 0's (staleness 1) and worker 1's
    assert s.version == 2 and s.w.item() == pytest.approx(-7 / 3 - 1.5, abs=1e-15)
    assert s.staleness == {0: 4, 1: 1} and s.worker_max_staleness == [1, 0, 0]
    # staleness scaling divides a clock's lr by 1 + a * (mean staleness); max_staleness leaves a gradient out
    s = _state([0.0], 2, mode="ssp", staleness=1, staleness_scaling=1.0)
    s.push(0, 0, g, 1.0, [1.0])
    s.push(1, 0, g, 1.0, [1.0])  # clock 0: w = -1, version 1
    s.push(0, 1, g, 1.0, [1.0])
    s.push(1, 0, 3 * g, 9.0, [1.0])  # clock 1: mean 2, staleness 0 and 1: lr 1 / (1 + 0.5)
    assert s.w.item() == pytest.approx(-1 - 2 / 1.5, abs=1e-15)
    s = _state([0.0], 2, mode="ssp", staleness=1, max_staleness=0)
    s.push(0, 0, g, 1.0, [1.0])
    s.push(1, 0, g, 1.0, [1.0])
    s.push(0, 1, 3 * g, 9.0, [1.0])
    s.push(1, 0, g, 1.0, [1.0])  # staleness 1 > 0: left out of clock 1's mean
    assert s.w.item() == -4.0 and (s.rejected, s.applied) == (1, 3)


def test_ssp_with_staleness_0_is_sync_by_hand() -> None:
    """AdamW, three workers, four clocks pushed in scrambled order: ssp s = 0 applies what sync applies."""
    def run(mode: str) -> torch.Tensor:
        from plait.ps.shard import Segment

        w = torch.linspace(-1, 1, 6, dtype=torch.float64)
        st = ShardState(w, [Segment(0, 0, 6)], torch.optim.AdamW, {"lr": 0.1}, [{"lr": 0.1}], 3,
                        _cfg(mode=mode, staleness=0), grad_clip=0.5)
        gen = torch.Generator().manual_seed(3)
        for clock in range(4):
            grads = [torch.randn(6, generator=gen, dtype=torch.float64) for _ in range(3)]
            for k in (2, 0, 1):
                st.push(k, st.version, grads[k], float(grads[k].square().sum()), [0.1])
            assert st.version == clock + 1 and all(st.may_pull(k) for k in range(3))
        return st.w

    torch.testing.assert_close(run("ssp"), run("sync"), atol=0.0, rtol=0.0)


@pytest.mark.parametrize("mode", ["sync", "ssp", "async"])
def test_exact_sums(mode: str) -> None:
    s = _state([0.0] * 4, 3, mode=mode)
    for k in range(3):
        s.push(k, 0, torch.full((4,), 2.0 ** k, dtype=torch.float64), 1.0, [1.0])
    assert s.w.tolist() == ([-7.0] * 4 if mode == "async" else [-7.0 / 3] * 4)


def test_flat_boxes_cover_a_row_major_range() -> None:
    """Every range ``[a, b)`` of small tensors: the boxes are contiguous runs of the range, in order, and cover
    it exactly, at most ``2 * ndim - 1`` of them (what a server writes of a tensor its shard cuts)."""
    for shape in [(), (5,), (3, 4), (2, 3, 4), (1, 1, 3), (4, 1, 2)]:
        n = math.prod(shape)
        ids = torch.arange(n).reshape(shape)
        for a in range(n + 1):
            for b in range(a, n + 1):
                boxes, got = flat_boxes(shape, a, b), []
                for offsets, sizes, start in boxes:
                    box = ids[tuple(slice(o, o + k) for o, k in zip(offsets, sizes, strict=True))].reshape(-1)
                    assert box.tolist() == list(range(a + start, a + start + box.numel()))
                    got += box.tolist()
                assert got == list(range(a, b)) and len(boxes) <= max(1, 2 * len(shape) - 1)


def test_bad_config() -> None:
    def check(sections: dict, world: int, match: str) -> None:
        with pytest.raises(ConfigError, match=match):
            validate(from_sections({"parallel": {"mode": "ps"}, **sections}, Config()), world, model_checks=False)

    check({"ps": {"servers": 3}}, 3, r"ps.servers=3 must be between 1 and world size - 1 = 2")
    check({}, 1, r"at least 2 ranks")
    check({"ps": {"mode": "ssp", "staleness": -1}}, 3, r"ps.staleness must be 0 or more")
    check({"ps": {"mode": "backup", "backup_workers": 2}}, 3, r"ps.backup_workers=2 must be between 0 and workers - 1")
    check({"parallel": {"mode": "ps", "tp": 2}}, 3, r"does not combine with parallel.tp=2.*it supports")
    check({"parallel": {"mode": "ps", "zero": 2}}, 3, r"does not combine with parallel.zero=2")
    check({"ps": {"mode": "sync", "pull_every": 2}}, 3, r"ps.pull_every=2 applies to ps.mode=async or dc")
    check({"checkpoint": {"async_save": True}}, 3, r"checkpoint.async=true does not combine with parallel.mode=ps")
    cfg = validate(from_sections({"parallel": {"mode": "ps"}, "ps": {"servers": 2}, "train": {
        "global_batch_size": 8, "micro_batch_size": 2}}, Config()), 4, model_checks=False)
    assert cfg.parallel.dp == 2 and cfg.grad_accum == 2


# -- whole runs ----------------------------------------------------------------------------------------
class _Sleepy(torch.nn.Module):
    """The small model with 4 ms of "compute" per forward, so ``fault.slow_factor`` has time to scale."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(0.004)
        return self.inner(x)


def _model(sleepy: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return _Sleepy(m) if sleepy else m


def _data() -> torch.utils.data.Dataset:
    g = torch.Generator().manual_seed(1)
    x, teacher = torch.randn(512, 8, generator=g), torch.randn(8, 4, generator=g)
    return torch.utils.data.TensorDataset(x, 2 * torch.tanh(x @ teacher))


def _hf_model() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32))


def _hf_data() -> list[dict]:
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, 256, (256, 16), generator=g)
    return [{"input_ids": row, "labels": row} for row in x]


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


def _train(sections: dict, run_dir: str, steps: int = STEPS, save_at: int = 0, load: str = "",
           sleepy: bool = False, hf: bool = False, load_data: bool = True) -> dict:
    """Train ``steps`` optimizer steps with the keep-your-loop API; a server returns its statistics and
    final shard, a worker its losses, final weights and (rank 0) the servers' merged statistics."""
    import plait
    from plait.ps import ServerDone

    p = plait.Plait(run={"dir": run_dir}, observe={"progress": False, "trackers": []}, **sections)
    try:
        model, opt = p.setup(_hf_model() if hf else _model(sleepy), loss_fn="hf" if hf else _mse)
    except ServerDone as e:
        st, flat = p.layout.server.state, p.layout.flat
        names = [name for _, name in param_names(p.layout.model, flat)]
        return {"server": e.stats, "w": st.w.clone(), "events": list(st.events), "bounds": flat.bounds,
                "order": [(n, tuple(q.shape)) for n, q in zip(names, flat.params, strict=True)]}
    loader = p.setup_dataloader(_hf_data() if hf else _data())
    if load:
        p.load(load, model=model, optimizer=opt, dataloader=loader if load_data else None)
    it, losses, last, saved = iter(loader), [], None, None
    while p.steps < steps:
        batch = next(it)
        p.forward_backward(model, batch)
        info = p.step()
        if info is not None:
            losses.append(info.global_loss)
            last = info.ps
            if info.step == save_at:
                p.save(f"{run_dir}/ckpt", model=model, optimizer=opt, dataloader=loader)
                saved = {k: v.clone() for k, v in p.full_state_dict(model).items()}
    sd = p.full_state_dict(model)
    out = {"losses": losses, "sd": sd, "last": last, "saved": saved}
    if p.config.parallel.mode == "ps":
        out["reads"] = list(p.layout.client.reads)
        out["stats"] = p.layout.server_stats() if p.rank == 0 else None
    p.close()
    return out


def _exact_sum(sections: dict, run_dir: str) -> dict:
    """Each worker pushes 2**rank in every element (SGD, lr 1, no clipping); the server's shard after one
    step from each worker is returned by the server rank."""
    import plait
    from plait.ps import ServerDone

    p = plait.Plait(run={"dir": run_dir}, observe={"progress": False, "trackers": []},
                    optim={"grad_clip": 0.0}, train={"global_batch_size": 2, "micro_batch_size": 1}, **sections)
    w = torch.nn.Linear(5, 1, bias=False)
    torch.nn.init.zeros_(w.weight)
    try:
        model, _ = p.setup(w, optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=1.0))
    except ServerDone:
        return {"w": p.layout.server.state.w.clone()}
    p.backward((model.weight * 2.0 ** p.rank).sum())
    p.step()
    p.close()
    return {}


def _world3(rank: int, world: int, tmp: str) -> dict:
    ps = {"parallel": {"mode": "ps"}}
    slow = {"fault": {"slow_rank": 1, "slow_factor": 3.0}}
    out = {}
    out["sync"] = _train({**BASE, **ps, "ps": {"mode": "sync"}}, f"{tmp}/sync")
    out["backup0"] = _train({**BASE, **ps, "ps": {"mode": "backup", "backup_workers": 0}}, f"{tmp}/backup0")
    out["ssp0"] = _train({**BASE, **ps, "ps": {"mode": "ssp", "staleness": 0}}, f"{tmp}/ssp0")
    for mode in ("sync", "async", "ssp", "dc"):
        out[f"sum_{mode}"] = _exact_sum({**ps, "ps": {"mode": mode, "dc_lambda": 0.0}}, f"{tmp}/sum_{mode}")
    long = {"train": {**BASE["train"], "eval_every": 0}, "optim": BASE["optim"]}
    out["async_slow"] = _train({**long, **ps, **slow, "ps": {"mode": "async"}}, f"{tmp}/async", steps=30,
                               sleepy=True)
    out["async_reject"] = _train({**long, **ps, **slow, "ps": {"mode": "async", "max_staleness": 1}},
                                 f"{tmp}/reject", steps=30, sleepy=True)
    out["ssp"] = _train({**long, **ps, **slow, "ps": {"mode": "ssp", "staleness": 1}}, f"{tmp}/ssp", steps=12,
                        sleepy=True)
    out["backup"] = _train({**long, **ps, **slow, "ps": {"mode": "backup", "backup_workers": 1}}, f"{tmp}/backup",
                           steps=12, sleepy=True)
    # checkpoints: save at step 3 of 6, resume from it; then the PS checkpoint into plain data parallelism
    out["saving"] = _train({**BASE, **ps}, f"{tmp}/sync_saved", save_at=3)
    out["resumed"] = _train({**BASE, **ps}, f"{tmp}/resume", load=f"{tmp}/sync_saved/ckpt")
    out["dp_load"] = _load_into_dp(f"{tmp}/sync_saved/ckpt", f"{tmp}/dp")
    # and back: data parallelism's checkpoint (one chunk per tensor) read by the server into its shard
    out["from_dp"] = _train({**BASE, **ps}, f"{tmp}/from_dp", steps=3, load=f"{tmp}/dp/ckpt", load_data=False)
    # plait train's GPT: sync with one server on 3 ranks, then (last: the group is regrouped) dp=2 on ranks 0-1
    for name, optim in GPT_OPTIM.items():
        out[f"gpt_ps_{name}"] = _gpt_run(GPT_SYNC + optim + ["--ps.mode=sync"], f"{tmp}/gpt_ps_{name}")
    if _regroup(rank, 2):
        for name, optim in GPT_OPTIM.items():
            out[f"gpt_dp_{name}"] = _gpt_run(GPT_SYNC + optim + ["--parallel.mode=collective"], f"{tmp}/gpt_dp_{name}")
    return out


# plait's GPT as plait train runs it (the gpt recipe's defaults: warmup and cosine schedule, weight decay, clipping
# at 1.0), 4 layers, d=64, seq 32, global batch 8, fp32, deterministic, 5 steps; and with clipping and decay off
GPT_SYNC = ["--model.n_layer=4", "--model.d_model=64", "--model.n_head=4", "--model.seq_len=32", "--train.steps=5",
            "--train.global_batch_size=8", "--train.deterministic=true", "--train.eval_sequences=8",
            "--train.log_every=1", "--checkpoint.every=0"]
GPT_OPTIM = {"default": [], "plain": ["--optim.grad_clip=0", "--optim.weight_decay=0"]}


def _gpt_run(overrides: list[str], run_dir: str) -> dict | None:
    """``plait train``'s worker function; a worker returns its metrics and the exported weights (a server
    nothing)."""
    from plait.checkpoint.single_file import load_safetensors
    from plait.config import ModelConfig, MoeConfig
    from plait.models.gpt import GPT

    summary = _trainer(overrides, run_dir)
    if "ps_server" in summary:
        return None
    metrics = [json.loads(x) for x in Path(run_dir, "metrics.jsonl").read_text().splitlines()]

    model = GPT(ModelConfig(n_layer=4, d_model=64, n_head=4, seq_len=32), MoeConfig())
    load_safetensors(model, Path(run_dir))  # the run directory: its export in RUN_DIR/model/
    return {"steps": [(m["loss"], m["grad_norm"], m["lr"]) for m in metrics if "grad_norm" in m],
            "sd": {k: v.clone() for k, v in model.state_dict().items()}}


def _regroup(rank: int, world: int) -> bool:
    """Ranks ``0 .. world-1`` leave the spawn's group for a new gloo group of their own (True there); the
    others leave it and sit out (False)."""
    from datetime import timedelta

    import torch.distributed as dist

    from plait.runtime.spawn import free_port

    # Wait for every rank on the spawn's store first, with a bound of its own: a rank may still be finishing the
    # previous run (its evaluation and export) long after rank 0, longer than the group's collective timeout
    # on a loaded machine. The broadcast then starts on all ranks together.
    store = dist.distributed_c10d._get_default_store()
    store.set(f"regroup/{world}/{rank}", "1")
    store.wait([f"regroup/{world}/{r}" for r in range(dist.get_world_size())], timedelta(seconds=600))
    port = torch.tensor([free_port() if rank == 0 else 0])
    dist.broadcast(port, 0)
    dist.destroy_process_group()
    if rank >= world:
        return False
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{int(port)}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    return True


def _load_into_dp(ckpt: str, run_dir: str) -> dict:
    import plait

    p = plait.Plait(run={"dir": run_dir}, observe={"progress": False, "trackers": []},
                    train={"global_batch_size": 12, "micro_batch_size": 4})
    model, opt = p.setup(_model(), loss_fn=_mse)
    p.load(ckpt, model=model, optimizer=opt)
    sd = p.full_state_dict(model)
    p.save(f"{run_dir}/ckpt", model=model, optimizer=opt)
    p.close()
    return {"sd": sd, "steps": p.steps}


def _reference(tmp: str, steps: int = STEPS) -> dict:
    """plait in this process: one rank, the same global batch (accumulation 2 of the micro-batch)."""
    return _train(BASE, f"{tmp}/ref", steps=steps)


def _same(a: dict, b: dict, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)


@pytest.fixture(scope="module")
def world3(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], dict]:
    tmp = str(tmp_path_factory.mktemp("ps3"))
    return run_ranks(_world3, 3, tmp, timeout=240), _reference(tmp)


def test_sync_equals_single_process(world3: tuple) -> None:
    ranks, ref = world3
    for w in (0, 1):
        got = ranks[w]["sync"]
        assert got["losses"] == pytest.approx(ref["losses"], abs=1e-6)
        _same(got["sd"], ref["sd"])
    assert ref["losses"][-1] < ref["losses"][0]
    _same(ranks[0]["backup0"]["sd"], ranks[0]["sync"]["sd"], atol=0.0)  # backup with b = 0 is sync
    for w in (0, 1):  # ssp with s = 0 is sync (AdamW, clipping; tolerance 1e-6, observed bit for bit)
        _same(ranks[w]["ssp0"]["sd"], ranks[w]["sync"]["sd"], atol=1e-6)
        assert ranks[w]["ssp0"]["losses"] == pytest.approx(ranks[w]["sync"]["losses"], abs=1e-6)
    assert ranks[0]["ssp0"]["stats"]["staleness_histogram"] == {"0": 2 * STEPS}
    stats = ranks[0]["sync"]["stats"]
    assert stats["staleness_histogram"] == {"0": 2 * STEPS} and stats["versions"] == [STEPS]
    assert stats["push_bytes"] > 0 and stats["pull_bytes"] > 0
    last = ranks[0]["sync"]["last"]  # a step: one framed push (header + 212 float32), one framed reply
    assert (last["ps_push_bytes"], last["ps_pull_bytes"], last["ps_clock"]) == (128 + 4 * 212, 128 + 4 * 212, 6)
    assert ranks[1]["sync"]["last"]["ps_versions"] == [6]


def test_exact_sums_through_the_transport(world3: tuple) -> None:
    ranks, _ = world3
    for mode in ("sync", "ssp"):
        assert ranks[2][f"sum_{mode}"]["w"].tolist() == [-1.5] * 5, mode  # mean of 1 and 2
    for mode in ("async", "dc"):
        assert ranks[2][f"sum_{mode}"]["w"].tolist() == [-3.0] * 5, mode  # each applied: 1 + 2


def test_async_with_a_slow_worker(world3: tuple) -> None:
    ranks, _ = world3
    run = ranks[0]["async_slow"]
    assert sum(run["losses"][-5:]) / 5 < 0.8 * sum(run["losses"][:5]) / 5  # it converges
    # the server's own figures once every worker has finished (rank 0's view may miss the last pushes)
    stats = ranks[2]["async_slow"]["server"]
    assert stats["worker_max_staleness"][1] >= 2  # the slow worker's gradients arrive stale
    assert sum(stats["staleness_histogram"].values()) == stats["applied"] == 60
    assert stats["clocks"] == [30, 30]
    rej = ranks[2]["async_reject"]["server"]
    assert rej["rejected"] > 0 and rej["rejected"] + rej["applied"] == 60
    assert max(int(k) for k in rej["staleness_histogram"]) <= 1  # nothing staler than max_staleness applied
    events = ranks[2]["async_reject"]["events"]
    assert sum(1 for *_, o in events if o == "rejected") == rej["rejected"]
    assert all((at - v > 1) == (o == "rejected") for _, v, at, o in events)


def test_ssp_bound_never_violated(world3: tuple) -> None:
    ranks, _ = world3
    s = 1
    for w in (0, 1):
        for clock, min_clock, versions in ranks[w]["ssp"]["reads"]:
            assert clock - min_clock <= s
            # every update of clocks <= clock - s - 1 (of both workers, averaged) is in what was read
            assert versions[0] >= clock - s
    stats = ranks[2]["ssp"]["server"]
    assert stats["max_read_gap"] == s  # the slow worker made the bound bind
    assert stats["max_clock_gap"] <= s + 1  # right after a push, before that worker's next pull


def test_backup_drops_the_stale_and_counts_them(world3: tuple) -> None:
    ranks, _ = world3
    stats = ranks[2]["backup"]["server"]
    events = ranks[2]["backup"]["events"]
    assert stats["dropped"] > 0
    assert stats["dropped"] == sum(1 for *_, o in events if o == "dropped")
    assert all((v < at) == (o == "dropped") for _, v, at, o in events)
    assert stats["dropped"] + stats["applied"] == 24


def test_checkpoint_resume_and_load_into_data_parallel(world3: tuple) -> None:
    ranks, _ = world3
    for w in (0, 1):
        resumed, whole = ranks[w]["resumed"], ranks[w]["sync"]
        _same(resumed["sd"], whole["sd"], atol=0.0)
        assert resumed["losses"] == whole["losses"][3:]
    dp = ranks[0]["dp_load"]
    assert dp["steps"] == 3
    _same(dp["sd"], ranks[0]["saving"]["saved"], atol=0.0)  # the servers' weights at step 3
    for w in (0, 1):  # data parallelism's re-save of them, loaded by the server and pulled by each worker
        _same(ranks[w]["from_dp"]["sd"], dp["sd"], atol=0.0)
    _same(ranks[0]["saving"]["sd"], ranks[0]["sync"]["sd"], atol=0.0)  # saving changed nothing


def test_sync_equals_all_reduce_on_plaits_gpt(world3: tuple) -> None:
    """plait train's GPT, 5 steps, sync with one server on 3 ranks against all-reduce dp=2 on 2: per-step loss,
    gradient norm (the applied update's, the mean gradient's) and learning rate, and the parameters after 5
    steps, with the recipe's optimizer settings (warmup, weight decay, clipping at 1.0) and with clipping and
    weight decay off. Tolerance 1e-5 (the server sums the mean in float32 in worker order and clips with a
    float64 coefficient; observed: 2e-7)."""
    ranks, _ = world3
    for name in GPT_OPTIM:
        for w in (0, 1):
            ps, dp = ranks[w][f"gpt_ps_{name}"], ranks[w][f"gpt_dp_{name}"]
            assert len(ps["steps"]) == len(dp["steps"]) == 5
            for (l1, n1, lr1), (l2, n2, lr2) in zip(ps["steps"], dp["steps"], strict=True):
                assert (l1, n1, lr1) == pytest.approx((l2, n2, lr2), rel=1e-5, abs=1e-6), name
            _same(ps["sd"], dp["sd"], atol=1e-5)
        assert ranks[0][f"gpt_dp_{name}"]["steps"][0][2] < ranks[0][f"gpt_dp_{name}"]["steps"][1][2]  # warming up
    assert ranks[0]["gpt_dp_default"]["steps"][0][1] > 1.0  # the first step was clipped in the default run
    assert ranks[2]["gpt_ps_default"] is None


def _trainer(overrides: list[str], run_dir: str) -> dict:
    """``plait train``'s worker function (plait.recipes.build_trainer) in this rank; a server returns its figures."""
    from plait.recipes import load_recipe_config, train

    base = ["--parallel.mode=ps", "--train.eval_every=0", "--train.eval_sequences=16", "--train.log_every=2",
            "--checkpoint.every=2", "--observe.progress=false", "--observe.trackers=[]"]
    return train(load_recipe_config(None, base + overrides), __import__("pathlib").Path(run_dir))


def _world4(rank: int, world: int, tmp: str) -> dict:
    ps = {"parallel": {"mode": "ps"}}
    out = {"two_servers": _train({**BASE, **ps, "ps": {"servers": 2}}, f"{tmp}/two")}
    out["hf"] = _train({**BASE, **ps, "ps": {"servers": 2}}, f"{tmp}/hf", steps=3, hf=True)
    out["gpt"] = _trainer(GPT_ARGS, f"{tmp}/gpt")
    cnn = ["--model.name=cnn", "--train.steps=4", "--train.global_batch_size=12", "--train.micro_batch_size=4",
           "--ps.mode=backup", "--ps.backup_workers=1", "--ps.servers=1"]
    out["cnn"] = _trainer(cnn, f"{tmp}/cnn")
    one = {"train": {"global_batch_size": 8, "micro_batch_size": 8}, "optim": BASE["optim"]}
    out["async1"] = _train({**one, **ps, "ps": {"servers": 3, "mode": "async"}}, f"{tmp}/async1")
    out["dc1"] = _train({**one, **ps, "ps": {"servers": 3, "mode": "dc", "dc_lambda": 0.0}}, f"{tmp}/dc1")
    # checkpoints across server counts (sync, global batch 12): saved by 1 server + 3 workers at step 3 of 6
    # and resumed by 2 servers + 2 workers, and the other way round
    out["ps3"] = _train({**THREE, **ps}, f"{tmp}/ps3", save_at=3)  # 3 workers + 1 server
    out["u2"] = _train({**THREE, **ps, "ps": {"servers": 2}}, f"{tmp}/u2", save_at=3)  # 2 workers + 2 servers
    out["r21"] = _train({**THREE, **ps}, f"{tmp}/r21", load=f"{tmp}/u2/ckpt")
    out["r12"] = _train({**THREE, **ps, "ps": {"servers": 2}}, f"{tmp}/r12", load=f"{tmp}/ps3/ckpt")
    # backup over two servers (each shard takes the first N - b gradients that reach it): b = 0 is sync
    out["backup0_two"] = _train({**BASE, **ps, "ps": {"servers": 2, "mode": "backup", "backup_workers": 0}},
                                f"{tmp}/backup0_two")
    slow = {"fault": {"slow_rank": 1, "slow_factor": 3.0}}
    long = {"train": {**BASE["train"], "eval_every": 0}, "optim": BASE["optim"]}
    out["backup_two"] = _train({**long, **ps, **slow, "ps": {"servers": 2, "mode": "backup", "backup_workers": 1}},
                               f"{tmp}/backup_two", steps=12, sleepy=True)
    out["dp3"] = _all_reduce_dp(rank, f"{tmp}/dp3")
    return out


THREE = {"train": {"global_batch_size": 12, "micro_batch_size": 2}, "optim": BASE["optim"]}
GPT_ARGS = ["--model.n_layer=1", "--model.d_model=32", "--model.n_head=2", "--model.seq_len=16", "--train.steps=4",
            "--train.global_batch_size=4", "--train.micro_batch_size=2", "--ps.mode=async", "--ps.servers=2"]


def _all_reduce_dp(rank: int, run_dir: str) -> dict | None:
    """Ranks 0-2 leave the spawn's 4-rank group and train plain plait data parallelism (all-reduce, dp = 3)
    on a 3-rank gloo group with ``THREE``'s global batch; rank 3 sits it out."""
    return _train(THREE, run_dir) if _regroup(rank, 3) else None


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    tmp = tmp_path_factory.mktemp("ps4")
    return run_ranks(_world4, 4, str(tmp), timeout=300), tmp


def test_two_servers_one_worker_and_other_models(world4: tuple) -> None:
    ranks, tmp_path = world4
    tmp = str(tmp_path)
    ref = _reference(tmp)
    hf_ref = _train(BASE, f"{tmp}/hf_ref", steps=3, hf=True)
    for w in (0, 1):  # a transformers model through the same API (tolerance: summation order of the mean)
        assert ranks[w]["hf"]["losses"] == pytest.approx(hf_ref["losses"], abs=1e-5)
        _same(ranks[w]["hf"]["sd"], hf_ref["sd"], atol=1e-5)
    for name in ("gpt", "cnn"):  # plait train's worker function: summary and metrics carry the ps block
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        servers = 2 if name == "gpt" else 1
        assert summary["steps"] == 4 and summary["ps"]["workers"] == 4 - servers and summary["ps"]["servers"] == servers
        assert summary["ps"]["applied"] > 0 and "max_clock_gap" in summary["ps"]
        assert summary["ps"]["staleness_histogram"] and summary["ps"]["push_bytes"] > 0
        metrics = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        steps = [m for m in metrics if "loss" in m]
        assert steps and all("ps_push_bytes" in m and "ps_pull_wait_s" in m for m in steps)
        assert "staleness_histogram" in steps[0]["ps"]
        assert (tmp_path / name / "model" / "model.safetensors").is_file()  # one file: save_pretrained's name
        assert ranks[3][name]["ps_server"]["version"] > 0 and ranks[0][name]["steps"] == 4
    # cnn ran backup (b = 1) through the Trainer's gathers, checkpoints and export: every push accounted for
    final = ranks[3]["cnn"]["ps_server"]
    assert final["applied"] + final["dropped"] == 3 * 4 and final["clocks"] == [4, 4, 4]
    for w in (0, 1, 2):  # sync with one server is all-reduce DP on the same global batch (summation order: 1e-5)
        dp, got = ranks[w]["dp3"], ranks[w]["ps3"]
        assert got["losses"] == pytest.approx(dp["losses"], abs=1e-5)
        _same(got["sd"], dp["sd"], atol=1e-5)
    assert ranks[0]["ps3"]["stats"]["workers"] == 3 and ranks[0]["ps3"]["stats"]["versions"] == [STEPS]
    assert ranks[0]["dp3"]["losses"][-1] < ranks[0]["dp3"]["losses"][0]
    for w in (0, 1):
        assert ranks[w]["two_servers"]["losses"] == pytest.approx(ref["losses"], abs=1e-6)
        _same(ranks[w]["two_servers"]["sd"], ref["sd"])
    assert ranks[2]["two_servers"]["server"]["numel"] + ranks[3]["two_servers"]["server"]["numel"] == 212
    for w in (0, 1):  # backup with b = 0 over two servers is sync over two servers (its loss is each worker's own)
        _same(ranks[w]["backup0_two"]["sd"], ranks[w]["two_servers"]["sd"], atol=0.0)
    for server in (2, 3):  # b = 1, worker 1 three times slower: each shard drops exactly its stale gradients
        stats, events = ranks[server]["backup_two"]["server"], ranks[server]["backup_two"]["events"]
        assert stats["dropped"] > 0 and stats["dropped"] + stats["applied"] == 2 * 12
        assert all((v < at) == (o == "dropped") for _, v, at, o in events)
        assert stats["version"] == stats["applied"]  # one gradient (N - b) completes each version
    assert ranks[0]["backup_two"]["losses"][-1] < ranks[0]["backup_two"]["losses"][0]
    _same(ranks[0]["async1"]["sd"], ref["sd"])  # one worker: asynchronous is plain training
    _same(ranks[0]["dc1"]["sd"], ranks[0]["async1"]["sd"], atol=0.0)  # dc with lambda 0 is async


def _chunks_by_rank(ckpt: Path) -> dict[int, dict[str, set[int]]]:
    """For each rank's file of a DCP checkpoint: the row-major element indices of every tensor it holds
    (from DCP's own metadata: which file stores each chunk)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(ckpt)).read_metadata()
    out: dict[int, dict[str, set[int]]] = {}
    for index, info in md.storage_data.items():
        rank = int(info.relative_path.split("_")[2])
        tensor = md.state_dict_metadata[index.fqn]
        chunk = next(c for c in tensor.chunks if tuple(c.offsets) == tuple(index.offset))
        ids = torch.arange(math.prod(tensor.size)).reshape(tensor.size)
        box = ids[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes, strict=True))]
        out.setdefault(rank, {}).setdefault(index.fqn, set()).update(box.reshape(-1).tolist())
    return out


def test_servers_write_only_their_own_pieces(world4: tuple) -> None:
    """2 workers + 2 servers save at step 3: each server's file holds exactly its flat shard's elements of
    every parameter and AdamW state (a tensor split between servers is split between their files, in row-major
    boxes), each scalar state once (by the server holding the parameter's first element), its own version;
    the workers' files hold nothing (the model has no buffers)."""
    ranks, tmp = world4
    written = _chunks_by_rank(tmp / "u2" / "ckpt")
    assert set(written) == {2, 3}  # no worker wrote a tensor
    split = 0
    for server in (2, 3):
        lo, hi = ranks[server]["u2"]["bounds"][server - 2:server]
        offset, mine = 0, written[server]
        for name, shape in ranks[server]["u2"]["order"]:
            n = math.prod(shape)
            expected = set(range(max(lo - offset, 0), min(hi - offset, n)))  # empty where the shard misses it
            for key in (f"model.{name}", f"optim.state.{name}.exp_avg", f"optim.state.{name}.exp_avg_sq"):
                assert mine.get(key, set()) == expected, (server, key)
            assert (f"optim.state.{name}.step" in mine) == (lo <= offset < hi), (server, name)
            split += 0 < len(expected) < n
            offset += n
        assert mine["ps.versions"] == {server - 2} and ("ps.clocks" in mine) == (server == 2)
        assert sum(len(v) for k, v in mine.items() if k.startswith("model.")) == hi - lo == 106
    assert split == 2  # one weight matrix spans both servers


def test_resume_with_another_number_of_servers(world4: tuple) -> None:
    """sync, global batch 12: the checkpoint of 1 server + 3 workers at step 3 resumed by 2 servers + 2 workers
    equals the uninterrupted 2-server run, and the 2-server checkpoint resumed by 1 server + 3 workers equals
    the uninterrupted 1-server run (losses and parameters: 1e-5, the summation order of the mean over 2 or 3
    workers in steps 1-3; the uninterrupted runs themselves differ by that much)."""
    ranks, _ = world4
    for w in (0, 1):
        for resumed, whole in (("r12", "u2"), ("r21", "ps3")):
            got, ref = ranks[w][resumed], ranks[w][whole]
            assert got["losses"] == pytest.approx(ref["losses"][3:], abs=1e-5), resumed
            _same(got["sd"], ref["sd"], atol=1e-5)
            assert got["last"]["ps_clock"] == 6 and got["last"]["ps_versions"] == ref["last"]["ps_versions"]
    _same(ranks[0]["u2"]["sd"], ranks[0]["ps3"]["sd"], atol=1e-5)
    assert ranks[3]["r21"]["server"]["version"] == 6 and ranks[2]["r12"]["server"]["version"] == 6
    assert ranks[3]["r12"]["server"]["clocks"] == [6, 6]  # 3 saved clocks (3 each) onto 2 workers


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_ps_checkpoint_loads_into_one_process_and_plait_sample(world4: tuple, capsys: pytest.CaptureFixture) -> None:
    """plait's GPT (tied embeddings) trained by plait train with 2 async servers: its last checkpoint, written
    by the servers, loads by DCP into the single-process model (every name, strict) and equals the exported
    model.safetensors exactly; ``plait sample`` generates from that export."""
    import torch.distributed.checkpoint as dcp

    from plait.checkpoint.dcp import latest_checkpoint
    from plait.checkpoint.single_file import load_safetensors
    from plait.cli import cmd_sample
    from plait.config import load_config, to_toml
    from plait.models.gpt import GPT

    _, tmp = world4
    cfg = load_config(None, GPT_ARGS)
    (tmp / "gpt" / "config.toml").write_text(to_toml(cfg))  # as plait train writes it
    exported, loaded = GPT(cfg.model, cfg.moe), GPT(cfg.model, cfg.moe)
    load_safetensors(exported, tmp / "gpt")
    ckpt = latest_checkpoint(tmp / "gpt")
    assert ckpt.name == "step_0000004" and json.loads((ckpt / "meta.json").read_text())["steps"] == 4
    state = {"model": loaded.state_dict()}
    dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    assert loaded.head.weight is loaded.tok_emb.weight
    _same(loaded.state_dict(), exported.state_dict(), atol=0.0)
    assert cmd_sample([str(tmp / "gpt"), "--prompt", "def ", "--tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("def ")


def _dies(rank: int, world: int, tmp: str, victim: int) -> None:
    """Rank ``victim`` is killed (SIGKILL): a worker after two steps, the server 3 s after it started
    serving; the others run on until the job ends."""
    import os
    import signal
    import threading

    import plait
    from plait.ps import ServerDone

    p = plait.Plait(run={"dir": tmp}, observe={"progress": False, "trackers": []}, **BASE,
                    parallel={"mode": "ps"})
    if rank == victim == 2:
        threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
    try:
        model, _ = p.setup(_model(), loss_fn=_mse)
    except ServerDone:
        return
    loader = p.setup_dataloader(_data())
    while p.steps < 100_000:
        for batch in loader:  # epochs until the job ends
            if rank == victim and p.steps == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            p.forward_backward(model, batch)
            p.step()


@pytest.mark.parametrize("victim", [1, 2])
def test_a_killed_worker_or_server_ends_the_job_with_its_name(tmp_path: __import__("pathlib").Path,
                                                               victim: int) -> None:
    import time

    t0 = time.perf_counter()
    with pytest.raises(SpawnError) as e:
        run_ranks(_dies, 3, str(tmp_path), victim, timeout=60)
    if victim == 1:  # the server names the worker whose link broke (or worker 0 the server that ended for it)
        assert "PsError: worker rank 1 is gone" in str(e.value) or "PsError: parameter server rank 2" in str(e.value)
    else:  # every worker names the server
        assert "PsError: parameter server rank 2 is gone" in str(e.value)
    assert time.perf_counter() - t0 < 50  # the connection's end is seen at once, not after a timeout
