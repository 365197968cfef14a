"""Per-step fault tolerance on torchft (``fault.mode = "replicas"``): data-parallel replica groups that survive the
death of one another without a restart or a rollback.

Each data-parallel replica group is a torchft replica group of R ranks (``parallel.dp_replicate`` groups of
``nproc / dp_replicate`` ranks; by default one group per ``tp x pp`` ranks, one rank each without them). The
launcher runs each group as its own job (``plait.fault.replicas``), so inside a group the ranks are a world of their
own, and the group trains with the layout its settings choose, built on that world as any run's would be: data
parallelism with plait's reducer (``parallel.zero=0``), ZeRO-1/2 (plait's sharded optimizer), FSDP2 (``zero=3``) or
HSDP (``zero=3`` with ``parallel.dp_shard`` dividing the group's data-parallel ranks), with tensor parallelism
(``parallel.tp``), pipeline parallelism (``parallel.pp``), context parallelism (``parallel.cp``) and expert
parallelism (``parallel.ep``, the experts spread over the group's data-parallel ranks) inside it as well
(torchtitan runs FSDP, tp, pp and cp inside torchft replica groups the same way): a group of R ranks is
``tp x pp x cp x`` its own data-parallel degree, which ep divides.
``Replicas`` is a driver around that layout (``plait.parallel.layout.Driver``): it wraps the step from outside. Every
rank runs a torchft ``Manager`` (its rank and world are its group's; group rank 0 hosts the group's manager server, the
others reach it through the group's own store); torchft's process group pairs rank k of every live group, and rank k of
every group has the same place on its group's mesh, so each rank averages with its peers holding the same shards: the
same tensor-parallel shard, the same pipeline stage, the same ZeRO or FSDP shard, the same experts, the same shard
of each sequence. Per optimizer step:

* at the step boundary (``begin`` at the end of setup, then ``after_step``), ``start_quorum`` on every rank: the
  groups alive agree on who takes part; a group behind the others (a replacement, or one whose last step did not
  commit) heals first and joins at this boundary: each of its ranks receives rank k's state of a live group, its
  own shards (the model's entries, the optimizer states, as plain local tensors) and the run state (step count, LR
  schedule, loss scale, the training loader's position: the group's), through torchft's checkpoint transport (HTTP
  between the two processes);
* ``finish``: the group's own gradient synchronisation (the reducer's all-reduce, ZeRO's reduce-scatter, FSDP2's
  reduce-scatter in backward, over the group's data-parallel x cp ranks; a pipeline's tied copies summed over its
  stages; the experts' gradients summed over the ranks holding the same experts), then one torchft all-reduce per
  rank of what the optimizer will read (the whole gradients, ZeRO's gradient shards, FSDP2's or tensor
  parallelism's local gradient shards, a pipeline stage's gradients, this rank's experts' gradients or shards; with
  BatchNorm running statistics) over the groups in the quorum, divided by their number: the mean over the live
  replicas; with MoE layers balanced by bias, their expert loads summed over the groups too (every group then moves
  its biases alike, after the step and before the next quorum, as one process would). A group that died takes no part:
  the step is the live groups' gradients' mean, not a restart and not a rollback;
* ``step``: ``should_commit``, torchft's agreement (over every rank of the group) that the step's collectives
  succeeded; if not (a peer died during them), the update is skipped as a non-finite one would be, and the next
  quorum heals whoever is behind.

At the start of a run torchft names each group rank's heal source on its own (rank k of every group may take group
k's state), so after the first quorum the ranks of a group that hold the same tensor take group rank 0's copy of it
(those of one pipeline stage along the mesh axes the tensor is not sharded on: every axis for a dense weight
without tensor parallelism, cp's included; not ep for an expert weight), and a pipeline's tied copies take
the first stage's (``_agree_in_group``): the groups then start from one model, whose tensor-parallel shards and
pipeline stages may come from different groups' initial weights.

The data: data-parallel rank j of replica group g (of G groups with D data-parallel ranks each: R / (tp x pp x cp),
ep's ranks among them) reads share ``g D + j`` of every global batch, as data-parallel rank ``g D + j`` of ``G D``
would (the ranks of one tensor-parallel group, pipeline or cp group read the same samples; the cp ranks cut each
sequence); the shares of a dead group are not trained on while it is away.

Communication per step: the group's own (as its layout alone), then one all-reduce per rank over the live groups of
its gradients or gradient shards (counted in ``comm_bytes`` as the ring model's ``2 (n - 1) / n`` of the buffer over
``n`` live groups; one more of the expert loads under bias balancing), the quorum's messages to the Lighthouse and
``should_commit``'s to the group's manager server (small RPCs, not counted).

Under DiLoCo (``parallel.sync = "diloco"``) each group is one DiLoCo replica: ``finish`` averages nothing over the
groups (each trains alone for H steps); DiLoCo's outer all-reduce of the pseudo-gradients goes through this driver
(``replica_mean``: torchft's all-reduce over the groups in the quorum, then ``should_commit``, so that a
synchronisation some peer did not finish is dropped by every rank of the group); the vote of an inner step comes after
it (nothing of torchft ran before it) and keeps torchft's step count the run's; and a heal carries DiLoCo's own state
(``plait.parallel.capabilities.Healing``: the outer momentum, the place in the period; the model's entries are its
start weights).

Settings of the group's own gradient synchronisation act inside it, before this average: ``comm.compress``,
``comm.allreduce``, ``parallel.impl=torch`` (DDP), ``sync_batchnorm`` (over the group's batch: the groups never meet in
a forward), a named ``parallel.strategy``. Compression state is not healed: a replacement group starts it afresh (zero
residuals, PowerSGD's Q from the seed), as a run's first step; a peer's residuals are its own unsent gradients. Limits
(refused in ``check_replicas``): a parameter server and ``fault.rebalance`` (for what they mean: the groups meet only in
this average, each with its fixed share), the settings above in groups of one data-parallel rank (no synchronisation of
their own), ZeRO in groups of one rank to shard over, and groups whose ranks ``tp x pp x cp x ep`` does not divide.
Checkpoints are each group's own (in its run directory, sharded as its layout shards them). A heal's state is read with
``torch.load(weights_only=True)`` (torchft's own transport would unpickle it with code execution). torchft's manager and
its checkpoint server listen on every interface of the machine (torchft binds ``[::]`` and ``""``; only the Lighthouse
plait starts is on loopback): run replica groups on a trusted network.
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

from plait.comm.collectives import ring_allreduce_bytes
from plait.config import Config
from plait.fault.replica_events import QuorumRecorder, ReplicaEvents
from plait.fault.replicas import LIGHTHOUSE_ENV, replica_group, require_torchft
from plait.nn.moe import moe_layers
from plait.observe.log import get_logger
from plait.parallel.capabilities import Driver, Healing
from plait.parallel.errors import PlaitError
from plait.parallel.layout import Layout
from plait.parallel.replicas.heal import held_alike, local_part, optimizer_template, weights_only_transport
from plait.parallel.units import batchnorm_buffers
from plait.parallel.zero.optimizer import ZeroOptimizer
from plait.runtime.dist import agent_restarts, restarted_by_agent
from plait.topology import AXIS_ORDER, MeshAxis, Topology


class Replicas(Driver):
    """Data-parallel replica groups on torchft around the layout inside each group (see the module docstring)."""

    def __init__(self, cfg: Config, topo: Topology, model: nn.Module) -> None:
        found = replica_group()
        self.cfg, self.topo = cfg, topo
        self.group_index, self.num_groups = found if found is not None else (0, 1)
        # DiLoCo: each group one replica; no per-step average, the outer all-reduce through replica_mean
        self.outer_loop = cfg.parallel.sync == "diloco"
        self._voted = False  # this step's should_commit already asked (DiLoCo's synchronisation asked it)
        self._healers: list[Any] = []  # drivers whose own state a heal carries
        self._bn = batchnorm_buffers(model)
        self._biased = [m for m in moe_layers(model) if m.balance == "bias"]  # MoE layers balanced by their loads
        self.logger = get_logger(self.topo.rank)
        self.manager: Any = None
        self._run: Any = None
        self._quorums: QuorumRecorder | None = None  # the manager's client, keeping each quorum's result
        self._store: Any = None
        self._participants = 0  # the groups in the current quorum
        self._step_live = 0  # the groups whose gradients the last step averaged
        self._healed = 0  # heals this process received
        self._in_step = False  # inside after_step: the engine counts the step just taken after it returns
        self._quorum_s = 0.0  # seconds this process waited on torchft's quorums (the first one included)
        self._commit_s = 0.0  # seconds in should_commit
        self.events = ReplicaEvents(self.group_index, self.num_groups, agent_restarts())  # for the run's summary

    # -- joining -------------------------------------------------------------------------------------
    def begin(self, layout: Layout, run: Any) -> None:
        """The torchft manager of this rank, then the first quorum: a replacement heals from a live peer here,
        before its first step; at the start of a run every group takes the first group's state (torchft's
        init_sync)."""
        require_torchft()
        from torchft import Manager, ProcessGroupGloo

        backoff = self.cfg.fault.restart_backoff_s
        if restarted_by_agent() and backoff > 0:
            # a replacement (its agent restarted the group at once) waits as a restarted group would; the live
            # groups train on meanwhile
            self.logger.info("replica group %d: the replacement waits fault.restart_backoff_s=%g s before it joins",
                             self.group_index, backoff)
            time.sleep(backoff)
        self.layout, self.comm = layout, layout.comm
        self._run = run
        self._healers = [d for d in layout.drivers if isinstance(d, Healing)]
        f, timeout = self.cfg.fault, timedelta(seconds=self.cfg.comm.timeout_s)
        lighthouse = f.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
        if not lighthouse:
            raise PlaitError("fault.mode=replicas needs a torchft Lighthouse: set fault.lighthouse=http://HOST:PORT, "
                             "or start the run with plait run --replicas N / plait train, which start one")
        # what the other groups reach this one at: loopback when the Lighthouse is local, else this machine's name
        local = urlparse(lighthouse).hostname in ("127.0.0.1", "localhost", "::1")
        host = "127.0.0.1" if local else socket.gethostname()
        rank, ranks = self.topo.rank, self.topo.world_size
        port = [0]
        if rank == 0:  # the group's own store, new with every start of the group (torchft's manager server's address)
            self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            port = [self._store.port]
        if ranks > 1:  # once, at setup: the group's ranks learn where its store is
            dist.broadcast_object_list(port, src=0)
        connect = timedelta(seconds=min(30.0, self.cfg.comm.timeout_s))
        self._transport = weights_only_transport(timeout)
        try:
            self.manager = Manager(
                pg=ProcessGroupGloo(timeout=timeout), load_state_dict=self._heal, state_dict=self._heal_state,
                min_replica_size=f.min_replicas, use_async_quorum=False, timeout=timeout, quorum_timeout=timeout,
                connect_timeout=connect, rank=rank, world_size=ranks, store_addr=host, store_port=port[0],
                lighthouse_addr=lighthouse, replica_id=f"plait_replica_{self.group_index}", hostname=host,
                checkpoint_transport=self._transport)
            # torchft's Manager keeps nothing of a quorum's result but its size: the record reads it at its client
            self._quorums = self.manager._client = QuorumRecorder(self.manager._client)
            # torchft's step starts at the run's (a resumed group's is its checkpoint's): groups resumed from the
            # same checkpoint keep their own (equal) state, and a group behind the others heals from one ahead
            self.manager.load_state_dict({"step": int(run.state()["steps"]), "batches_committed": 0})
            self._first_quorum()
            if self.manager.current_step() == 0:  # every group in the quorum is here too: none has stepped yet
                # each past its first quorum (a heal's state fetched) before any goes on: a group that loads a
                # checkpoint next withdraws what it served (finish_load), which a slower peer may not have fetched
                self.manager.allreduce(torch.zeros(1)).wait()
        except Exception as e:  # torchft's errors name a gRPC status; the user needs the address and the fix
            if self.manager is not None:
                self.manager.shutdown(wait=False)
                self.manager = None
            raise PlaitError(f"fault.mode=replicas: no quorum through the torchft Lighthouse at {lighthouse} (it did "
                             f"not answer within {connect.total_seconds():g} s, or the groups did not meet within "
                             f"comm.timeout_s={self.cfg.comm.timeout_s:g}: {str(e).splitlines()[0][:200]}); start "
                             "a Lighthouse there, or leave fault.lighthouse empty for plait run / plait train to "
                             "start one") from None
        if ranks > 1:
            self._agree_in_group()

    @torch.no_grad()
    def _agree_in_group(self) -> None:
        """After the first quorum, the ranks of one group that hold the same local tensor hold group rank 0's copy of
        it: torchft picks each group rank's heal source on its own (at the start of a run, rank k of every group may
        take group k's state), which would leave ranks of one group holding the same entry (the whole model under
        data parallelism and ZeRO-1/2, a replicated norm under tensor parallelism, a shard under HSDP or next to tensor
        parallelism) with different values. Which ranks hold the same tensor: those of the same pipeline stage (each
        stage holds entries of its own) along the group's mesh axes the tensor is not sharded on (``heal.held_alike``);
        a pipeline's tied copies (the embedding on the first stage, the head on the last) then take the first stage's
        (``LayoutState.retie``). Communication: one all-reduce of the axis sets (64 flags), then one broadcast per entry
        over its ranks and one per tied weight over the pipeline, once, at setup."""
        topo = self.topo
        entries = [(local_part(t).data, held_alike(topo, t)) for t in self.layout.state.model_entries().values()]
        # the axis sets any rank of the group needs, one flag per subset of AXIS_ORDER (bit i: axis i), so that
        # every rank makes the same process groups in the same order (raw flags: nothing received is unpickled)
        needed = torch.zeros(1 << len(AXIS_ORDER), dtype=torch.int32, device=topo.device)
        for _, axes in entries:
            if axes:
                needed[sum(1 << AXIS_ORDER.index(MeshAxis(a)) for a in axes)] = 1
        dist.all_reduce(needed, op=dist.ReduceOp.MAX)
        subsets = needed.nonzero().flatten().tolist()
        groups = {axes: topo.group(*axes)
                  for axes in (tuple(str(a) for i, a in enumerate(AXIS_ORDER) if m >> i & 1) for m in subsets)}
        for t, axes in entries:  # the ranks of one stage hold the same entries in the same order
            if axes:
                dist.broadcast(t, group=groups[axes], group_src=0)
        self.layout.state.retie()  # a pipeline's tied copies: each stage's rank healed from a source of its own
        for d in self._healers:  # the entries written were theirs (DiLoCo's start weights): the model follows
            d.heal(None)
        for o in self.layout.optimizers:  # a separate master copy (parameters not fp32) follows its shard
            for b in o.buckets if isinstance(o, ZeroOptimizer) else []:
                if b.master is not b.shard:
                    b.master.copy_(b.shard)

    def _first_quorum(self) -> None:
        """At the start (or the resumption) of a run every group takes part in the first step (a group still
        starting would otherwise miss the steps a faster one takes alone): quorums are asked again until all groups
        are in, for up to about ``comm.timeout_s`` (counted in tries, so that every rank of a group asks as often). A
        replacement (its agent restarted it) joins whoever is live at once."""
        self._quorum(start=True)
        fresh = not restarted_by_agent()
        tries = int(self.cfg.comm.timeout_s / 0.2)
        while fresh and self._participants < self.num_groups and tries > 0:
            time.sleep(0.2)
            self._quorum(start=True)
            tries -= 1
        if self._participants < self.num_groups:
            self.logger.warning("replica group %d starts with %d of %d groups live", self.group_index,
                                self._participants, self.num_groups)

    def _quorum(self, start: bool = False) -> None:
        """The quorum of this step boundary (healing this rank first if its group is behind), recorded for the
        summary (``start``: one of the run's first quorums, see ``ReplicaEvents.quorum``)."""
        t0 = time.perf_counter()
        self.manager.start_quorum()
        self._participants = self.manager.num_participants()
        result = self._quorums.last
        if self.outer_loop and result.replica_world_size > result.max_world_size:
            # a group heals here, and under DiLoCo the groups meet again only at the next synchronisation: every
            # group of the quorum waits until it has fetched its state (served as it is: the next inner step would
            # change it). Per step the gradient all-reduce waits for it anyway.
            self.manager.allreduce(torch.zeros(1)).wait()
        self._quorum_s += time.perf_counter() - t0
        self.events.quorum(result, self._run.steps + int(self._in_step), start)

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers holding this rank's optimizer state (ZeRO's inner one over its shards)."""
        return [o.optimizer if isinstance(o, ZeroOptimizer) else o for o in self.layout.optimizers]

    def _heal_state(self) -> dict[str, Any]:
        """What rank k of a replacement needs to continue as rank k of this group (read on torchft's thread while
        this one waits): this rank's model entries and optimizer states as plain local tensors (no collective: a
        sharded layout's own state dicts gather), optimizer parameters the model does not hold (a separate master
        copy), and the run state."""
        run = self._run.state()
        run["steps"] += int(self._in_step)  # the steps completed at this boundary
        model = {k: local_part(v).detach() for k, v in self.layout.state.model_entries().items()}
        held = {t.untyped_storage().data_ptr() for t in model.values()}
        optim = []
        for o in self._optimizers():
            sd = o.state_dict()
            state = {i: {k: local_part(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                     for i, s in sd["state"].items()}
            params = [None if local_part(q).untyped_storage().data_ptr() in held else local_part(q).detach()
                      for g in o.param_groups for q in g["params"]]
            optim.append({"state": state, "param_groups": sd["param_groups"], "params": params})
        return {"model": model, "optim": optim, "run": run, "drivers": [d.heal_state() for d in self._healers]}

    @torch.no_grad()
    def _heal(self, state: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        entries = self.layout.state.model_entries()
        if set(entries) != set(state["model"]):
            raise PlaitError("fault.mode=replicas: a live replica's model has other entries than this one's; every "
                             "replica group must train the same model")
        for k, t in entries.items():
            local_part(t).copy_(state["model"][k])
        for o, sd in zip(self._optimizers(), state["optim"], strict=True):
            o.load_state_dict(optimizer_template(o, sd))
            for q, value in zip([q for g in o.param_groups for q in g["params"]], sd["params"], strict=True):
                if value is not None:
                    local_part(q).copy_(value)
        for d, own in zip(self._healers, state["drivers"], strict=True):
            d.heal(own)
        run = dict(state["run"])
        run["steps"] -= int(self._in_step)  # the engine adds the step it is finishing
        self._run.restore(run)
        self._healed += 1
        self.logger.info("replica group %d healed from a live replica: joins at step %d (%.2f s to load)",
                         self.group_index, int(state["run"]["steps"]), time.perf_counter() - t0)

    def after_load(self, layout: Layout) -> None:
        """After a checkpoint load (a resumed run): torchft's step becomes the loaded one, and a quorum at once, so
        that a group which loaded an older checkpoint, or none, heals from one ahead before its next step."""
        if self.manager is not None:
            # what this rank served at the last quorum is stale now: a peer asking before this quorum stages the
            # new state must wait for it (should_commit does the same at every step)
            self._transport.disallow_checkpoint()
            self.manager.load_state_dict({"step": int(self._run.state()["steps"]), "batches_committed": 0})
            self._quorum()

    # -- the step ------------------------------------------------------------------------------------
    def _averaged(self) -> list[torch.Tensor]:
        """What this rank averages over the groups: the gradients (or gradient shards) the optimizer reads, a
        parameter without one this step given zeros (every group must send the same layout), and the BatchNorm
        running statistics. The experts' are among them (``Layout.grads``: ``ExpertSync.grads``, already summed over
        the group's ranks holding the same experts and divided by its data-parallel x cp degree, the group's mean
        as the dense gradients are), and rank k of every group holds the same experts."""
        if not isinstance(self.layout.optimizer, ZeroOptimizer):  # ZeRO's shards always exist; p.grad stays None
            for q in self.layout.trainable():
                if q.grad is None:
                    q.grad = torch.zeros_like(q)
        return [local_part(g) for g in self.layout.grads()] + self._bn

    def after_finish(self, layout: Layout) -> None:
        """Communication: after the group's own gradient synchronisation, one all-reduce (torchft's, over the
        groups in this step's quorum) of this rank's gradients (or shards) and BatchNorm running statistics,
        flattened in float32, divided by the number of live groups; with MoE layers balanced by bias, one more of
        their expert loads (``_sum_loads``). No backward. Under DiLoCo nothing: each group trains alone between its
        synchronisations."""
        if self.outer_loop:
            return
        tensors = self._averaged()
        flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
        self._allreduce(flat)
        self.events.trained(self._run.steps + 1, self._participants)
        offset = 0
        with torch.no_grad():
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        if self._biased:
            self._sum_loads()

    @torch.no_grad()
    def _sum_loads(self) -> None:
        """Bias balancing moves every expert's bias by the sign of its load against the mean, the loads summed over
        every data-parallel rank (``plait.parallel.expert.dispatch.MoeMonitor``, over the group's after the step):
        each rank's loads are summed here with rank k's of the live groups first, so that every group moves its
        biases alike, as one process would. A step whose collectives failed (a peer died during them) moves no bias:
        its loads are zeroed (torchft leaves a failed all-reduce's tensor undefined) and its update is skipped
        (``commit``). Communication: one all-reduce (torchft's, a sum) of the loads, float64 (exact counts)."""
        loads = [m.load for m in self._biased]
        flat = torch.cat(loads)
        self.manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM).wait()
        if self.manager.errored() is not None:
            flat.zero_()
        self.comm.stats.bytes_sent += ring_allreduce_bytes(flat.numel() * 8, self._participants)
        self.comm.stats.calls += 1
        for t, v in zip(loads, flat.split([t.numel() for t in loads]), strict=True):
            t.copy_(v)

    def _allreduce(self, flat: torch.Tensor) -> None:
        """``flat`` averaged over the groups in the quorum (torchft divides by them: ReduceOp.AVG), counted."""
        t0 = time.perf_counter()
        self.manager.allreduce(flat).wait()
        self.comm.stats.wait_s += time.perf_counter() - t0
        self._step_live = self._participants
        self.comm.stats.bytes_sent += ring_allreduce_bytes(flat.numel() * 4, self._participants)
        self.comm.stats.calls += 1

    def replica_mean(self, flat: torch.Tensor) -> bool:
        """DiLoCo's outer all-reduce (``plait.parallel.capabilities.ReplicaMean``): ``flat`` averaged over the live
        groups, then this step's vote (``should_commit``: every rank of the group agrees whether the all-reduce
        succeeded everywhere; False: drop it). Communication: one torchft all-reduce of ``flat``."""
        self._allreduce(flat)
        self.events.trained(self._run.steps + 1, self._participants)  # within after_step: the step taken
        return self._vote("the synchronisation is dropped: every rank back at its start weights")

    def _vote(self, dropped: str) -> bool:
        """torchft's ``should_commit`` for this step, once; ``dropped`` says what a failed one means."""
        t0 = time.perf_counter()
        committed = self.manager.should_commit()
        self._commit_s += time.perf_counter() - t0
        self._voted = True
        if not committed:
            self.logger.warning("replica group %d: step not committed (a replica was lost during it); %s",
                                self.group_index, dropped)
        return committed

    def commit(self, layout: Layout) -> bool:
        """torchft's commit (every rank of every group asks at every step): a step whose collectives failed skips
        its update like a non-finite one, and the next quorum heals whoever is behind. Under DiLoCo no torchft
        collective ran before the update: the vote comes after it (``after_step``, or DiLoCo's synchronisation)."""
        if self.outer_loop:
            self._step_live = self._participants
            return True
        return self._vote("update skipped")

    def after_step(self, layout: Layout) -> None:
        """After the group's own after-step work (BatchNorm statistics averaged inside it) and the other drivers'
        (DiLoCo's synchronisation), the step's vote where none was asked yet, then the next step's quorum, at this
        step boundary (where a replacement joins)."""
        self._in_step = True
        try:
            if self.outer_loop and not self._voted:
                self._vote("its inner update stays, and the next quorum heals the group if it is behind")
            self._quorum()
        finally:
            self._in_step = False
            self._voted = False

    def step_metrics(self) -> dict[str, Any]:
        return {"replicas_live": self._step_live, "replica_heals": self._healed,
                "replica_step": self.manager.current_step(), "replica_quorum_s_total": round(self._quorum_s, 4),
                "replica_commit_s_total": round(self._commit_s, 4)}

    def report(self) -> dict[str, Any]:
        """The ``replicas`` block of the group's summary: the failures, heals and steps with fewer groups this process
        saw (``plait.fault.replica_events``)."""
        return {"replicas": self.events.summary()}

    def describe(self, inside: str) -> str:
        return f"torchft replica group {self.group_index} of {self.num_groups}" + (f" ({inside})" if inside else "")

    def close(self) -> None:
        if self.manager is not None:
            # wait=True: torchft's non-blocking shutdown leaves its checkpoint server serving (its flag to stop the
            # server's loop has a mangled name), which a process that goes on (a second Plait) keeps, locked
            self.manager.shutdown(wait=True)
            self.manager = None
