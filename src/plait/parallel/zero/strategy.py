"""ZeRO stages 1-2 as a strategy (``Zero``): plait's sharded optimizer (``plait.parallel.zero.optimizer``) owns
gradient synchronisation, each rank keeping a 1/N shard of the optimizer states (and with stage 2 of the
gradients) while holding the whole model.

The optimizer factory is called with the model once (a probe that holds no state); ZeRO rebuilds the same
optimizer class with the same groups and hyperparameters over its flat shards, which computes the unsharded
update only for torch's elementwise optimizers (``check_elementwise``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from plait.comm.collectives import Comm
from plait.components.optim import optimizer_recipe
from plait.config import Config, ConfigError, ParallelConfig
from plait.parallel.apply import ModelSpec
from plait.parallel.data.strategy import BatchNormAveraging
from plait.parallel.strategy import LayoutError, OptimizerFactory, Strategy, register_strategy
from plait.parallel.zero.optimizer import validate_zero
from plait.topology import Topology

# The elementwise torch optimizers: sharding their flat buffers computes exactly what they compute whole.
ELEMENTWISE = ("Adam", "AdamW", "SGD", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop", "Adadelta", "ASGD",
               "Rprop")



@register_strategy
class Zero(BatchNormAveraging, Strategy):
    """ZeRO stages 1-2: plait's sharded optimizer owns gradient synchronisation."""

    name = "zero"
    priority = 20
    shards_gradients = True

    @classmethod
    def applies(cls, p: ParallelConfig) -> bool:
        return p.zero in (1, 2)

    @classmethod
    def check(cls, cfg: Config, degrees: dict[str, int]) -> None:
        import torch.cuda

        p = cfg.parallel
        # the ranks the state is sharded over: dp x cp (the strategies see cp folded into dp: Topology.strategy_view)
        dp = degrees["dp_replicate"] * degrees["dp_shard"] * degrees["ep"] * degrees.get("cp", 1)
        try:
            validate_zero(p.zero, dp, p.offload, "cuda" if torch.cuda.is_available() else "cpu")
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def __init__(self, model: nn.Module, cfg: Config, topo: Topology, comm: Comm,
                 spec: ModelSpec | None = None) -> None:
        super().__init__(model, cfg, topo, comm, spec)
        self._track_batchnorm(model, cfg, topo)

    def build_optimizer(self, factory: OptimizerFactory) -> Any:
        from plait.parallel.zero.optimizer import ZeroOptimizer

        probe = factory(self.model)  # holds no state: only its class, groups and hyperparameters are used
        cls, defaults, groups = optimizer_recipe(probe)
        check_elementwise(cls, f"parallel.zero={self.cfg.parallel.zero}", "Use parallel.zero=3 or 0")
        p = self.cfg.parallel
        self.optimizer = ZeroOptimizer(self.model, groups, cls, group=self.topo.dp_group, stage=p.zero,
                                       bucket_mb=p.bucket_mb, offload=p.offload == "optimizer", **defaults)
        self.optimizer.use_comm(self.comm)  # its collectives go through the comm layer: counted, guarded
        return self.optimizer

    def scheduler_target(self) -> torch.optim.Optimizer:
        return self.optimizer.optimizer  # the inner torch optimizer: its param_groups are the ones stepped

    def set_sync(self, enabled: bool) -> None:
        self.optimizer.set_sync(enabled)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.optimizer.no_sync()

    def finish(self) -> None:
        self.optimizer.finish_grad_sync()

    def grads(self) -> list[torch.Tensor]:
        return [b.grad_shard for b in self.optimizer.buckets]

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return self.optimizer.clip_grad_norm_(max_norm)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def state_dicts(self) -> tuple[dict, dict]:
        optim_sd = self.optimizer.state_dict()  # collective: gathers the canonical (unsharded) layout
        self._param_groups = optim_sd["param_groups"]
        return self.model.state_dict(), {"state": optim_sd["state"]}

    def load_state_dicts(self, model_sd: dict, optim_sd: dict) -> None:
        self.model.load_state_dict(model_sd)
        self.optimizer.load_state_dict({"state": optim_sd["state"], "param_groups": self._param_groups})



def check_elementwise(cls: type, what: str, instead: str) -> None:
    """A ``LayoutError`` unless ``cls`` is one of torch's elementwise optimizers, whose update on flat
    shards equals the unsharded one."""
    if cls.__name__ not in ELEMENTWISE or not cls.__module__.startswith("torch.optim"):
        raise LayoutError(f"{what} shards each optimizer state into flat slices, which computes the unsharded "
                          f"update only for elementwise optimizers ({', '.join(ELEMENTWISE)} from torch.optim); "
                          f"{cls.__module__}.{cls.__name__} is not one of them. {instead}")

