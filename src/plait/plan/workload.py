"""What is simulated: a model shape, a layout, a batch and a precision, from a plait config or by hand.

``Layout.dp_shard`` is hybrid sharding (``parallel.dp_shard``, HSDP: ZeRO-3 over groups of ``dp_shard`` of the
``dp`` data-parallel ranks, replicated across the ``dp / dp_shard`` groups; 1, or ``dp``, means FSDP over
every data-parallel rank): ``layout_from_config`` reads it, the simulator prices it
(``plait.plan.layouts``) and the planner enumerates it. ``Layout.cp`` is context parallelism
(``parallel.cp``: the sequence split over ``cp`` ranks, which multiply the world): the simulator prices a cp rank
as a data-parallel rank of its shard of the sequence (``Workload.rank_view``) plus the cp collectives; it composes
with pipelines (each stage's blocks on its shard), experts (a cp rank's tokens dispatched over ep, ep inside dp) and
hybrid sharding (shard groups over ``dp_shard x cp``). ``Layout.sync = "diloco"`` is DiLoCo around the layout: the
``dp / (ep x dp_shard)`` replicas train apart (``Workload.replica_view``: the layout inside one replica, which the
simulator prices as it stands) and all-reduce their parameters' change every ``diloco_inner_steps`` steps
(``plait.plan.simulate``). ``Workload.precision = "fp8"`` is bf16 with the Linears multiplying in float8
(``plait.plan.ops_float8``).

``workload_from_config`` reads the same config ``plait train`` reads (file, ``--section.key=value``
overrides, ``model.factory``), checks it for the world size with the trainer's own checks
(``plait.validate``), and resolves what the trainer resolves: dp inferred from the world, the
schedule's natural virtual stages, the accumulation steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.config import Config, ConfigError
from plait.plan.shapes import ModelShape

RECOMPUTE = ("none", "full", "every_k", "selective")


@dataclass(frozen=True)
class Layout:
    """Degrees and schedule of one layout (names as in ``[parallel]`` and ``[train]``)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    sp: bool = False
    schedule: str = "1f1b"
    virtual: int = 1
    microbatches: int = 1  # pipeline micro-batches per accumulation step
    micro_batch_size: int = 1  # sequences per forward per rank (train.micro_batch_size)
    recompute: str = "none"
    every_k: int = 2
    reshard_after_forward: bool = True
    bucket_mb: float = 25.0
    impl: str = "plait"
    pp_balance: str = "cost"
    loss_parallel: bool = True
    ep: int = 1
    # parallel.offload: optimizer (ZeRO-1/2's optimizer shard in host memory) or params (ZeRO-3's sharded
    # parameters, gradients and optimizer states in host memory); priced for memory only (plait plan memory)
    offload: str = "none"
    dp_shard: int = 1  # HSDP's shard group at zero=3 (module docstring); 1: every data-parallel rank
    act_offload: bool = False  # train.activation_offload: blocks' saved tensors in host memory (plait.plan.stages)
    cp: int = 1  # context-parallel degree (parallel.cp; module docstring)
    cp_impl: str = "ring"  # parallel.cp_impl: ring, alltoall or allgather
    cp_folded: int = 1  # in a rank view (Workload.rank_view): the cp degree folded into dp
    # parallel.pp_split_embedding / pp_split_head: the embedding / the head a unit of the split, so the first / last
    # stage may hold it alone (plait.plan.schedule.partition_units)
    split_embedding: bool = False
    split_head: bool = False
    # parallel.sync, diloco_inner_steps (H), diloco_fragments: DiLoCo's replicas meet every H steps (module docstring)
    sync: str = "every_step"
    diloco_inner_steps: int = 100
    diloco_fragments: int = 1
    replicas_apart: int = 0  # in a replica view (Workload.replica_view): DiLoCo's replicas set apart (0: no DiLoCo)

    @property
    def diloco_replicas(self) -> int:
        """DiLoCo's replicas: ``dp / (ep x dp_shard)`` (``dp_shard``: the data-parallel ranks of one replica, at any
        ZeRO stage, as ``plait.parallel.data.diloco`` reads it); 1 without DiLoCo."""
        return self.dp // (self.ep * max(self.dp_shard, 1)) if self.sync == "diloco" else 1

    @property
    def shard(self) -> int:
        """The ranks ZeRO shards a parameter's states over: the HSDP shard group at zero=3, under DiLoCo the ranks of
        one replica, else every dp rank."""
        if self.sync == "diloco":
            return self.dp // self.diloco_replicas
        return self.dp_shard if self.zero == 3 and 1 < self.dp_shard < self.dp else self.dp

    @property
    def hybrid(self) -> bool:
        """Hybrid sharding: ZeRO-3 over shard groups smaller than the data-parallel world (DiLoCo's replicas are
        apart, not a replicate axis of HSDP)."""
        return self.shard < self.dp and self.sync != "diloco"

    @property
    def world(self) -> int:
        """``dp x cp x tp x pp``: expert-parallel ranks are data-parallel ranks (``ep`` divides ``dp``); a replica
        view's replicas set apart count too."""
        return self.dp * self.cp * self.tp * self.pp * max(1, self.replicas_apart)

    def describe(self) -> str:
        parts = [f"dp={self.dp}", f"tp={self.tp}" + ("+sp" if self.sp else ""), f"pp={self.pp}"]
        if self.pp > 1:
            parts.append(f"{self.schedule}" + (f" v={self.virtual}" if self.virtual > 1 else "")
                         + f" m={self.microbatches}")
        parts += [f"zero={self.zero}", f"mb={self.micro_batch_size}", f"recompute={self.recompute}"]
        if self.ep > 1:
            parts.insert(1, f"ep={self.ep}")
        if self.cp > 1:
            parts.insert(1, f"cp={self.cp}")
        if self.dp_shard > 1:
            parts.insert(1, f"dp_shard={self.dp_shard}")
        if self.pp > 1 and (self.split_embedding or self.split_head):
            parts.insert(parts.index(f"zero={self.zero}"), "split=" + "+".join(
                n for n, on in (("embedding", self.split_embedding), ("head", self.split_head)) if on))
        if self.act_offload:
            parts.append("act_offload")
        if self.sync == "diloco":
            parts.append(f"diloco H={self.diloco_inner_steps}" + (f" F={self.diloco_fragments}"
                                                                  if self.diloco_fragments > 1 else ""))
        return " ".join(parts)


@dataclass(frozen=True)
class Workload:
    """A model, a layout, the global batch (sequences per step) and how the software runs it:
    ``precision`` (fp32, bf16, fp16, fp8: bf16 with float8 Linears), ``attention`` kernel (flash, unfused),
    ``stack`` (plait, megatron, metaseq; see ``plait.plan.ops``), the optimizer kernel and whether gradients are
    clipped."""

    shape: ModelShape
    layout: Layout
    global_batch: int
    precision: str = "fp32"
    attention: str = "flash"
    stack: str = "plait"
    fused_optimizer: bool = False
    grad_clip: bool = True

    @property
    def accumulation(self) -> int:
        return max(1, self.global_batch // (self.layout.micro_batch_size * self.layout.dp))

    @property
    def pipe_micro_batch(self) -> int:
        """Sequences in one pipeline micro-batch (one forward of one stage)."""
        lay = self.layout
        return lay.micro_batch_size // lay.microbatches if lay.pp > 1 else lay.micro_batch_size

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.shape.seq_len

    @property
    def act_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def autocast(self) -> bool:
        """Whether forward runs under autocast over float32 parameters: plait's bf16 and fp16, except ZeRO-3 with
        bf16, which computes in bf16 through FSDP2's mixed-precision policy (``plait.parallel.fsdp``, and a
        pipeline's stages: ``plait.parallel.pipeline.sharded``); other stacks hold half-precision parameters.
        fp8 is bf16 here (its Linears multiply in float8 inside either regime)."""
        lay = self.layout
        return self.stack == "plait" and self.precision != "fp32" and not (lay.zero == 3 and self.precision
                                                                          in ("bf16", "fp8"))

    @property
    def float8(self) -> bool:
        """Whether the block Linears multiply in float8 (``train.precision = "fp8"``; ``plait.plan.ops_float8``)."""
        return self.precision == "fp8"

    def replica_view(self) -> Workload:
        """What one DiLoCo replica trains, as a layout of its own: its ``dp / replicas`` data-parallel ranks (ZeRO
        over all of them: one replica holds no other), its share of every global batch, the replicas set apart
        (``Layout.replicas_apart``: placed outermost after pp, as ``plait.topology``'s ``dp_replicate``). The
        outer all-reduce every H steps is priced beside it (``plait.plan.simulate``). Without DiLoCo: this
        workload."""
        from dataclasses import replace

        lay = self.layout
        if lay.sync != "diloco":
            return self
        n = lay.diloco_replicas
        layout = replace(lay, dp=lay.dp // n, dp_shard=1, sync="every_step", replicas_apart=n)
        return replace(self, layout=layout, global_batch=self.global_batch // n)

    def rank_view(self) -> Workload:
        """What one rank of a context-parallel layout computes, as a data-parallel layout: its ``1 / cp`` of every
        sequence (``seq_len / cp`` tokens, the learned position table kept whole), the cp ranks folded into dp
        (gradients averaged and ZeRO sharded over dp x cp, as plait does; the global batch counted in shards, so the
        tokens per step and the accumulation stay), attention over cp times its own keys (``Setup.cp``). The
        cp collectives are priced beside it (``plait.plan.stages.StageModel.block``). Without cp: this workload."""
        from dataclasses import replace

        lay, s = self.layout, self.shape
        if lay.cp <= 1:
            return self
        shape = replace(s, seq_len=s.seq_len // lay.cp, positions=s.positions or s.seq_len)
        layout = replace(lay, dp=lay.dp * lay.cp, cp=1, cp_folded=lay.cp,
                         dp_shard=lay.dp_shard * lay.cp if lay.dp_shard > 1 else 1)
        return replace(self, shape=shape, layout=layout, global_batch=self.global_batch * lay.cp)

    def check(self) -> None:
        """Raise ``ConfigError`` for what the simulator cannot price (it is not a plait layout)."""
        lay, s = self.layout, self.shape
        if lay.cp > 1 and (self.attention != "flash" or s.seq_len % (2 * lay.cp)
                           or lay.cp_impl not in ("ring", "alltoall", "allgather")):
            raise ConfigError(f"cp={lay.cp} is simulated with the flash attention kernel, cp_impl ring, alltoall or "
                              f"allgather and a sequence ({s.seq_len}) that divides by 2 x cp; change those or set "
                              "cp=1")
        if lay.sync == "diloco":
            if lay.dp % (lay.ep * max(lay.dp_shard, 1)) or lay.diloco_inner_steps < 1 or lay.diloco_fragments < 1:
                raise ConfigError(f"sync=diloco needs dp_shard ({lay.dp_shard}: the data-parallel ranks of one "
                                  f"replica) x ep ({lay.ep}) to divide dp={lay.dp}, and diloco_inner_steps and "
                                  "diloco_fragments of at least 1; change them")
        elif lay.dp_shard not in (1, lay.dp) and (lay.zero != 3 or lay.dp % lay.dp_shard or lay.ep > 1):
            raise ConfigError(f"dp_shard={lay.dp_shard} (HSDP) needs zero=3, a divisor of dp={lay.dp} and no expert "
                              "parallelism; set dp_shard=1 or change it")
        if self.float8 and self.stack != "plait":
            raise ConfigError(f"precision fp8 is simulated for plait's float8 Linears (torchao), not stack "
                              f"{self.stack!r}; use precision bf16 for that stack")
        if lay.ep > 1 and (lay.dp % lay.ep or not s.num_experts or s.num_experts % lay.ep):
            raise ConfigError(f"parallel.ep={lay.ep} needs a mixture of experts whose {s.num_experts} experts and "
                              f"data-parallel degree {lay.dp} it divides; set parallel.ep among their common divisors")
        if lay.recompute not in RECOMPUTE:
            raise ConfigError(f"recompute must be one of {', '.join(RECOMPUTE)}; got {lay.recompute!r}")
        if s.n_head % lay.tp or s.n_kv_head % lay.tp or s.d_ff % lay.tp:
            raise ConfigError(f"tp={lay.tp} must divide the heads ({s.n_head}), key-value heads ({s.n_kv_head}) "
                              f"and MLP width ({s.d_ff}); choose tp among their common divisors")
        units = s.n_layer + (lay.split_embedding + lay.split_head if lay.pp > 1 else 0)
        if lay.pp * lay.virtual > units:
            parts = " (the embedding and the head count as one each)" if units > s.n_layer else ""
            raise ConfigError(f"{lay.pp * lay.virtual} pipeline stages but {s.n_layer} layers{parts}: every stage "
                              "needs a layer, or the embedding or the head alone (parallel.pp_split_embedding, "
                              "pp_split_head); lower parallel.pp or the virtual stages")
        if self.global_batch % (lay.micro_batch_size * lay.dp):
            raise ConfigError(f"global batch {self.global_batch} must be a multiple of micro_batch_size "
                              f"{lay.micro_batch_size} x dp {lay.dp}")
        if lay.pp > 1 and lay.micro_batch_size % lay.microbatches:
            raise ConfigError(f"micro_batch_size {lay.micro_batch_size} must split into {lay.microbatches} "
                              "pipeline micro-batches")


def layout_from_config(cfg: Config) -> Layout:
    """The layout of a validated config (``parallel.dp`` already resolved)."""
    from plait.plan.schedule import NATURAL_VIRTUAL

    p, t = cfg.parallel, cfg.train
    virtual = (p.pp_virtual_stages or NATURAL_VIRTUAL.get(p.pp_schedule, 1)) if p.pp > 1 else 1
    return Layout(dp=p.dp, tp=p.tp, pp=p.pp, zero=p.zero, sp=p.sequence_parallel, schedule=p.pp_schedule,
                  virtual=virtual, microbatches=p.microbatches if p.pp > 1 else 1,
                  micro_batch_size=t.micro_batch_size, recompute=t.activation_checkpointing,
                  every_k=t.checkpoint_every_k, reshard_after_forward=p.reshard_after_forward, bucket_mb=p.bucket_mb,
                  impl=p.impl, pp_balance=p.pp_balance, loss_parallel=p.loss_parallel, ep=p.ep,
                  offload=p.offload, dp_shard=p.dp_shard or 1, act_offload=t.activation_offload,
                  split_embedding=p.pp_split_embedding, split_head=p.pp_split_head, cp=p.cp, cp_impl=p.cp_impl,
                  sync=p.sync, diloco_inner_steps=p.diloco_inner_steps, diloco_fragments=p.diloco_fragments)
