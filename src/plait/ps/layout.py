"""``PsLayout``: the engine's ``Layout`` for ``parallel.mode = "ps"``, on workers and on servers.

On a worker, ``Plait.step`` runs: ``clip_grad_norm`` (measures the gradient's norm; the servers clip),
``step`` (only when the gradient is finite: marks it for pushing), ``after_step`` (PUSH to every
server, which answers with its parameters when a pull is due; a non-finite gradient is announced
instead, so no server waits for it). Checkpoints keep every layout's format: ``state_dicts`` fetches the servers'
parameters and optimizer states into this worker's model and (never stepped) optimizer and returns
them keyed by the single-process names, so a PS checkpoint loads into data parallelism, ZeRO or
``plait sample``, and any checkpoint loads into a PS run (``load_shared_state`` sends it to the
servers). BatchNorm running statistics are not parameters: each worker keeps its own.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.comm.collectives import Comm
from plait.config import Config
from plait.parallel.layout import ELEMENTWISE, Layout, LayoutError, OptimizerFactory
from plait.ps.roles import PsGroups
from plait.ps.shard import FlatLayout
from plait.ps.worker import PsClient, grad_norm_sq
from plait.topology import Topology
from plait.train.optim import materialize_optimizer_state, optimizer_recipe


class PsLayout(Layout):
    """Parameter-server training (see the module docstring); ``groups`` says who serves."""

    def __init__(self, model: nn.Module, cfg: Config, topo: Topology, comm: Comm, groups: PsGroups) -> None:
        self.model, self.engine, self.topo, self.comm, self.cfg = model, None, topo, comm, cfg
        self.groups = groups
        self._bn: list[torch.Tensor] = []
        self.client: PsClient | None = None
        self.server: Any = None
        self._acc: torch.Tensor | None = None
        self._grad: torch.Tensor | None = None
        self._local_steps = 0
        self._pushed = False
        self._grad_norm_sq: float | None = None

    # -- building ---------------------------------------------------------------------------------
    def build_optimizer(self, factory: OptimizerFactory) -> Any:
        self.optimizer = opt = factory(self.model)
        cls = type(opt)
        if cls.__name__ not in ELEMENTWISE or not cls.__module__.startswith("torch.optim"):
            raise LayoutError(f"parallel.mode=ps runs the optimizer on flat shards of the parameters, which computes "
                              f"the unsharded update only for elementwise optimizers ({', '.join(ELEMENTWISE)} from "
                              f"torch.optim); {cls.__module__}.{cls.__name__} is not one of them")
        g = self.groups
        self.flat = FlatLayout(opt, g.num_servers)
        if self.flat.dtype != torch.float32:
            raise LayoutError(f"parallel.mode=ps sends float32 parameters; the model's are {self.flat.dtype} (keep the "
                              "parameters in float32: train.precision=bf16 computes in bf16 under autocast)")
        if g.is_server:
            self.server = self._build_server(opt)
        else:
            self.client = PsClient(self.flat, g.rank, g.server_ranks, g.p2p)
            if g.rank == 0:
                self.client.init_servers()
            self._install(self.client.pull())
        return opt

    def _build_server(self, opt: torch.optim.Optimizer) -> Any:
        from plait.ps.server import Server
        from plait.ps.state import ShardState

        g = self.groups
        cls, defaults, groups = optimizer_recipe(opt)
        lo, hi = self.flat.shard_range(g.server_index)
        w = torch.zeros(hi - lo, dtype=self.flat.dtype)
        state = ShardState(w, self.flat.segments(g.server_index), cls, defaults, groups, g.num_workers, self.cfg.ps,
                           self.cfg.optim.grad_clip, norm_sum=self._norm_sum)
        return Server(state, g.server_index, g.rank, g.num_workers, g.p2p, len(opt.param_groups))

    def _norm_sum(self, x: float) -> float:
        """A squared norm summed over the servers: one all-reduce of one float64 among them."""
        if self.groups.num_servers == 1:
            return x
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, group=self.groups.servers)
        return float(t[0])

    def serve(self) -> dict[str, Any]:
        """Server ranks: answer the workers until every one has finished; returns the statistics."""
        return self.server.serve()

    @torch.no_grad()
    def _install(self, flat: torch.Tensor) -> None:
        self.flat.unflatten_into(flat.to(self.flat.params[0].device) if self.flat.params else flat)

    # -- one step ---------------------------------------------------------------------------------
    def set_sync(self, enabled: bool) -> None:
        """Gradients stay local until ``step``: nothing to arm."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def finish(self) -> None:
        """Nothing is in flight after backward: the push is the step."""

    def clip_grad_norm(self, max_norm: float) -> float:
        """The norm of this step's gradient (the servers clip what they apply); accumulates the push."""
        grad = self.flat.flatten_grads()
        every = self.cfg.ps.push_every
        self._local_steps += 1
        if every > 1:
            self._acc = grad if self._acc is None else self._acc.add_(grad)
            grad_to_push = self._acc / every if self._local_steps % every == 0 else None
        else:
            grad_to_push = grad
        self._grad = grad_to_push
        norm_sq = grad_norm_sq(grad)
        self._grad_norm_sq = norm_sq if every == 1 else None  # the pushed gradient's, when it is this step's
        return norm_sq ** 0.5

    def _push_due(self) -> bool:
        return self._local_steps % self.cfg.ps.push_every == 0

    def step(self) -> None:
        """The gradient is finite: it will be pushed (in ``after_step``, which runs either way)."""
        self._pushed = self._push_due() and self._grad is not None
        self.optimizer._opt_called = True  # the servers step it: no LR-scheduler order warning

    def after_step(self) -> None:
        """PUSH the gradient (every ``ps.push_every`` steps) with the groups' learning rates, or announce a
        non-finite one (no version waits for it); the servers answer with the parameters when a pull is
        due (every ``ps.pull_every`` pushes)."""
        c = self.client
        if self._push_due():
            lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
            grad = self._grad if self._pushed else None
            pull = (c.clock + 1) % self.cfg.ps.pull_every == 0
            norm_sq = float("inf") if grad is None else (
                self._grad_norm_sq if self._grad_norm_sq is not None else grad_norm_sq(grad))
            # the replies go straight into the parameters (CPU ones: others take the flat copy)
            direct = not self.flat.params or self.flat.params[0].device.type == "cpu"
            params = c.push(grad, norm_sq, lrs, pull=pull, install=direct)
            if params is not None:
                self._install(params)
            self._acc, self._grad, self._pushed = None, None, False

    def zero_grad(self) -> None:
        for p in self.model.parameters():
            p.grad = None

    def step_metrics(self) -> dict[str, Any]:
        """This worker's PS figures of the step just taken: clock, shard versions read, bytes pushed and
        pulled, seconds spent pushing and waiting for pulls; on rank 0 at log steps also every server's
        statistics so far (``ps``: staleness histogram, dropped, rejected, clock gap, utilisation)."""
        c = self.client
        now = {"ps_push_bytes": c.bytes_sent, "ps_pull_bytes": c.bytes_received, "ps_pull_wait_s": c.pull_wait_s,
               "ps_push_s": c.push_s}
        last = getattr(self, "_last_totals", dict.fromkeys(now, 0))
        self._last_totals = now
        out: dict[str, Any] = {"ps_clock": c.clock, "ps_versions": list(c.versions)}
        out.update({k: round(v - last[k], 6) if isinstance(v, float) else v - last[k] for k, v in now.items()})
        every = self.cfg.train.log_every
        if self.topo.rank == 0 and (self._local_steps == 1 or (every and self._local_steps % every == 0)):
            out["ps"] = self.server_stats()
        return out

    def meet(self) -> None:
        """Before a collective among the workers: in backup mode, a version waiting for this worker's
        peers completes with the gradients it holds (they cannot push until the collective ends)."""
        if self.client is not None and self.cfg.ps.mode == "backup":
            self.client.park()

    def server_stats(self) -> dict[str, Any]:
        """Every server's statistics merged (see ``merge_stats``); one request per server."""
        from plait.ps.roles import merge_stats

        return merge_stats(self.client.stats(), self.cfg.ps)

    def report(self, run_dir: Path | None) -> dict[str, Any]:
        """The ``ps`` block of summary.json (rank 0 asks the servers; others return nothing)."""
        if self.topo.rank != 0:
            return {}
        c = self.client
        out = self.server_stats()
        out["worker0"] = {"clock": c.clock, "push_bytes": c.bytes_sent, "pull_bytes": c.bytes_received,
                          "pull_wait_s": round(c.pull_wait_s, 6), "push_s": round(c.push_s, 6)}
        return {"ps": out}

    def close(self) -> None:
        if self.client is not None:
            self.client.finish()

    # -- state ------------------------------------------------------------------------------------
    def _fetch_state(self) -> None:
        """The servers' parameters and optimizer states into this worker's model and optimizer."""
        params, vectors, scalars, self._versions, self._clocks = self.client.get_state()
        self._install(params)
        materialize_optimizer_state(self.optimizer, keep_grads=False)
        per_key = {k: [torch.empty_like(p) for p in self.flat.params] for k in vectors}
        for k, flat in vectors.items():
            self.flat.unflatten_into(flat, per_key[k])
        for i, p in enumerate(self.flat.params):
            st = self.optimizer.state[p]
            for k in vectors:
                st[k].copy_(per_key[k][i].to(st[k].dtype))
            for k, x in scalars.items():
                if torch.is_tensor(st.get(k)):
                    st[k].fill_(x)
                else:
                    st[k] = type(st.get(k, x))(x)

    def state_dicts(self) -> tuple[dict, dict]:
        self._fetch_state()
        return super().state_dicts()

    def shared_state(self) -> dict[str, Any]:
        """Versions and clocks, saved with the checkpoint's shared state (every worker meets first, so no
        push is in flight)."""
        self.meet()
        if dist.is_initialized() and self.groups.num_workers > 1:
            dist.barrier(group=self.groups.workers)
        stats = self.client.stats()
        clocks = [max(s["clocks"][k] for s in stats) for k in range(self.groups.num_workers)]
        return {"versions": [int(s["version"]) for s in stats], "clocks": clocks}

    def load_state_dicts(self, model_sd: dict, optim_sd: dict) -> None:
        super().load_state_dicts(model_sd, optim_sd)

    def load_shared_state(self, ps: dict[str, Any] | None, steps: int) -> None:
        """After a load: worker 0 sends the loaded weights and optimizer state to the servers, with the saved
        versions and clocks (``steps`` for both when the checkpoint came from another layout); then every
        worker pulls."""
        g = self.groups
        versions = [int(v) for v in ps["versions"]] if ps else [steps] * g.num_servers
        same = ps is not None and len(ps["clocks"]) == g.num_workers
        clocks = [int(c) for c in ps["clocks"]] if same else [steps] * g.num_workers
        if g.rank == 0:
            flat = self.flat.flatten_params()
            keys = sorted(k for k, v in self.optimizer.state[self.flat.params[0]].items()
                          if torch.is_tensor(v) and v.dim() > 0) if self.flat.params else []
            vectors = {k: torch.cat([self.optimizer.state[p][k].reshape(-1).float().cpu() for p in self.flat.params])
                       for k in keys}
            first = self.optimizer.state[self.flat.params[0]] if self.flat.params else {}
            scalars = {k: float(v) for k, v in first.items() if k not in vectors}
            self.client.load_state(flat, vectors, scalars, versions, clocks)
        if g.num_workers > 1:
            dist.barrier(group=g.workers)
        self.client.clock = clocks[g.rank]
        self._install(self.client.pull())
        self.optimizer.state.clear()  # the servers hold it; this worker's copy is not used again

    def full_model_state(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The servers' current parameters (pulled fresh) under the single-process names."""
        self._install(self.client.pull())
        return self.model.state_dict()
