"""A gradient-sync policy is one new class: a policy defined here, in the test, registers itself and trains at
world 2 through ``plait.Plait`` with no change to any file of plait (``parallel.strategy = "toy_allreduce"``).

The toy averages every gradient with one plain ``all_reduce`` per parameter after backward (no buckets, no
overlap) and keeps the base class's defaults for everything else: optimizer, clipping, checkpoints, export.
Against one process on the whole batch with the same weights and data: losses and parameters after 4 SGD
steps within 1e-6 (the sum of two half-batch means in float32 differs from the whole batch's mean in the last
bits only). Also: the registry refuses a second policy under a taken name, selection by name and the toy's
own check reach ``plait.validate``, and a checkpoint of the toy loads into plait's data parallelism.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import run_ranks
from torch import nn

from plait.config import Config, ConfigError, ParallelConfig
from plait.parallel.grad_sync import GradSync, register_grad_sync

STEPS, LR = 4, 0.1


@register_grad_sync
class ToyAllReduce(GradSync):
    """Data parallelism in a dozen lines: gradients averaged by one all-reduce each after backward."""

    name = "toy_allreduce"

    @classmethod
    def check(cls, cfg: Config, degrees: dict[str, int]) -> None:
        p = cfg.parallel
        if p.strategy == cls.name and (p.zero or p.tp > 1 or p.pp > 1):
            raise ConfigError("parallel.strategy=toy_allreduce replicates everything: set parallel.zero=0, tp=pp=1")

    def finish(self) -> None:
        if self.ranks > 1:
            for p in self.params:
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self.group)
                    p.grad /= self.ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(STEPS)]


def _train(rank: int, world: int, run_dir: str) -> dict:
    import plait

    p = plait.Plait(parallel={"strategy": "toy_allreduce"}, optim={"grad_clip": 0.0},
                    train={"global_batch_size": 8, "micro_batch_size": 8 // world},
                    observe={"progress": False, "trackers": []}, run={"dir": run_dir})
    model, opt = p.setup(_model(), optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=LR))
    share = 8 // world
    losses = []
    for x, y in _data():
        x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
        p.backward(nn.functional.cross_entropy(model(x), y))
        info = p.step()
        losses.append(info.global_loss)
    p.save(f"{run_dir}/ckpt", model=model, optimizer=opt)
    out = {"losses": losses, "params": {k: v.clone() for k, v in p.full_state_dict(model).items()},
           "strategy": type(p.layout.policy).__name__, "describe": p.layout.describe()}
    p.close()
    return out


def _load_into_data_parallel(rank: int, world: int, run_dir: str) -> dict:
    import plait

    p = plait.Plait(optim={"grad_clip": 0.0}, train={"global_batch_size": 8, "micro_batch_size": 8 // world},
                    observe={"progress": False, "trackers": []}, run={"dir": run_dir + "/dp"})
    model, opt = p.setup(_model(), optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=LR))
    p.load(f"{run_dir}/ckpt", model=model, optimizer=opt)
    out = {"params": {k: v.clone() for k, v in p.full_state_dict(model).items()}, "steps": p.steps,
           "strategy": type(p.layout.policy).__name__}
    p.close()
    return out


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in _data():
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, model.state_dict()


def test_toy_strategy_trains_at_world_2_like_one_process(tmp_path: Path) -> None:
    ranks = run_ranks(_train, 2, str(tmp_path))
    ref_losses, ref_params = _reference()
    for r in ranks:
        assert r["strategy"] == "ToyAllReduce"
        assert r["losses"] == pytest.approx(ref_losses, abs=1e-6)
        for k, v in ref_params.items():
            torch.testing.assert_close(r["params"][k], v, atol=1e-6, rtol=0)
    loaded = run_ranks(_load_into_data_parallel, 2, str(tmp_path))
    for r in loaded:
        assert r["strategy"] == "Reducer" and r["steps"] == STEPS
        for k, v in ranks[0]["params"].items():
            torch.testing.assert_close(r["params"][k], v, atol=0, rtol=0)


def test_registry_selects_checks_and_refuses_a_taken_name() -> None:
    from plait.parallel.compose import policy_class
    from plait.recipes import validate_config as validate

    assert policy_class(ParallelConfig(strategy="toy_allreduce")) is ToyAllReduce
    assert policy_class(ParallelConfig()).name == "data"
    assert policy_class(ParallelConfig(zero=3, tp=2)).name == "fsdp"  # one policy, whatever ran before it
    with pytest.raises(ConfigError, match="not a registered gradient-sync policy.*toy_allreduce"):
        policy_class(ParallelConfig(strategy="toy"))
    cfg = Config()
    cfg.parallel.strategy, cfg.parallel.zero = "toy_allreduce", 1
    with pytest.raises(ConfigError, match="toy_allreduce replicates everything"):
        validate(cfg, 2, model_checks=False)

    class Other(GradSync):
        name = "toy_allreduce"

    with pytest.raises(ValueError, match="already registered"):
        register_grad_sync(Other)
