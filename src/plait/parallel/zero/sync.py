"""ZeRO stages 1-2 as a gradient-sync policy (``Zero``): plait's sharded optimizer (``plait.parallel.zero.optimizer``)
owns the gradient synchronisation, each rank keeping a 1/N shard of the optimizer states (and with stage 2 of the
gradients) while holding every parameter it runs.

The optimizer factory is called once (a probe holding no state); ZeRO rebuilds the same optimizer class with the same
groups and hyperparameters over its flat shards, which computes the unsharded update only for torch's elementwise
optimizers (``check_elementwise``).

Under a pipeline every pipeline micro-batch runs its own backward, so a schedule step runs under the optimizer's
``no_sync`` (gradients accumulate in its flat buckets) and ``finish`` reduces them once per optimizer step: ZeRO-1
all-reduces each bucket, ZeRO-2 reduce-scatters it. Gradients that torch's zero-bubble schedule writes straight into
``.grad`` (its weight pass, which no accumulation hook sees) are added to the buckets first (``gather_local``), and
the tied copies (a GPT's embedding and head on the first and last stage) are summed in the local buckets before the
reduction (``ties_first``): a sum of sums either way.

Under tensor (and sequence) parallelism the group is the data-parallel ranks of one tp coordinate, the optimizer
works on each parameter's local shard (the parameters stay the plan's DTensors), and each bucket's squares are
summed over the groups its parameters are sharded on as well (``norm_pieces``): Megatron-Core's distributed optimizer
under tp.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from plait.components.optim import optimizer_recipe
from plait.config import Config, ConfigError, ParallelConfig
from plait.parallel.grad_sync import GradSync, NormPiece, OptimizerFactory, check_elementwise, register_grad_sync
from plait.parallel.zero.optimizer import ZeroOptimizer, validate_zero


@register_grad_sync
class Zero(GradSync):
    """ZeRO stages 1-2: plait's sharded optimizer owns gradient synchronisation."""

    name = "zero"
    shards_gradients = True
    ties_first = True
    kind = "ZeRO"
    optimizer: ZeroOptimizer

    @classmethod
    def chosen(cls, p: ParallelConfig) -> bool:
        return p.zero in (1, 2)

    @classmethod
    def check(cls, cfg: Config, degrees: dict[str, int]) -> None:
        import torch.cuda

        p = cfg.parallel  # every stage's and offload's arithmetic (ZeRO-3's too: the ranks it shards over)
        # the ranks the state is sharded over: every rank whose gradients are averaged (dp x cp; under DiLoCo the
        # degrees are one replica's)
        dp = degrees["dp_replicate"] * degrees["dp_shard"] * degrees["ep"] * degrees.get("cp", 1)
        try:
            validate_zero(p.zero, dp, p.offload, "cuda" if torch.cuda.is_available() else "cpu")
        except ValueError as e:
            if p.sync == "diloco" and dp < 2:
                raise ConfigError(f"parallel.zero={p.zero} shards each DiLoCo replica's state over its data-parallel "
                                  "ranks, and a replica here has one: set parallel.dp_shard=N for N data-parallel "
                                  "ranks per replica (N >= 2), or parallel.zero=0") from None
            raise ConfigError(str(e)) from None

    def build_optimizer(self, factory: OptimizerFactory, model: nn.Module) -> Any:
        probe = factory(model)  # holds no state: only its class, groups and hyperparameters are used
        cls, defaults, groups = optimizer_recipe(probe)
        p = self.cfg.parallel
        check_elementwise(cls, f"parallel.zero={p.zero}", "Use parallel.zero=3 or 0")
        self.optimizer = ZeroOptimizer(model, groups, cls, group=self.group, stage=p.zero, bucket_mb=p.bucket_mb,
                                       offload=p.offload == "optimizer", **defaults)
        self.optimizer.use_comm(self.comm)  # its collectives go through the comm layer: counted, guarded
        self._where = {id(q): (b, i) for b in self.optimizer.buckets for i, q in enumerate(b.params)}
        return self.optimizer

    def scheduler_target(self) -> torch.optim.Optimizer:
        return self.optimizer.optimizer  # the inner torch optimizer: its param_groups are the ones stepped

    def set_sync(self, enabled: bool) -> None:
        self.optimizer.set_sync(enabled)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.optimizer.no_sync()

    def gather_local(self) -> None:
        self.optimizer.gather_local()

    def local_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        """``p``'s local (unreduced) gradient: its slice of its bucket's flat buffer, shaped like its local tensor."""
        b, i = self._where[id(p)]
        return b.view(i, b.ensure_grad_full())

    def finish(self) -> None:
        self.optimizer.finish_grad_sync()

    def grads(self) -> list[torch.Tensor]:
        return [b.grad_shard for b in self.optimizer.buckets]

    def clip_alone(self, max_norm: float) -> torch.Tensor:
        return self.optimizer.clip_grad_norm_(max_norm)

    def norm_pieces(self, skip: set[int] = frozenset()) -> list[NormPiece]:
        """Each bucket's shard, less the ranges that belong to a skipped parameter (a later copy of a tied one),
        summed over the ZeRO group and over the groups its parameters are sharded on (tp for a bucket of
        tensor-parallel shards; a bucket of tp-replicated parameters counts once)."""
        zopt = self.optimizer
        zopt.finish_grad_sync()
        pieces = []
        for b in zopt.buckets:
            g = b.grad_shard.detach().double()
            sq = g.pow(2).sum()
            lo, hi = zopt.rank * b.chunk, (zopt.rank + 1) * b.chunk
            for i, q in enumerate(b.params):
                if id(q) in skip:
                    a, e = max(b.offsets[i], lo), min(b.offsets[i] + b.sizes[i], hi)
                    if a < e:
                        sq = sq - g[a - lo:e - lo].pow(2).sum()
            pieces.append((sq, (self.group, *b.shard_groups)))
        return pieces

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def optimizer_state(self, named: list[tuple[str, nn.Parameter]]) -> dict[str, Any]:
        """The canonical (unsharded) states keyed by the names the optimizer was built with (collective: gathered
        over the ZeRO group)."""
        sd = self.optimizer.state_dict()
        self._param_groups = sd["param_groups"]
        return sd["state"]

    def load_optimizer_state(self, named: list[tuple[str, nn.Parameter]], state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict({"state": state, "param_groups": self._param_groups})

    def describe(self) -> str:
        return "ZeRO"
