"""Expert parallelism's gradient side (``ExpertSync``): the expert parameters the gradient-sync policy leaves out
(``plait.parallel.units.is_expert``), their reduction, their part of the norm, their optimizer and their checkpoint
form. The experts themselves are sharded by global index over the ``ep`` ranks on the model side
(``plait.parallel.expert.dispatch.shard_experts``, ``apply_expert`` in the composition).

Gradient rule (``plait.parallel.expert.dispatch``'s docstring): dense gradients are averaged over the whole
data-parallel world, ep included, by the policy; expert gradients are summed over the expert-data-parallel group (the
ranks holding the same experts) and divided by the data-parallel degree, here. Under a sharding policy the experts,
already divided ``ep`` ways, are sharded the same way over the expert-data-parallel ranks (``mode``):

* ``"zero"`` (ZeRO-1/2): a second ``ZeroOptimizer`` over the expert parameters and the expert-data-parallel group;
* ``"fsdp"`` (ZeRO-3): the experts are FSDP2 units over that group (``fsdp_shard_experts``, made by the policy's wrap;
  under HSDP sharded over a shard group's part of it and replicated across the replicas);
* ``"replicated"``: no sharding, or nothing left to shard over: whole local experts, their gradients summed over the
  expert-data-parallel group and divided by the data-parallel degree in ``finish`` (under sequence parallelism the
  experts are replicated DTensors over tp whose gradients are partial sums: summed over tp in the same all-reduce);
* ``"none"``: a pipeline stage holding no MoE layer (every rank of that stage alike): nothing to do.

Under a sharding policy the experts have their own optimizer of the same class, groups and hyperparameters (the
learning rate copied from the scheduled dense groups before each step): a composite optimizer. Otherwise the one
optimizer from the factory holds both.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from plait.components.optim import materialize_optimizer_state, optimizer_recipe
from plait.parallel.expert.dispatch import ExpertParallelError
from plait.parallel.grad_sync import GradSync, NormPiece, reduce_in_place
from plait.parallel.zero.optimizer import ZeroOptimizer


class ExpertSync:
    """The expert parameters' synchronisation beside a dense gradient-sync policy (module docstring)."""

    def __init__(self, sync: GradSync, named: list[tuple[str, nn.Parameter]], experts: list[nn.Parameter]) -> None:
        self.sync, self.topo, self.cfg, self.comm = sync, sync.topo, sync.cfg, sync.comm
        self.experts = experts
        self._ids = {id(p) for p in experts}
        self._names = {n: p for n, p in named if id(p) in self._ids}
        self.sharded = sync.shards_gradients  # dense gradients are shards (ZeRO, FSDP)
        self.fsdp = self.sharded and sync.wraps_modules
        self.dp = self.topo.degree("dp_cp")  # expert gradients are divided by every rank's share
        edp = self.dp // self.topo.ep
        self.mode = "replicated" if edp == 1 or not self.sharded else "fsdp" if self.fsdp else "zero"
        if not experts:  # a pipeline stage with no MoE layer (the same on every rank of the stage)
            self.mode = "none"
        # under sequence parallelism each tp rank's experts saw its own tokens: replicated DTensors over tp whose
        # gradients are partial sums (plait.parallel.tensor.local_tokens), summed with the expert-data-parallel ranks
        self.over_tp = self.mode == "replicated" and isinstance(experts[0], DTensor)
        self.optimizer: Any = None
        self._group_of: list[int] = []  # expert group i -> the factory's group index

    def build_optimizer(self, factory: Any, model: nn.Module) -> Any:
        """The dense optimizer (through the policy) and, under a sharding policy, the experts' own."""
        if not self.sharded or self.mode == "none":
            return self.sync.build_optimizer(factory, model)
        cls, defaults, groups = optimizer_recipe(factory(model))
        dense = [(i, {**g, "params": [p for p in g["params"] if id(p) not in self._ids]}) for i, g in enumerate(groups)]
        expert = [(i, {**g, "params": [p for p in g["params"] if id(p) in self._ids]}) for i, g in enumerate(groups)]
        dense = [(i, g) for i, g in dense if g["params"]]
        expert = [(i, g) for i, g in expert if g["params"]]
        if sum(len(g["params"]) for _, g in expert) != len(self.experts):
            raise ExpertParallelError("the optimizer factory must cover the expert parameters (it is called with "
                                      "the model whose experts are sharded over ep)")
        self._dense_index = [i for i, _ in dense]
        self._group_of = [i for i, _ in expert]
        opt = self.sync.build_optimizer(lambda m: cls([g for _, g in dense], **defaults), model)
        if self.mode == "zero":
            p = self.cfg.parallel
            self.optimizer = ZeroOptimizer(model, [g for _, g in expert], cls, group=self.topo.expert_dp_group,
                                           stage=p.zero, bucket_mb=p.bucket_mb, offload=p.offload == "optimizer",
                                           experts=True, grad_divisor=self.dp, **defaults)
            self.optimizer.use_comm(self.comm)
        else:
            self.optimizer = cls([g for _, g in expert], **defaults)
        return opt

    def step(self) -> None:
        """The experts' own optimizer, at the dense groups' scheduled learning rate."""
        if self.optimizer is None:
            return
        groups = self.sync.scheduler_target().param_groups
        for i, g in zip(self._group_of, self.optimizer.param_groups, strict=True):
            src = groups[self._dense_index.index(i)] if i in self._dense_index else groups[0]
            g["lr"] = src["lr"]  # the scheduler moves the dense groups' rate
        self.optimizer.step()

    def set_sync(self, enabled: bool) -> None:
        if self.mode == "zero" and self.optimizer is not None:
            self.optimizer.set_sync(enabled)

    def no_sync(self) -> contextlib.AbstractContextManager:
        if self.mode == "zero" and self.optimizer is not None:
            return self.optimizer.no_sync()
        return contextlib.nullcontext()

    def schedule_context(self) -> contextlib.AbstractContextManager:
        """A pipeline schedule step: the experts' ZeRO optimizer reduces once, in ``finish`` (as the policy's)."""
        return self.no_sync()

    def grads(self) -> list[torch.Tensor]:
        """This rank's expert gradients: whole local experts, or its shards of them under a sharding policy."""
        if self.mode == "zero":
            return [b.grad_shard for b in self.optimizer.buckets]
        if self.mode == "fsdp":
            return [p.grad.to_local() for p in self.experts if p.grad is not None]
        for p in self.experts:  # an expert no token reached still has a zero gradient
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in self.experts]

    def finish(self) -> None:
        """Expert gradients summed over the expert-data-parallel group (and over tp, where each tp rank routed its
        own sequence shard) and divided by the whole data-parallel degree: reduce-scattered by the expert
        ``ZeroOptimizer`` or FSDP2 under sharding, all-reduced here otherwise."""
        if self.mode == "zero":
            self.optimizer.gather_local()  # a zero-bubble weight pass's, written straight into .grad
            self.optimizer.finish_grad_sync()
        elif self.mode == "replicated":
            axes = ("edp", "tp") if self.over_tp else ("edp",)
            many = self.dp > self.topo.ep or self.over_tp
            reduce_in_place(self.grads(), self.comm, self.topo.group(*axes) if many else None, self.dp,
                            "expert gradients")
            if self.over_tp:  # the partial sums are whole now: replicated like the parameters
                for p in self.experts:
                    p.grad = DTensor.from_local(p.grad.to_local(), p.device_mesh, p.placements, run_check=False)

    def norm_pieces(self) -> list[NormPiece]:
        """The expert gradients' squares, summed over the ``ep`` ranks (each holds different experts) and over the
        expert-data-parallel ranks too where those hold shards."""
        if self.mode == "none":  # a stage without experts: nothing to sum (its peers in the stage have none either)
            return []
        sq = sum((g.double().pow(2).sum() for g in self.grads()), torch.zeros((), dtype=torch.float64))
        if self.mode == "replicated":
            group = self.topo.ep_group
        else:  # the shards: every expert-data-parallel rank's, or under hybrid sharding a shard group's
            group = self.topo.group("dp_shard_cp" if self.mode == "fsdp" and self.topo.hybrid else "dp_cp")
        return [(sq, (group,))]

    def zero_grad(self) -> None:
        if self.mode == "zero":
            self.optimizer.zero_grad()
        elif self.mode == "fsdp":
            self.optimizer.zero_grad(set_to_none=True)
        else:  # none, not zeros: a zero gradient kept would take the next backward's partial sums over tp as whole
            for p in self.experts:
                p.grad = None

    # -- state --------------------------------------------------------------------------------------
    def _to_dtensor(self, t: torch.Tensor, p: nn.Parameter) -> Any:
        """A weight or optimizer state of ``p``'s shape as a DTensor of the global ``(E, ...)`` tensor:
        ``Shard(0)`` over ``ep``, and under ZeRO-3 ``Shard(1)`` over the expert-data-parallel axes (the FSDP2 shard
        this rank holds: row-major over those axes, as FSDP2's flattened mesh orders them; under hybrid sharding
        replicated over ``dp_replicate``). Other entries (a step counter) are returned as they are."""
        from torch.distributed.tensor import Replicate, Shard

        if t.shape != p.shape or self.topo.mesh is None:
            return t
        shape = torch.Size(p.global_shape)
        stride = torch.empty(shape, device="meta").stride()
        local = t.to_local() if isinstance(t, DTensor) else t
        axes = ["ep"]
        if self.mode == "fsdp":  # the live expert-data-parallel axes beside ep, in mesh order
            axes = [a for a in ("dp_replicate", "dp_shard", "ep", "cp") if a == "ep" or self.topo.degree(a) > 1]
        kinds = {"ep": Shard(0), "dp_replicate": Replicate() if self.topo.hybrid else Shard(1)}
        mesh = self.topo.mesh[tuple(axes)] if len(axes) > 1 else self.topo.mesh["ep"]
        return DTensor.from_local(local, mesh, [kinds.get(a, Shard(1)) for a in axes], run_check=False, shape=shape,
                                  stride=stride)

    def _from_dtensor(self, v: Any, p: nn.Parameter) -> Any:
        """Inverse of ``_to_dtensor`` after a load: this rank's part, in the form ``p`` holds it."""
        if not hasattr(v, "to_local"):
            return v
        local = v.to_local()
        if not isinstance(p, DTensor) or v.dim() != p.dim():
            return local
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())

    def _expert_state(self) -> dict[str, dict]:
        """The expert optimizer's state keyed by parameter name: full local experts per entry (gathered over
        the expert-data-parallel group from the ZeRO shards), or FSDP's shards under ZeRO-3."""
        names = self._names
        if self.mode == "zero":
            fqn = {self.optimizer._fqn[p]: n for n, p in names.items()}
            return {fqn[k]: dict(st) for k, st in self.optimizer.state_dict()["state"].items()}
        materialize_optimizer_state(self.optimizer)  # a load template needs the tensors
        by_id = {id(p): n for n, p in names.items()}
        order = [p for g in self.optimizer.param_groups for p in g["params"]]
        return {by_id[id(order[i])]: dict(st) for i, st in self.optimizer.state_dict()["state"].items()}

    def state(self, model_sd: dict[str, Any], state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The policy's states with each expert weight and optimizer state as a DTensor of the global ``(E, ...)``
        tensor (``_to_dtensor``), so DCP reshards it to any ``ep`` and ZeRO stage."""
        if self.optimizer is not None:
            state = {**state, **self._expert_state()}
        for name, p in self._names.items():
            if name in model_sd:
                model_sd[name] = self._to_dtensor(model_sd[name], p)
            st = state.get(name)
            if st:  # a new dict: the policy's may be the optimizer's own state
                state[name] = {k: self._to_dtensor(v, p) if torch.is_tensor(v) else v for k, v in st.items()}
        return model_sd, state

    def entries(self, entries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's entries with each expert weight as a DTensor of the global ``(E, ...)`` tensor over this rank's
        storage: a checkpoint's expert tensor is read by the slice this rank holds."""
        for name, p in self._names.items():
            if name in entries:
                entries[name] = self._to_dtensor(entries[name], p)
        return entries

    def load(self, model_sd: dict[str, Any], state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The experts' entries back in the form the model and the experts' optimizer hold them (their states
        loaded into it); returns what is left for the policy."""
        names = self._names

        def local(k: str, v: Any) -> Any:  # only the expert entries: FSDP's own DTensors stay as they are
            return self._from_dtensor(v, names[k]) if k in names else v

        model_sd = {k: local(k, v) for k, v in model_sd.items()}
        state = {k: {kk: local(k, vv) for kk, vv in st.items()} for k, st in state.items()}
        if self.mode == "zero":  # the canonical form ZeroOptimizer reads: full tensors keyed by its names
            zopt = self.optimizer
            fqn = {n: zopt._fqn[p] for n, p in names.items()}
            mine = {fqn[n]: state.pop(n) for n in list(state) if n in names}
            groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(f)}
                      for g, f in zip(zopt.param_groups, zopt._group_fqns, strict=True)]
            zopt.load_state_dict({"state": mine, "param_groups": groups})
        elif self.optimizer is not None:
            order = [p for g in self.optimizer.param_groups for p in g["params"]]
            index = {id(p): i for i, p in enumerate(order)}
            mine = {index[id(names[n])]: state.pop(n) for n in list(state) if n in names}
            self.optimizer.load_state_dict({"state": mine,
                                            "param_groups": self.optimizer.state_dict()["param_groups"]})
        return model_sd, state

    def full(self) -> dict[str, torch.Tensor]:
        """Single-process expert weights: each expert tensor gathered over the ``ep`` group (dim 0 = global index),
        after its FSDP shards over the expert-data-parallel group under ZeRO-3."""
        experts = {}
        for name, p in self._names.items():
            mine = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
            parts = [torch.empty_like(mine) for _ in range(self.topo.ep)]
            dist.all_gather(parts, mine.contiguous(), group=self.topo.ep_group)
            experts[name] = torch.cat(parts)
        return experts

    def report(self) -> dict[str, Any]:
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in self.experts)
        states = (sum(b.chunk for b in self.optimizer.buckets) if self.mode == "zero" else local)
        return {"expert_parallel": {"ep": self.topo.ep, "expert_dp": self.dp // self.topo.ep,
                                    "expert_sharding": self.mode, "expert_params_local": local,
                                    "expert_optimizer_numel_local": states}}
