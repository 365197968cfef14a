"""Per-step fault tolerance on torchft (``fault.mode = "replicas"``): data-parallel replica groups that survive the
death of one another without a restart or a rollback.

Each data-parallel replica group is a torchft replica group (here: one rank holding the whole model; the launcher
runs each group as its own job, ``plait.fault.replicas``). Its torchft ``Manager`` talks to the Lighthouse and
reconfigures a torchft process group (gloo on CPU) over the groups alive at each step. Per optimizer step:

* at the step boundary (``begin`` at the end of setup, then ``after_step``), ``start_quorum``: the groups alive
  agree on who takes part; a group behind the others (a replacement, or one whose last step did not commit)
  receives a live peer's state first and joins at this boundary. That state is the model's weights, the optimizer
  state and the engine's run state (step count, LR schedule, loss scale, the training loader's position), through
  torchft's checkpoint transport (HTTP between the two processes);
* ``finish``: one all-reduce of every gradient (with BatchNorm running statistics) over the groups in the quorum,
  divided by their number: the mean over the live replicas. A group that died takes no part: the step is the
  live groups' gradients' mean, not a restart and not a rollback;
* ``step``: ``should_commit``, torchft's agreement that the step's collectives succeeded; if not (a peer died
  during them), the update is skipped as a non-finite one would be, and the next quorum heals whoever is behind.

The data: replica group ``g`` of ``G`` reads share ``g`` of every global batch, as data-parallel rank ``g`` of
``G`` would; the share of a dead group is not trained on while it is away.

Communication per step: one all-reduce of the gradients over the live groups (counted in ``comm_bytes`` as the
ring model's ``2 (n - 1) / n`` of the buffer over ``n`` live groups), the quorum's messages to the Lighthouse and
``should_commit``'s to the group's own torchft manager (small RPCs, not counted).

Limits (refused with a message in ``Replicas.check``): a replica group is one rank with the whole model (no
ZeRO, FSDP, HSDP, tensor, pipeline or expert parallelism inside a group yet), plait's reducer settings that
act on a per-step collective of their own (``comm.compress``, ``comm.allreduce``, ``parallel.impl=torch``,
``sync_batchnorm``, ``fault.rebalance``) and DiLoCo. Checkpoints are each group's own (in its run directory).
A heal's state is read with ``torch.load(weights_only=True)`` (torchft's own transport would unpickle it with code
execution). torchft's manager and its checkpoint server listen on every interface of the machine (torchft binds
``[::]`` and ``""``; only the Lighthouse plait starts is on loopback): run replica groups on a trusted network.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch import nn

from plait.comm.collectives import Comm, ring_allreduce_bytes
from plait.config import Config, ConfigError, ParallelConfig
from plait.fault.replicas import LIGHTHOUSE_ENV, replica_group, require_torchft
from plait.observe.log import get_logger
from plait.parallel.apply import ModelSpec
from plait.parallel.data.reducer import LocalGrads
from plait.parallel.data.strategy import DataParallel
from plait.parallel.strategy import PlaitError, Strategy, register_strategy
from plait.topology import Topology


def _weights_only_transport(timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport, reading a peer's state with ``torch.load(weights_only=True)``: torchft's
    own reads it with pickle's code execution (``weights_only=False``), which plait never does. What a heal sends
    (tensors, numbers, strings, lists, tuples, dicts) needs nothing more."""
    import urllib.request

    from torchft.checkpointing._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport

    class WeightsOnlyHTTPTransport(HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                return _streaming_load(f, weights_only=True)

    return WeightsOnlyHTTPTransport(timeout=timeout, num_chunks=0)


class ReplicaTopology(Topology):
    """The topology of one replica group's rank: its own world (the group) for the engine, and its place among the
    groups (``dp``, ``dp_rank``) for the data."""

    group_index: int = 0

    @property
    def dp_rank(self) -> int:
        return self.group_index


def _groups(world_size: int) -> tuple[int, int]:
    """(this process's group, the number of groups): from the launcher's environment, else (0, ``world_size``) when
    a launcher checks the config for ``world_size`` workers before starting them."""
    found = replica_group()
    return found if found is not None else (0, world_size)


@register_strategy
class Replicas(DataParallel):
    """Data-parallel replica groups on torchft (see the module docstring)."""

    name = "replicas"
    priority = 95  # above every collective layout (it refuses to compose with them), below the parameter server

    @classmethod
    def chosen_for(cls, cfg: Config | ParallelConfig) -> bool:
        return isinstance(cfg, Config) and cfg.fault.mode == "replicas"

    @classmethod
    def check(cls, cfg: Config, degrees: dict[str, int]) -> None:
        if cfg.fault.mode != "replicas":
            return
        p, c, f = cfg.parallel, cfg.comm, cfg.fault
        inside = [(f"parallel.zero={p.zero}", p.zero > 0), (f"parallel.tp={p.tp}", p.tp > 1),
                  (f"parallel.pp={p.pp}", p.pp > 1), (f"parallel.ep={p.ep}", p.ep > 1),
                  (f"parallel.dp_shard={p.dp_shard}", p.dp_shard > 1), ("parallel.mode=ps", p.mode == "ps"),
                  ("parallel.sync=diloco", p.sync == "diloco"), ("parallel.impl=torch", p.impl == "torch"),
                  ("parallel.sync_batchnorm", p.sync_batchnorm), (f"comm.compress={c.compress}", c.compress != "none"),
                  (f"comm.allreduce={c.allreduce}", c.allreduce != "backend"), ("fault.rebalance", f.rebalance)]
        refused = [name for name, on in inside if on]
        if refused:
            raise ConfigError(f"fault.mode=replicas runs each replica group as one rank with the whole model, its "
                              f"gradients averaged by torchft; it does not compose with {', '.join(refused)} yet "
                              "(no sharding or model parallelism inside a replica group): remove it, or set "
                              "fault.mode=restart")
        if f.min_replicas < 1 or f.min_replicas > degrees["dp_replicate"]:
            raise ConfigError(f"fault.min_replicas must lie in 1..{degrees['dp_replicate']} (the replica groups); "
                              f"got {f.min_replicas}")
        require_torchft()

    @classmethod
    def resolve_degrees(cls, cfg: Config, world_size: int) -> dict[str, int]:
        found = replica_group()
        if found is not None and world_size != 1:
            raise ConfigError(f"fault.mode=replicas: replica group {found[0]} has {world_size} ranks; a group is one "
                              "rank holding the whole model here (groups sharded inside by ZeRO or FSDP2/HSDP are not "
                              "supported yet): start one process per group (plait run --replicas N, plait train)")
        return {"pp": 1, "dp_replicate": _groups(world_size)[1], "dp_shard": 1, "ep": 1, "tp": 1}

    @classmethod
    def build_topology(cls, cfg: Config, device: torch.device) -> Topology:
        if replica_group() is None:
            raise ConfigError("fault.mode=replicas runs each replica group as its own job: start the script with "
                              "plait run --replicas N SCRIPT (or plait train), which also starts a torchft "
                              "Lighthouse")
        group, _ = _groups(1)
        on = dist.is_available() and dist.is_initialized()
        topo = ReplicaTopology(degrees=cls.resolve_degrees(cfg, dist.get_world_size() if on else 1),
                               rank=dist.get_rank() if on else 0, world_size=1, device=device)
        topo.group_index = group
        return topo

    def __init__(self, model: nn.Module, cfg: Config, topo: Topology, comm: Comm,
                 spec: ModelSpec | None = None) -> None:
        Strategy.__init__(self, model, cfg, topo, comm, spec)
        self.engine = LocalGrads(model)  # gradients stay local until finish() averages them over the live groups
        self.torch_collectives = False
        self._bn = [b for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                    for b in (m.running_mean, m.running_var) if b is not None]
        self.logger = get_logger(topo.rank)
        self.manager: Any = None
        self._run: Any = None
        self._participants = 0  # the groups in the current quorum
        self._step_live = 0  # the groups whose gradients the last step averaged
        self._healed = 0  # heals this process received
        self._in_step = False  # inside after_step: the engine counts the step just taken after it returns
        self._quorum_s = 0.0  # seconds this process waited on torchft's quorums (the first one included)
        self._commit_s = 0.0  # seconds in should_commit

    @property
    def items_ranks(self) -> int:
        """Token counts stay within the group (the groups alive change from step to step; torchft averages the
        gradients over those of the step): each group's loss is the mean over its own real tokens, and the step's
        gradient the mean of these over the live groups (the mean over every token when the groups count as many
        tokens, as full-length batches do)."""
        return 1

    # -- joining -------------------------------------------------------------------------------------
    def begin(self, run: Any) -> None:
        """The torchft manager, then the first quorum: a replacement heals from a live peer here, before its
        first step; at the start of a run every group takes the first group's weights (torchft's init_sync)."""
        require_torchft()
        from torchft import Manager, ProcessGroupGloo

        self._run = run
        f, timeout = self.cfg.fault, timedelta(seconds=self.cfg.comm.timeout_s)
        lighthouse = f.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
        if not lighthouse:
            raise PlaitError("fault.mode=replicas needs a torchft Lighthouse: set fault.lighthouse=http://HOST:PORT, "
                             "or start the run with plait run --replicas N / plait train, which start one")
        # what the other groups reach this one at: loopback when the Lighthouse is local, else this machine's name
        local = urlparse(lighthouse).hostname in ("127.0.0.1", "localhost", "::1")
        host = "127.0.0.1" if local else socket.gethostname()
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)  # this group's own
        connect = timedelta(seconds=min(30.0, self.cfg.comm.timeout_s))
        try:
            self.manager = Manager(
                pg=ProcessGroupGloo(timeout=timeout), load_state_dict=self._heal, state_dict=self._heal_state,
                min_replica_size=f.min_replicas, use_async_quorum=False, timeout=timeout, quorum_timeout=timeout,
                connect_timeout=connect, rank=0, world_size=1, store_addr=host, store_port=store.port,
                lighthouse_addr=lighthouse, replica_id=f"plait_replica_{self.topo.dp_rank}", hostname=host,
                checkpoint_transport=_weights_only_transport(timeout))
            self._store = store
            self._first_quorum()
        except Exception as e:  # torchft's errors name a gRPC status; the user needs the address and the fix
            if self.manager is not None:
                self.manager.shutdown(wait=False)
                self.manager = None
            raise PlaitError(f"fault.mode=replicas: no quorum through the torchft Lighthouse at {lighthouse} (it did "
                             f"not answer within {connect.total_seconds():g} s, or the groups did not meet within "
                             f"comm.timeout_s={self.cfg.comm.timeout_s:g}: {str(e).splitlines()[0][:200]}); start "
                             "a Lighthouse there, or leave fault.lighthouse empty for plait run / plait train to "
                             "start one") from None

    def _first_quorum(self) -> None:
        """At the start of a run every group takes part in the first step (a group still starting would otherwise
        miss the steps a faster one takes alone): quorums are asked again until all groups are in, for up to
        ``comm.timeout_s``. A replacement (its agent restarted it) joins whoever is live at once."""
        self._quorum()
        fresh = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0 and self._run.state()["steps"] == 0
        deadline = time.monotonic() + self.cfg.comm.timeout_s
        while fresh and self._participants < self.topo.dp and time.monotonic() < deadline:
            time.sleep(0.2)
            self._quorum()
        if self._participants < self.topo.dp:
            self.logger.warning("replica group %d starts with %d of %d groups live", self.topo.dp_rank,
                                self._participants, self.topo.dp)

    def _quorum(self) -> None:
        """The quorum of this step (healing this group first if it is behind)."""
        t0 = time.perf_counter()
        self.manager.start_quorum()
        self._participants = self.manager.num_participants()
        self._quorum_s += time.perf_counter() - t0

    def _heal_state(self) -> dict[str, Any]:
        """What a replacement needs to continue as this group (read on torchft's thread while this one waits)."""
        run = self._run.state()
        run["steps"] += int(self._in_step)  # the steps completed at this boundary
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict(), "run": run}

    def _heal(self, state: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        run = dict(state["run"])
        run["steps"] -= int(self._in_step)  # the engine adds the step it is finishing
        self._run.restore(run)
        self._healed += 1
        self.logger.info("replica group %d healed from a live replica: joins at step %d (%.2f s to load)",
                         self.topo.dp_rank, int(state["run"]["steps"]), time.perf_counter() - t0)

    # -- the step ------------------------------------------------------------------------------------
    def finish(self) -> None:
        """Communication: one all-reduce (torchft's, over the groups in this step's quorum) of every gradient and
        BatchNorm running statistic, flattened in float32, divided by the number of live groups. No backward."""
        params = self.trainable()
        grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in params]
        flat = torch.cat([t.reshape(-1).float() for t in grads + self._bn])
        t0 = time.perf_counter()
        self.manager.allreduce(flat).wait()  # torchft divides by the live groups (ReduceOp.AVG)
        self.comm.stats.wait_s += time.perf_counter() - t0
        self._step_live = self._participants
        self.comm.stats.bytes_sent += ring_allreduce_bytes(flat.numel() * 4, self._participants)
        self.comm.stats.calls += 1
        offset = 0
        for q, t in zip(params + [None] * len(self._bn), grads + self._bn, strict=True):
            part = flat[offset:offset + t.numel()].view_as(t).to(t.dtype)
            offset += t.numel()
            if q is not None:
                q.grad = part
            else:
                t.copy_(part)

    def step_unless(self, found: torch.Tensor) -> None:
        """torchft's commit first (every group asks at every step): a step whose collectives failed skips its update
        like a non-finite one (``found`` set), and the next quorum heals whoever is behind."""
        t0 = time.perf_counter()
        committed = self.manager.should_commit()
        self._commit_s += time.perf_counter() - t0
        if not committed:
            self.logger.warning("replica group %d: step not committed (a replica was lost during it); update "
                                "skipped", self.topo.dp_rank)
            found.fill_(1.0)
        super().step_unless(found)

    def after_step(self) -> None:
        """The next step's quorum, at this step boundary (where a replacement joins)."""
        self._in_step = True
        try:
            self._quorum()
        finally:
            self._in_step = False

    def step_metrics(self) -> dict[str, Any]:
        return {"replicas_live": self._step_live, "replica_heals": self._healed,
                "replica_step": self.manager.current_step(), "replica_quorum_s_total": round(self._quorum_s, 4),
                "replica_commit_s_total": round(self._commit_s, 4)}

    def describe(self) -> str:
        return f"torchft replica group {self.topo.dp_rank} of {self.topo.dp}"

    def close(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None
