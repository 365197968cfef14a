"""``ParameterServer``: the layout of ``parallel.mode = "ps"``, on workers and on servers: data parallelism with its own
consistency (``ps.mode``), so it composes with no collective gradient-sync policy and no model-parallel dimension
(``plait.ps.roles.check_ps``); a ``plait.parallel.layout.Layout`` of its own whose serving ranks, pace and part in a
checkpoint are the layout's optional capabilities (``Serving``, ``OwnPace``, ``CheckpointJoin``).

Its topology spans the workers only (``plait.ps.roles``): the engine's collectives (logging, evaluation,
the step agreement in sync modes) run among them, while the servers serve from ``start`` (called by
``Plait.setup`` once the optimizer is built) until every worker has finished, then end with ``ServerDone``.
On a worker, ``Plait.step`` runs ``clip_and_step``: ``_clip_grad_norm`` (measures the gradient's norm; the
servers clip), ``_step`` (only when the gradient is finite: marks it for pushing), then the PUSH to every
server, with the learning rates of this step (the LR scheduler steps after it), which answers with its
parameters when a pull is due; a non-finite gradient is announced instead, so no server waits for it. Where
the workers meet at every step (sync, ssp with staleness 0) the norm ``Plait.step`` reports is the applied
update's (the mean gradient's, as all-reduce data parallelism reports it; inf when a worker's gradient was
non-finite and the version advanced without a step), so every worker logs, skips and schedules alike; in the
other modes it is the worker's own gradient's. Checkpoints keep every layout's format and are written by the
servers: ``begin_save`` asks every server to join the save (after this worker's last push), then
workers and servers run ``save_state`` together on a gloo group of every rank, each server writing
only its own shard's pieces of the parameters and optimizer states, with its version and the clocks,
under the single-process names (``plait.ps.checkpoint``); worker 0 writes the buffers. So a PS
checkpoint loads into data parallelism, ZeRO or one process, and any checkpoint, of any layout or
number of servers, loads into a PS run: the servers read their own pieces (``begin_load``), then every
worker takes its clock from the servers and pulls (``state.finish_load``). A worker's part of a checkpoint, its
full state and its export (pulled fresh from the servers) are its ``state`` (``plait.ps.layout_state.PsState``).
A worker never holds optimizer state. BatchNorm running statistics are not parameters: each worker keeps its own
(worker 0's are saved).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.checkpoint.dcp import load_state, save_state
from plait.comm.collectives import Comm
from plait.components.optim import optimizer_recipe
from plait.config import Config
from plait.observe.log import get_logger
from plait.parallel.grad_sync import ELEMENTWISE, GradSync, LayoutError, OptimizerFactory
from plait.parallel.layout import Layout
from plait.parallel.meta_init import ModelFacts
from plait.parallel.stages import WholeModel
from plait.ps.checkpoint import ServerCheckpoint, param_names
from plait.ps.layout_state import PsState, install
from plait.ps.protocol import Op
from plait.ps.roles import PsTopology, ServerDone, check_ps, make_groups, merge_stats, ps_topology
from plait.ps.server import Server
from plait.ps.shard import FlatLayout
from plait.ps.state import ShardState
from plait.ps.worker import PsClient, grad_norm_sq
from plait.topology import Topology


def ps_layout_topology(cfg: Config, device: torch.device) -> Topology:
    """The topology of a parameter-server run: the workers are the data-parallel ranks; the servers hold no batch."""
    return ps_topology(make_groups(cfg.ps.servers), device)


def ps_degrees(cfg: Config, world_size: int) -> dict[str, int]:
    """The workers are the data-parallel ranks; the servers hold no batch."""
    return {"pp": 1, "dp_replicate": check_ps(cfg, world_size), "dp_shard": 1, "ep": 1, "tp": 1}


class ParameterServer(Layout):
    """Parameter-server training (see the module docstring); the topology's ``groups`` say who serves. No
    composition (``check_ps`` allows data parallelism over the workers only) and no broadcast: worker 0's weights go
    to the servers in ``build_optimizer`` and every worker pulls them."""

    def __init__(self, model: nn.Module, cfg: Config, topo: Topology, comm: Comm) -> None:
        assert isinstance(topo, PsTopology)
        policy = GradSync(cfg, topo, comm, None, 1)  # nothing is communicated in backward: the push is the step
        super().__init__(WholeModel(model, cfg.train.compute_precision, topo.device), policy, cfg, topo, comm,
                         ModelFacts.of(model))
        self.groups = topo.groups
        self.client: PsClient | None = None
        self.server: Any = None
        self._acc: torch.Tensor | None = None
        self._grad: torch.Tensor | None = None
        self._local_steps = 0
        self._pushed = False
        self._grad_norm_sq: float | None = None
        self.state = PsState(self)

    # -- building ---------------------------------------------------------------------------------
    def build_optimizer(self, factory: OptimizerFactory) -> Any:
        self.policy.optimizer = opt = factory(self.model)
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
            # sync and backup apply a version of the whole model: one version per push to every server
            self.client = PsClient(self.flat, g.rank, g.server_ranks, g.p2p,
                                   one_version=self.cfg.ps.mode in ("sync", "backup"))
            if g.rank == 0:
                self.client.init_servers()
            install(self.flat, self.client.pull())
        return opt

    def _build_server(self, opt: torch.optim.Optimizer) -> Any:
        g = self.groups
        cls, defaults, groups = optimizer_recipe(opt)
        lo, hi = self.flat.shard_range(g.server_index)
        w = torch.zeros(hi - lo, dtype=self.flat.dtype)
        state = ShardState(w, self.flat.segments(g.server_index), cls, defaults, groups, g.num_workers, self.cfg.ps,
                           self.cfg.optim.grad_clip, norm_sum=self._norm_sum)
        return Server(state, g.server_index, g.rank, g.num_workers, g.p2p, len(opt.param_groups),
                      checkpoint=self._server_checkpoint)

    def _norm_sum(self, x: float) -> float:
        """A squared norm summed over the servers: one all-reduce of one float64 among them."""
        if self.groups.num_servers == 1:
            return x
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, group=self.groups.servers)
        return float(t[0])

    def start(self, leaving: Callable[[], None]) -> None:
        """A server rank answers the workers until every one has finished, then ends with ``ServerDone``
        (exit status 0): servers never run the user's loop. A worker goes on."""
        if not self.groups.is_server:
            return
        leaving()  # a server waits for as long as the workers compute: no step phases to bound
        stats = self.server.serve()
        get_logger(self.groups.rank).info("parameter server %d: done after %d updates", self.groups.server_index,
                                          stats["updates"])
        raise ServerDone(stats)

    # -- one step ---------------------------------------------------------------------------------
    # gradients stay local until ``_step`` and nothing is in flight after backward (the push is the step):
    # set_sync and finish are the no-op policy's

    def _clip_grad_norm(self, max_norm: float) -> float:
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

    def _step(self) -> None:
        """The gradient is finite: it will be pushed (by ``clip_and_step``, which pushes either way)."""
        self._pushed = self._push_due() and self._grad is not None
        self.optimizer._opt_called = True  # the servers step it: no LR-scheduler order warning

    def clip_and_step(self, max_norm: float, scaler: Any, before_step: Callable[[], None]) -> tuple[float, bool]:
        """Measure and mark the gradient (the base class's, on the host: the push sends the norm), then push it
        now: the learning rates sent are this step's, since the engine steps the LR scheduler once this returns.
        Returns (norm, skipped): the applied update's where the workers meet at every step (see the module
        docstring), else this worker's own."""
        norm, skipped = super().clip_and_step(max_norm, scaler, before_step)  # _clip_grad_norm measures, _step marks
        applied = self._push()
        if applied is not None and self.agreement_group(None)[0]:
            norm = applied ** 0.5
            skipped = not math.isfinite(norm)
        return norm, skipped

    def _push(self) -> float | None:
        """PUSH the gradient (every ``ps.push_every`` steps) with the groups' learning rates, or announce a
        non-finite one (no version waits for it); the servers answer with the parameters when a pull is
        due (every ``ps.pull_every`` pushes). Returns the squared norm of the update the pulled parameters
        come from (None: nothing pulled)."""
        c = self.client
        if not self._push_due():
            return None
        lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        grad = self._grad if self._pushed else None
        pull = (c.clock + 1) % self.cfg.ps.pull_every == 0
        norm_sq = float("inf") if grad is None else (
            self._grad_norm_sq if self._grad_norm_sq is not None else grad_norm_sq(grad))
        # the replies go straight into the parameters (CPU ones: others take the flat copy)
        direct = not self.flat.params or self.flat.params[0].device.type == "cpu"
        params = c.push(grad, norm_sq, lrs, pull=pull, install=direct)
        if params is not None:
            install(self.flat, params)
        self._acc, self._grad, self._pushed = None, None, False
        return c.applied_norm_sq if pull else None

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

    def agreement_group(self, default: Any) -> tuple[bool, Any]:
        """The workers meet at every step only in sync mode (and ssp with staleness 0, which is sync): the
        others run at their own pace (their loss is their own; a stop request is seen by the rank that got it)."""
        ps = self.cfg.ps
        return ps.mode == "sync" or (ps.mode == "ssp" and ps.staleness == 0), default

    def before_collective(self) -> None:
        self._meet()

    def checkpoint_group(self, default: Any) -> Any:
        return self.groups.world  # the servers join the checkpoint's collectives and write their own shards

    def _meet(self) -> None:
        """Before a collective among the workers: in backup mode, a version waiting for this worker's
        peers completes with the gradients it holds (they cannot push until the collective ends)."""
        if self.client is not None and self.cfg.ps.mode == "backup":
            self.client.park()

    def server_stats(self) -> dict[str, Any]:
        """Every server's statistics merged (see ``merge_stats``); one request per server."""
        return merge_stats(self.client.stats(), self.cfg.ps)

    def report(self, run_dir: Path | None, measured: dict[str, int] | None, device: torch.device) -> dict[str, Any]:
        """The ``ps`` block of summary.json (rank 0 asks the servers; others return nothing). No memory block:
        its all-gather would span the world, where the servers have ended."""
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

    # -- its part in a checkpoint (CheckpointJoin); the worker's own part is ``state`` ------------
    def begin_save(self, path: Path) -> None:
        """Before ``save_state``: ask every server to join the save at ``path`` (after this worker's last
        push, so the server has applied it); the servers write their shards (``plait.ps.checkpoint``)."""
        self._meet()
        self.client.checkpoint(Op.SAVE, {"path": str(path)})

    def begin_load(self, path: Path, verify: bool) -> None:
        """Before ``load_state``: ask every server to join the load from ``path``."""
        self.client.checkpoint(Op.LOAD, {"path": str(path), "verify": verify})

    def _server_checkpoint(self, op: Op, args: dict[str, Any]) -> None:
        """A server's part of a checkpoint save or load (collective with every rank; see ``begin_save``)."""
        g, st = self.groups, self.server.state
        ckpt = ServerCheckpoint(st, self.flat, param_names(self.model, self.flat), g.server_index, g.num_workers,
                                loading=op == Op.LOAD)
        if op == Op.SAVE:
            save_state(Path(args["path"]), ckpt, {}, g.rank, group=g.world)
            return
        _, _, shared = load_state(Path(args["path"]), ckpt, g.rank, restore_rank=False, verify=bool(args["verify"]),
                                  group=g.world)
        st.restored(*ckpt.versions_and_clocks(int(shared.get("steps", 0))))

    def describe(self) -> str:
        return "data-parallel" if self.topo.dp > 1 else ""
