"""Expert parallelism as a wrapper strategy: experts sharded by global index over the ``ep`` ranks
(``plait.parallel.expert.dispatch`` shards them and dispatches tokens), composed around the data-parallel strategy
that handles the dense parameters (plait's reducer, DDP, ZeRO-1/2, FSDP2, tensor or pipeline parallelism).

Gradient rule (``plait.parallel.expert.dispatch``'s docstring): dense gradients are averaged over the whole
data-parallel world, ep included, by the inner strategy; expert gradients are summed over the
expert-data-parallel group (the dp/ep ranks holding the same experts) and divided by dp, here.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.components.optim import materialize_optimizer_state, optimizer_recipe
from plait.config import Config, ParallelConfig
from plait.parallel.compile import check_compile
from plait.parallel.data.strategy import reduce_in_place
from plait.parallel.expert.dispatch import ExpertParallelError, check_expert_layout
from plait.parallel.pipeline.strategy import Pipeline
from plait.parallel.strategy import Strategy, register_strategy
from plait.parallel.tensor.plan import local_value
from plait.parallel.tensor.strategy import ModelParallel
from plait.parallel.units import is_expert
from plait.parallel.wrapper import Wrapper
from plait.parallel.zero.optimizer import ZeroOptimizer


@register_strategy
class ExpertParallel(Wrapper):
    """Expert parallelism, composed around a data-parallel strategy (which handles the dense parameters): the
    expert parameters it leaves out, their reduction, clipping, zeroing and checkpoint form. Everything
    else is the inner strategy's.

    Under ZeRO (``parallel.zero`` 1-3) the inner layout shards the dense parameters (optimizer states,
    gradients, and with 3 the parameters) over the whole data-parallel world, ``ep`` included, and the
    experts, already divided ``ep`` ways, are sharded the same way over the remaining data-parallel axis,
    the ``dp / ep`` ranks holding the same experts (``mode``):

    * ``"zero"`` (zero 1-2): a second ``ZeroOptimizer`` over the expert parameters and the
      expert-data-parallel group, gradients reduce-scattered there and divided by ``dp``;
    * ``"fsdp"`` (zero 3): the experts are FSDP2 units over that group (``fsdp_shard_experts``);
    * ``"replicated"``: no ZeRO, or ``dp = ep`` (nothing left to shard over): whole local experts, their
      gradients summed over the expert-data-parallel group and divided by ``dp`` in ``finish``;
    * ``"none"``: a pipeline stage holding no MoE layer (every rank of that stage alike): nothing to do.

    Under ZeRO the experts have their own optimizer of the same class, groups and hyperparameters (the
    learning rate copied from the scheduled dense groups before each step): a composite optimizer.
    Without ZeRO the one optimizer from the factory holds both."""

    name = "expert"

    @classmethod
    def wraps(cls, p: ParallelConfig) -> bool:
        return p.ep > 1

    @classmethod
    def check(cls, cfg: Config, degrees: dict[str, int]) -> None:
        check_expert_layout(cfg.moe, cfg.parallel)
        check_compile(cfg.train.compile, degrees["ep"], cfg.moe.dispatcher)

    def __init__(self, inner: Strategy) -> None:
        super().__init__(inner)
        topo = self.topo
        # the inner strategy's own parameter objects (FSDP replaced them; a pipeline stage holds some layers)
        self.experts = [p for _, p in inner.named_parameters() if is_expert(p)]
        self._ids = {id(p) for p in self.experts}
        self.sharded = inner.shards_gradients  # dense gradients are shards (ZeRO, FSDP)
        self.fsdp = self.sharded and self.cfg.parallel.zero == 3
        edp = topo.dp // topo.ep
        self.mode = "replicated" if edp == 1 or not self.sharded else "fsdp" if self.fsdp else "zero"
        if not self.experts:  # a pipeline stage with no MoE layer (the same on every rank of the stage)
            self.mode = "none"
        self.expert_opt: Any = None
        self._group_of: list[int] = []  # expert group i -> the factory's group index

    def build_optimizer(self, factory: Any) -> Any:
        if not self.sharded or self.mode == "none":
            return self.inner.build_optimizer(factory)
        cls, defaults, groups = optimizer_recipe(factory(self.inner.model))
        dense = [(i, {**g, "params": [p for p in g["params"] if id(p) not in self._ids]}) for i, g in enumerate(groups)]
        expert = [(i, {**g, "params": [p for p in g["params"] if id(p) in self._ids]}) for i, g in enumerate(groups)]
        dense = [(i, g) for i, g in dense if g["params"]]
        expert = [(i, g) for i, g in expert if g["params"]]
        if sum(len(g["params"]) for _, g in expert) != len(self.experts):
            raise ExpertParallelError("the optimizer factory must cover the expert parameters (it is called with "
                                      "the model whose experts are sharded over ep)")
        self._dense_index = [i for i, _ in dense]
        self._group_of = [i for i, _ in expert]
        opt = self.inner.build_optimizer(lambda m: cls([g for _, g in dense], **defaults))
        if self.mode == "zero":
            p = self.cfg.parallel
            self.expert_opt = ZeroOptimizer(self.inner.model, [g for _, g in expert], cls,
                                            group=self.topo.expert_dp_group, stage=p.zero, bucket_mb=p.bucket_mb,
                                            offload=p.offload == "optimizer", experts=True,
                                            grad_divisor=self.topo.dp, **defaults)
            self.expert_opt.use_comm(self.comm)
        else:
            self.expert_opt = cls([g for _, g in expert], **defaults)
        return opt

    @property
    def optimizers(self) -> list[Any]:
        """Every optimizer holding state (the composite's two under ZeRO): what memory accounting reads."""
        return [self.inner.optimizer] + ([self.expert_opt] if self.expert_opt is not None else [])

    def step(self) -> None:
        self.inner.step()
        if self.expert_opt is not None:
            groups = self.inner.scheduler_target().param_groups
            for i, g in zip(self._group_of, self.expert_opt.param_groups, strict=True):
                src = groups[self._dense_index.index(i)] if i in self._dense_index else groups[0]
                g["lr"] = src["lr"]  # the scheduler moves the dense groups' rate
            self.expert_opt.step()

    def set_sync(self, enabled: bool) -> None:
        self.inner.set_sync(enabled)  # FSDP2's switch covers the nested expert units too
        if self.mode == "zero" and self.expert_opt is not None:
            self.expert_opt.set_sync(enabled)

    def no_sync(self) -> Any:

        stack = contextlib.ExitStack()
        stack.enter_context(self.inner.no_sync())
        if self.mode == "zero" and self.expert_opt is not None:
            stack.enter_context(self.expert_opt.no_sync())
        return stack

    def _expert_grads(self) -> list[torch.Tensor]:
        """This rank's expert gradients: whole local experts, or its shards of them under ZeRO."""
        if self.mode == "zero":
            return [b.grad_shard for b in self.expert_opt.buckets]
        if self.mode == "fsdp":
            return [p.grad.to_local() for p in self.experts if p.grad is not None]
        for p in self.experts:  # an expert no token reached still has a zero gradient
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in self.experts]

    def finish(self) -> None:
        """Dense gradients by the inner layout; expert gradients summed over the expert-data-parallel group
        and divided by the whole data-parallel degree (see the module docstring): reduce-scattered by the
        expert ``ZeroOptimizer`` or FSDP2 under ZeRO, all-reduced here otherwise."""
        self.inner.finish()
        if self.mode == "zero":
            self.expert_opt.finish_grad_sync()
        elif self.mode == "replicated":
            group = self.topo.expert_dp_group if self.topo.dp > self.topo.ep else None  # None: no replica
            reduce_in_place(self._expert_grads(), self.comm, group, self.topo.dp, "expert gradients")

    def _dense_grads(self) -> list[torch.Tensor]:
        if self.fsdp:  # this rank's shards of the DTensor gradients
            return [p.grad.to_local() for p in self.inner.model.parameters()
                    if p.grad is not None and id(p) not in self._ids]
        expert = {id(p.grad) for p in self.experts}
        return [g for g in self.inner.grads() if id(g) not in expert]

    def grads(self) -> list[torch.Tensor]:
        return self._dense_grads() + self._expert_grads()

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global norm: the dense gradients (equal on every rank, or summed over the shards under ZeRO) and
        the expert gradients summed over the ``ep`` ranks (each holds different experts), and over the
        expert-data-parallel ranks too when those hold shards; torch's clipping coefficient on both."""
        dense, expert = self._dense_grads(), self._expert_grads()
        if isinstance(self.inner, ModelParallel):  # tensor-parallel shards summed over tp, once each
            d2 = self.inner.sharded_squares(skip=self._ids).reshape(1)
        else:
            d2 = sum((g.double().pow(2).sum() for g in dense), torch.zeros((), dtype=torch.float64)).reshape(1)
            if self.sharded:
                self.comm.all_reduce_sum(d2, self.topo.dp_group, name="dense gradient norm")
        e2 = sum((g.double().pow(2).sum() for g in expert), torch.zeros((), dtype=torch.float64)).reshape(1)
        if self.mode != "none":  # a stage without experts: nothing to sum (its peers in the stage have none either)
            group = self.topo.ep_group if self.mode == "replicated" else self.topo.dp_group
            self.comm.all_reduce_sum(e2, group, name="expert gradient norm")
        stage = d2 + e2
        if self.topo.degree("pp") > 1:  # each stage's own parameters
            self.comm.all_reduce_sum(stage, self.topo.group("pp"), name="gradient norm over stages")
        total = float(stage[0].sqrt())
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for g in dense + expert:
                g.mul_(coef)
        return total

    def zero_grad(self) -> None:
        self.inner.zero_grad()
        if self.mode == "zero":
            self.expert_opt.zero_grad()
        elif self.mode == "fsdp":
            self.expert_opt.zero_grad(set_to_none=True)
        else:
            for p in self.experts:
                if p.grad is not None:
                    p.grad.zero_()

    # -- state --------------------------------------------------------------------------------------
    def _param_names(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.inner.named_parameters() if id(p) in self._ids}

    def _to_dtensor(self, t: torch.Tensor, p: nn.Parameter) -> Any:
        """A weight or optimizer state of ``p``'s shape as a DTensor of the global ``(E, ...)`` tensor:
        ``Shard(0)`` over ``ep``, and under ZeRO-3 ``Shard(1)`` over the expert-data-parallel ranks
        (the FSDP2 shard this rank holds). Other entries (a step counter) are returned as they are."""
        from torch.distributed.tensor import DTensor, Shard

        if t.shape != p.shape or self.topo.mesh is None:
            return t
        shape = torch.Size(p.global_shape)
        stride = torch.empty(shape, device="meta").stride()
        if self.mode == "fsdp":  # mesh axes in topology order: dp_replicate (dim 1), then ep (dim 0)
            return DTensor.from_local(t.to_local(), self.topo.mesh["dp_replicate", "ep"], [Shard(1), Shard(0)],
                                      run_check=False, shape=shape, stride=stride)
        return DTensor.from_local(t, self.topo.mesh["ep"], [Shard(0)], run_check=False, shape=shape, stride=stride)

    def _from_dtensor(self, v: Any, p: nn.Parameter) -> Any:
        """Inverse of ``_to_dtensor`` after a load: this rank's part, in the form ``p`` holds it."""
        if not hasattr(v, "to_local"):
            return v
        local = v.to_local()
        if self.mode != "fsdp" or v.dim() != p.dim():
            return local
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())

    def _expert_state(self) -> dict[str, dict]:
        """The expert optimizer's state keyed by parameter name: full local experts per entry (gathered over
        the expert-data-parallel group from the ZeRO shards), or FSDP's shards under ZeRO-3."""
        assert self.expert_opt is not None
        names = self._param_names()
        if self.mode == "zero":
            fqn = {self.expert_opt._fqn[p]: n for n, p in names.items()}
            return {fqn[k]: dict(st) for k, st in self.expert_opt.state_dict()["state"].items()}
        materialize_optimizer_state(self.expert_opt)  # a load template needs the tensors
        by_id = {id(p): n for n, p in names.items()}
        order = [p for g in self.expert_opt.param_groups for p in g["params"]]
        return {by_id[id(order[i])]: dict(st) for i, st in self.expert_opt.state_dict()["state"].items()}

    def state_dicts(self) -> tuple[dict, dict]:
        """The inner layout's states with each expert weight and optimizer state as a DTensor of the global
        ``(E, ...)`` tensor (``_to_dtensor``), so DCP reshards it to any ``ep`` and ZeRO stage."""
        model_sd, optim_sd = self.inner.state_dicts()
        if self.expert_opt is not None:
            optim_sd = {**optim_sd, "state": {**optim_sd["state"], **self._expert_state()}}
        for name, p in self._param_names().items():
            if name in model_sd:
                model_sd[name] = self._to_dtensor(model_sd[name], p)
            st = optim_sd["state"].get(name)
            if st:  # a new dict: the inner one may be the optimizer's own state
                optim_sd["state"][name] = {k: self._to_dtensor(v, p) if torch.is_tensor(v) else v
                                           for k, v in st.items()}
        return model_sd, optim_sd

    def model_entries(self) -> dict[str, torch.Tensor]:
        """The inner layout's entries with each expert weight as a DTensor of the global ``(E, ...)`` tensor
        over this rank's storage: a checkpoint's expert tensor is read by the slice this rank holds."""
        entries = self.inner.model_entries()
        for name, p in self._param_names().items():
            if name in entries:
                entries[name] = self._to_dtensor(entries[name], p)
        return entries

    def load_state_dicts(self, model_sd: dict, optim_sd: dict) -> None:
        names = self._param_names()

        def local(k: str, v: Any) -> Any:  # only the expert entries: FSDP's own DTensors stay as they are
            return self._from_dtensor(v, names[k]) if k in names else v

        model_sd = {k: local(k, v) for k, v in model_sd.items()}
        state = {k: {kk: local(k, vv) for kk, vv in st.items()} for k, st in optim_sd["state"].items()}
        if self.mode == "zero":  # the canonical form ZeroOptimizer reads: full tensors keyed by its names
            zopt = self.expert_opt
            fqn = {n: zopt._fqn[p] for n, p in names.items()}
            mine = {fqn[n]: state.pop(n) for n in list(state) if n in names}
            groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(f)}
                      for g, f in zip(zopt.param_groups, zopt._group_fqns, strict=True)]
            zopt.load_state_dict({"state": mine, "param_groups": groups})
        elif self.expert_opt is not None:
            order = [p for g in self.expert_opt.param_groups for p in g["params"]]
            index = {id(p): i for i, p in enumerate(order)}
            mine = {index[id(names[n])]: state.pop(n) for n in list(state) if n in names}
            self.expert_opt.load_state_dict({"state": mine,
                                             "param_groups": self.expert_opt.state_dict()["param_groups"]})
        self.inner.load_state_dicts(model_sd, {**optim_sd, "state": state})

    def full_model_state(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Single-process weights: each expert tensor gathered over the ``ep`` group (dim 0 = global index),
        after its FSDP shards over the expert-data-parallel group under ZeRO-3."""
        experts = {}
        for name, p in self._param_names().items():
            mine = p.detach().full_tensor() if self.mode == "fsdp" else p.detach()
            parts = [torch.empty_like(mine) for _ in range(self.topo.ep)]
            dist.all_gather(parts, mine.contiguous(), group=self.topo.ep_group)
            experts[name] = torch.cat(parts)
        if isinstance(self.inner, Pipeline):  # stages' entries, this stage's experts whole, over pp
            mine_pp = {k: local_value(v).detach().cpu() for k, v in self.inner.runner.state_dict().items()}
            mine_pp.update(experts)
            parts_pp: list = [None] * self.topo.degree("pp")
            dist.all_gather_object(parts_pp, mine_pp, group=self.topo.group("pp"))
            return {k: v for part in parts_pp for k, v in part.items()}
        return {**self.inner.full_model_state(rank0_only), **experts}

    def report(self, run_dir: Path | None, measured: dict[str, int] | None, device: torch.device) -> dict[str, Any]:
        out = dict(self.inner.report(run_dir, measured, device))
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in self.experts)
        states = (sum(b.chunk for b in self.expert_opt.buckets) if self.mode == "zero" else local)
        out["expert_parallel"] = {"ep": self.topo.ep, "expert_dp": self.topo.dp // self.topo.ep,
                                  "expert_sharding": self.mode, "expert_params_local": local,
                                  "expert_optimizer_numel_local": states}
        return out
