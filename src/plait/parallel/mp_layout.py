"""Tensor and pipeline parallelism behind the trainer's ``Layout`` interface.

``TensorLayout``: the GPT sharded over the ``tp`` axis (Megatron layout on DTensor), data parallel over
the dp axis with plait's reducer (which copies DTensor gradient shards into its buckets).

``PipelineLayout``: the (possibly tensor-parallel) GPT split into stages over the ``pp`` axis and driven
by a ``torch.distributed.pipelining`` schedule; each accumulation micro-batch is one schedule step over
``parallel.microbatches`` pipeline micro-batches. The loss exists only on the last stage's rank; it is
summed over the pp group so every rank can log it.

``TensorFsdpLayout``: 2-D, the tensor-parallel GPT sharded again over dp with FSDP2 (ZeRO-3).

Gradient clipping with a mix of sharded and replicated parameters: each parameter's squared norm is
summed over the mesh axes it is sharded on (tp for Megatron shards, dp for FSDP shards), replicated
ones count once, and the stages' sums are added over the pp group, with the last stage's copy of the
tied embedding left out (it is the same parameter as the first stage's).

Checkpoints use one format for every layout: model entries and optimizer states keyed by the
single-process model's parameter names. Here the optimizer state tensors themselves are handed to
DCP, which loads into them in place; the pipeline's copy of the tied table takes its state under
``tok_emb.weight``, the name that parameter has in the single-process model.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard  # FSDP2's dp shard of a tp shard

from plait.comm.collectives import Comm
from plait.config import Config
from plait.parallel.data import GradReducer, LocalGrads, local_grad
from plait.parallel.layout import AmpFactory, Layout
from plait.parallel.pipeline import build_pipeline, gpt_loss, measure_layer_costs
from plait.parallel.pipeline_trace import bubble_summary, write_chrome_trace
from plait.parallel.tensor import full_state_dict, local_value, loss_context
from plait.topology import Topology
from plait.train.optim import adamw, materialize_optimizer_state


@dataclass
class ScaledLoss:
    """The pipeline's loss function: mean cross-entropy times ``factor`` (1 / accumulation x loss
    scale), set by the layout before each schedule step. With ``record`` set, the unscaled losses are
    also appended to it."""

    factor: float = 1.0
    record: list[torch.Tensor] | None = None

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = gpt_loss(logits, targets)
        if self.record is not None:
            self.record.append(local_value(loss.detach()))
        return loss * self.factor


def sum_sharded_squares(pairs: Iterable[tuple[nn.Parameter, torch.Tensor]]) -> torch.Tensor:
    """Sum of squared gradient entries over every rank's shards, as a float64 scalar on every rank.

    ``pairs`` are (parameter, local gradient shard). A DTensor's local sum counts once per mesh axis it is
    replicated on and must be summed over each axis it is sharded on (tp for a Megatron shard, dp for an
    FSDP shard, both for a 2-D one): parameters are grouped by that set of axes, and each group's sum is
    all-reduced over those axes' groups. Plain tensors are replicated: their local sum is the sum.
    """
    groups: dict[tuple, torch.Tensor] = {}
    axes: dict[tuple, list[dist.ProcessGroup]] = {}
    for p, g in pairs:
        key: tuple = ()
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            dims = [i for i, pl in enumerate(p.placements) if pl.is_shard() or isinstance(pl, _StridedShard)]
            key = (id(mesh), *dims)
            axes.setdefault(key, [mesh.get_group(i) for i in dims])
        groups[key] = groups.get(key, torch.zeros((), dtype=torch.float64)) + g.detach().double().pow(2).sum()
    total = torch.zeros((), dtype=torch.float64)
    for key, sq in groups.items():
        for group in axes.get(key, []):
            dist.all_reduce(sq, group=group)
        total += sq
    return total


class ModelParallelLayout(Layout):
    """Shared parts of the tensor and pipeline layouts (see the module docstring)."""

    torch_collectives = True

    named: list[tuple[str, nn.Parameter]]  # (single-process name, parameter), each parameter once
    tied_copy: nn.Parameter | None = None  # the last pipeline stage's copy of tok_emb.weight

    def _init_common(self, cfg: Config, topo: Topology, comm: Comm, holder: nn.Module) -> None:
        self.topo = topo
        o = cfg.optim
        self.optimizer = adamw(self.named, o)
        self.engine = GradReducer(holder, topo.dp_group, comm, cfg.parallel.bucket_mb) if topo.dp > 1 \
            else LocalGrads(holder)

    def grads(self) -> list[torch.Tensor]:
        return [g for _, p in self.named if (g := local_grad(p)) is not None]

    def zero_grad(self) -> None:
        for _, p in self.named:
            p.grad = None

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global gradient norm over tp shards, FSDP dp shards and pp stages; scales the local gradients
        in place. Communication: one all-reduce per (sharding pattern, mesh axis) pair, then one over pp."""
        total = sum_sharded_squares((p, g) for _, p in self.named
                                    if (g := local_grad(p)) is not None and p is not self.tied_copy)
        if self.topo.degree("pp") > 1:
            dist.all_reduce(total, group=self.topo.group("pp"))
        norm = float(total.sqrt())
        if norm == norm and norm != float("inf"):
            coef = min(1.0, max_norm / (norm + 1e-6))
            if coef < 1.0:
                for g in self.grads():
                    g.mul_(coef)
        return norm

    def state_dicts(self) -> tuple[dict, dict]:
        materialize_optimizer_state(self.optimizer)
        state = {}
        for name, p in self.named:
            key = "tok_emb.weight" if p is self.tied_copy else name
            state[key] = self.optimizer.state[p]
        return self.model_state(), {"state": state}

    def load_state_dicts(self, model_sd: dict, optim_sd: dict) -> None:
        """DCP loaded in place into the tensors ``state_dicts`` handed out. Where one rank holds both ends
        of the pipeline's tied table, only one of the two parameters' states was in the template."""
        if self.tied_copy is None:
            return
        first = next((p for n, p in self.named if n == "tok_emb.weight" and p is not self.tied_copy), None)
        if first is not None:
            for k, v in self.optimizer.state[self.tied_copy].items():
                self.optimizer.state[first][k].copy_(v)


class TensorLayout(ModelParallelLayout):
    """A tensor-parallel GPT (already sharded by ``apply_tensor_parallel``), data parallel over dp."""

    def __init__(self, model: nn.Module, cfg: Config, topo: Topology, comm: Comm) -> None:
        self.model = self.module = model
        self.named = list(self.model.named_parameters())
        self._init_common(cfg, topo, comm, self.model)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, factor: float, amp: AmpFactory,
                         times: dict[str, float]) -> torch.Tensor:
        with loss_context(self.model):  # forward and backward both inside it (loss parallel)
            return local_value(super().forward_backward(x, y, factor, amp, times))

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor, amp: AmpFactory) -> torch.Tensor:
        with loss_context(self.model):
            return local_value(super().evaluate(x, y, amp))

    def model_state(self) -> dict:
        return self.model.state_dict()

    def full_model_state(self) -> dict[str, torch.Tensor]:
        return full_state_dict(self.model)


class TensorFsdpLayout(TensorLayout):
    """2-D: the tensor-parallel GPT sharded again over dp with FSDP2 (ZeRO-3), on one (dp, tp) mesh.

    ``fully_shard`` on the dp axis turns each tensor-parallel DTensor into a 2-D DTensor: dim 0 sharded
    over dp, its Megatron placement kept over tp (parameters that tensor parallelism left plain become
    1-D dp shards). Forward all-gathers a block's dp shards, so each rank runs the tensor-parallel block on
    its own data; backward reduce-scatters the gradients over dp (``plait.parallel.fsdp``). The optimizer
    holds only this rank's 1/(dp*tp) of the states; clipping sums the squares over both axes.
    """

    def __init__(self, model: nn.Module, cfg: Config, topo: Topology) -> None:
        from plait.parallel.fsdp import apply_fsdp

        p, o = cfg.parallel, cfg.optim
        param_dtype = torch.bfloat16 if cfg.train.precision == "bf16" else None
        self.model = self.module = apply_fsdp(model, topo.mesh["dp_replicate"], param_dtype=param_dtype,
                                              offload=p.offload, reshard_after_forward=p.reshard_after_forward)
        self.named = list(self.model.named_parameters())
        self.topo = topo
        self.engine = None
        self.optimizer = adamw(self.named, o)

    def no_sync(self) -> AbstractContextManager:
        from plait.parallel.fsdp import no_gradient_sync

        return no_gradient_sync(self.module)

    def finish(self) -> None:
        """FSDP2 waits for its reduce-scatters at the end of backward."""


class PipelineLayout(ModelParallelLayout):
    """The GPT (tensor-parallel already, or not) split into pipeline stages over the pp axis."""

    def __init__(self, model: nn.Module, cfg: Config, topo: Topology, comm: Comm,
                 sample: tuple[torch.Tensor, torch.Tensor]) -> None:
        p = cfg.parallel
        costs = None
        if p.pp_balance == "cost":
            x, y = sample
            mb = max(1, x.size(0) // p.microbatches)
            costs = measure_layer_costs(model, x[:mb], y[:mb], repeats=2)
        self.loss_fn = ScaledLoss()
        self.schedule = p.pp_schedule
        self.runner = build_pipeline(model, topo.mesh["pp"], schedule=p.pp_schedule, microbatches=p.microbatches,
                                     virtual_stages_per_rank=p.pp_virtual_stages or None, loss_fn=self.loss_fn,
                                     costs=costs, scale_grads=False)
        holder = nn.ModuleList(self.runner.modules)
        self.model = self.module = holder
        seen: set[int] = set()
        self.named = []
        for m in self.runner.modules:
            for name, param in m.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    self.named.append((name, param))
        if self.runner.tied_shape is not None:
            self.tied_copy = next((m.head.weight for m in self.runner.modules if m.is_last), None)
            # In the single-process model this parameter is tok_emb.weight: same name for its optimizer
            # group (no weight decay) and its checkpointed state.
            self.named = [("tok_emb.weight" if q is self.tied_copy else n, q) for n, q in self.named]
        self._init_common(cfg, topo, comm, holder)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, factor: float, amp: AmpFactory,
                         times: dict[str, float]) -> torch.Tensor:
        """One schedule step over the micro-batch ``(B, T)``; returns the unscaled mean loss (0 on ranks
        without the last stage). Forward and backward interleave, so all of it counts as backward_s."""
        t0 = time.perf_counter()
        # The schedule does not average over pipeline micro-batches (scale_grads=False): the loss does.
        self.loss_fn.factor = factor / self.runner.microbatches
        # Every pipeline micro-batch runs its own backward, so the reducer's end-of-backward callback
        # would fire after the first one: gradients are reduced in finish() instead, after the whole
        # step (no overlap of the data-parallel reduction with the pipeline's backward).
        with amp(), self.engine.no_sync():
            loss = self.runner.step(x, y, sync_tied=False)  # tied table: once per optimizer step, in finish()
        times["backward_s"] += time.perf_counter() - t0
        return loss / self.loss_fn.factor if loss is not None else torch.zeros(())

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor, amp: AmpFactory) -> torch.Tensor:
        """Mean validation loss of the micro-batch on the last stage's rank (0 elsewhere)."""
        if self.schedule == "zbv":
            return self._evaluate_by_zero_step(x, y, amp)
        self.loss_fn.factor = 1.0
        losses: list | None = [] if self.runner.has_last else None
        sched = self.runner.schedule
        with loss_context(self.runner.loss_parallel), amp():
            if self.runner.has_first:
                sched.eval(x, target=y if self.runner.has_last else None, losses=losses)
            else:
                sched.eval(target=y if self.runner.has_last else None, losses=losses)
        if not losses:
            return torch.zeros(())
        return torch.stack([local_value(v.detach()) for v in losses]).mean()

    def _evaluate_by_zero_step(self, x: torch.Tensor, y: torch.Tensor, amp: AmpFactory) -> torch.Tensor:
        """The zero-bubble V schedule's forward-only mode fails in torch 2.13 ("can't steal_bwd_input if
        this stage doesn't have backward"), so evaluation runs a full step with the loss multiplied by 0,
        records the unscaled losses, and drops the (zero) gradients: twice the cost of a forward pass,
        same numbers."""
        self.loss_fn.factor, self.loss_fn.record = 0.0, []
        try:
            with torch.enable_grad(), self.no_sync(), amp():
                self.runner.step(x, y, sync_tied=False)
            values = self.loss_fn.record
        finally:
            self.loss_fn.factor, self.loss_fn.record = 1.0, None
        self.zero_grad()
        return torch.stack(values).mean() if values else torch.zeros(())

    def finish(self) -> None:
        """Data-parallel reduction, then the tied table's gradient summed across the first and last
        stage: once per optimizer step, after all accumulation micro-steps (both are sums, so their
        order does not matter)."""
        self.engine.finish()
        self.runner.sync_tied_grads()

    def report(self, run_dir: Path) -> dict[str, Any]:
        """Bubble accounting of the last pipeline step and ``pipeline_trace.json`` (collective over pp).

        Each stage's measured idle fraction (1 - busy / step span) next to the theoretical
        (p-1)/(v*m+p-1); the trace holds every forward/backward of every micro-batch on every stage."""
        gathered = self.runner.gather_timeline()
        if gathered is None or self.topo.rank != 0:
            return {}
        events, spans = gathered
        r = self.runner
        write_chrome_trace(run_dir / "pipeline_trace.json", events, spans)
        summary = bubble_summary(events, spans, r.microbatches, r.virtual_stages, self.topo.degree("pp"))
        return {"pipeline": {"schedule": self.schedule, **summary, "trace": "pipeline_trace.json"}}

    def reduce_loss(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the pp group: brings the last stage's loss to every pipeline rank."""
        t = t.detach().double().reshape(1)
        dist.all_reduce(t, group=self.topo.group("pp"))
        return t[0]

    def model_state(self) -> dict:
        return self.runner.state_dict()

    def full_model_state(self) -> dict[str, torch.Tensor]:
        """Full weights gathered to every rank: stage entries all-gathered over pp, tp shards gathered."""
        mine = {k: local_value(v).detach().cpu() for k, v in self.runner.state_dict().items()}
        parts: list = [None] * self.topo.degree("pp")
        dist.all_gather_object(parts, mine, group=self.topo.group("pp"))
        full: dict[str, torch.Tensor] = {}
        for part in parts:
            full.update(part)
        return full
