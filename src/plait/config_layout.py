"""The configuration's sections of the layout and its runs on clusters: ``[parallel]``, ``[comm]``, ``[fault]``,
``[ps]`` and ``[launch]``, one dataclass each, each field's docstring the comment above it (``plait.config_sections``
holds the others and ``Config``; ``plait.config`` re-exports every name)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class ParallelConfig:
    # Local worker processes started by `plait train` (ignored under torchrun or SLURM).
    nproc: int = 2
    # collective: every rank trains (data, ZeRO, tensor, pipeline, expert parallelism over collectives); ps: a
    # parameter server, the last ps.servers ranks hold the parameters and the optimizer, the others are
    # workers that push gradients and pull parameters (see [ps]).
    mode: Literal["collective", "ps"] = "collective"
    # The gradient-sync policy: auto picks it from the settings below (zero=0: plait's reducer, or DDP with
    # impl=torch; zero=1/2: plait's sharded optimizer; zero=3: FSDP2, HSDP with dp_shard), whatever tensor, expert,
    # context and pipeline parallelism run before it; a name picks a registered policy, yours included
    # (plait.parallel.grad_sync.register_grad_sync).
    strategy: str = "auto"
    # Data-parallel degree, expert-parallel ranks included (ep divides it); 0 infers world size / (tp * pp * cp).
    dp: int = 0
    # Tensor-parallel degree.
    tp: int = 1
    # Pipeline-parallel degree.
    pp: int = 1
    # Expert-parallel degree: MoE experts are sharded over ep ranks, which are also data-parallel ranks
    # (each processes its own micro-batches); ep must divide the data-parallel degree.
    ep: int = 1
    # Context-parallel degree: each sequence is split over cp ranks along time (load-balanced causal shards);
    # the cp ranks of a group share the same sequences, and gradients are averaged over dp x cp.
    cp: int = 1
    # Context-parallel attention: ring (key/value blocks travel round the ring, partial outputs merged by their
    # log-sum-exp), alltoall (Ulysses: heads for sequence) or allgather (keys and values gathered; the reference).
    cp_impl: Literal["ring", "alltoall", "allgather"] = "ring"
    # Data-parallel implementation: plait's bucketed reducer, or PyTorch DDP as the reference.
    impl: Literal["plait", "torch"] = "plait"
    # Gradient bucket size in MiB for the data-parallel all-reduce and the ZeRO reduce-scatter.
    bucket_mb: float = 25.0
    # ZeRO stage: 0 replicates everything; 1 shards optimizer states; 2 also gradients (plait's sharded
    # optimizer); 3 also parameters (FSDP2).
    zero: int = 0
    # Move state to CPU memory: optimizer (the ZeRO-1/2 optimizer shard) or params (zero=3, FSDP2).
    offload: Literal["none", "optimizer", "params"] = "none"
    # zero=3: ranks per shard group (hybrid sharding, HSDP): parameters, gradients and optimizer states are
    # sharded over groups of dp_shard ranks and replicated across the dp / (ep x dp_shard) groups; 0 shards
    # over every data-parallel rank (FSDP). Must divide dp / ep; needs zero=3. With sync=diloco, any zero: the
    # data-parallel ranks of one DiLoCo replica (0: one), the dp / (ep x dp_shard) replicas synchronising every
    # diloco_inner_steps steps.
    dp_shard: int = 0
    # fault.mode=replicas: the torchft replica groups the nproc ranks form, nproc / dp_replicate ranks each (every
    # group trains the whole model, data-parallel with plait's reducer or sharded inside by zero=1/2, FSDP2 or HSDP
    # with dp_shard, and split inside by tp and pp as set here; expert and context parallelism are refused); 0: one
    # group per tp x pp ranks. Elsewhere 0: the replicate degree follows from dp / dp_shard.
    dp_replicate: int = 0
    # zero=3: free each block's gathered parameters after forward (false keeps them until backward).
    reshard_after_forward: bool = True
    # Tensor parallel: shard LayerNorm/dropout regions along the sequence (needs tp > 1).
    sequence_parallel: bool = False
    # Tensor parallel: compute the loss on vocabulary-sharded logits instead of gathering them.
    loss_parallel: bool = True
    # Pipeline schedule: gpipe, 1f1b, interleaved (several stages per rank) or zbv (zero-bubble V).
    pp_schedule: Literal["gpipe", "1f1b", "interleaved", "zbv"] = "1f1b"
    # Pipeline micro-batches per forward/backward of one accumulation micro-batch.
    microbatches: int = 4
    # Pipeline stages per rank; 0 picks the schedule's natural value (1, or 2 for interleaved/zbv).
    pp_virtual_stages: int = 0
    # Pipeline stage split: by per-layer cost measured in a profiling step, or by layer count.
    pp_balance: Literal["cost", "count"] = "cost"
    # Pipeline split points: names of the layers that start stages 2, 3, ... (for example
    # ["model.layers.4"]); empty splits by parallel.pp_balance. Naming the first layer gives the first stage
    # the embedding alone; naming the final norm (model.norm, or ln_f for plait's GPT) gives the last stage the
    # norm, head and loss alone.
    pp_split: list[str] = field(default_factory=list)
    # Pipeline split by pp_balance: the embedding counts as a layer of its own, so the first stage may hold it
    # alone (Megatron-LM's --account-for-embedding-in-pipeline-split; Llama 3 405B's first chunk).
    pp_split_embedding: bool = False
    # Pipeline split by pp_balance: the final norm, head and loss count as a layer of their own, so the last stage
    # may hold them alone (Megatron-LM's --account-for-loss-in-pipeline-split; Llama 3 405B's last chunk).
    pp_split_head: bool = False
    # Tensor-parallel plan: auto (the plan registered for the model's class, else the one a Hugging Face
    # model ships in its config) or a table of module-name patterns to styles: colwise, rowwise,
    # colwise_rep, rowwise_rep, vocab, sequence_parallel, replicate.
    tp_plan: str | dict[str, str] = "auto"
    # BatchNorm statistics over the whole data-parallel batch (SyncBatchNorm) instead of each rank's own;
    # without it, running statistics are averaged over the data-parallel ranks after every step. Under
    # fault.mode=replicas: over each replica group's batch (the groups meet only in the gradient average).
    sync_batchnorm: bool = False
    # How data-parallel replicas synchronise: every_step all-reduces the gradients of every step; diloco
    # (DiLoCo, local SGD) lets each replica take diloco_inner_steps steps with its own optimizer and no
    # communication, then averages the replicas' weight changes (the pseudo-gradient) in one all-reduce and
    # applies it with an outer Nesterov SGD: about 1/diloco_inner_steps of the bytes on the wire.
    sync: Literal["every_step", "diloco"] = "every_step"
    # sync=diloco: optimizer steps each replica takes alone between two synchronisations (H).
    diloco_inner_steps: int = 100
    # sync=diloco: the outer optimizer's learning rate (DiLoCo's 0.7, chosen for H in the hundreds; 1.0 with
    # momentum 0 averages the replicas' weights, as local SGD does: the better start for H of a few tens or less,
    # where 0.7 with Nesterov 0.9 moves lr / (1 - momentum) = 7x the mean weight change; see docs/layouts.md).
    diloco_outer_lr: float = 0.7
    # sync=diloco: the outer optimizer's momentum (DiLoCo's 0.9; 0 for plain averaging).
    diloco_outer_momentum: float = 0.9
    # sync=diloco: Nesterov momentum for the outer optimizer (DiLoCo's choice; needs a momentum above 0).
    diloco_nesterov: bool = True
    # sync=diloco: streaming DiLoCo's fragments: the trainable parameters split into this many consecutive parts
    # of about equal size, each synchronised every diloco_inner_steps steps at its own step of the period (part f
    # at (f + 1) x H / fragments), so each synchronisation sends 1/fragments of the weights. 1: all at once.
    diloco_fragments: int = 1

@dataclass
class CommConfig:
    # Process-group backend: auto picks nccl when CUDA is available, gloo otherwise.
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    # Seconds a collective may wait for its peers before the job fails with a named error.
    timeout_s: float = 300.0
    # All-reduce algorithm of the data-parallel reducer: the backend's own, or plait's ring,
    # recursive halving-doubling or hierarchical (reduce in node, all-reduce across nodes, broadcast).
    allreduce: Literal["backend", "ring", "halving_doubling", "hierarchical"] = "backend"
    # Ranks per node for the hierarchical all-reduce (0: LOCAL_WORLD_SIZE from the launcher).
    ranks_per_node: int = 0
    # Gradient compression of the data-parallel reduction; auto measures the first steps and turns it on
    # only when communication is exposed. Under fault.mode=replicas: each group's own reduction (torchft's
    # average over the groups stays float32), as for allreduce.
    compress: Literal["none", "auto", "fp16", "bf16", "int8", "int4", "topk", "randomk", "powersgd"] = "none"
    # Kept fraction for topk and randomk.
    compress_ratio: float = 0.01
    # Rank of the PowerSGD approximation.
    powersgd_rank: int = 4
    # Keep the compression error per bucket and add it to the next step's gradient.
    error_feedback: bool = True
    # Stochastic rounding for int8/int4 quantization.
    stochastic_rounding: bool = False

@dataclass
class FaultConfig:
    # How a failed worker is survived: restart every worker from the newest checkpoint (restart), or per step on
    # torchft (replicas): each data-parallel replica group is a torchft replica group; when one dies the others
    # finish the step with the live replicas' gradients and go on, and its replacement heals from a live peer.
    # The groups are parallel.dp_replicate (one per rank by default); a group of several ranks is sharded inside by
    # parallel.zero=1/2 (ZeRO), zero=3 (FSDP2, HSDP with dp_shard) or data-parallel with plait's reducer (zero=0);
    # tensor, pipeline, expert and context parallelism inside a group are refused.
    # Needs torchft (pip install 'plait[ft]') and the launcher's replica groups (plait run --replicas G [--nproc R],
    # plait train).
    mode: Literal["restart", "replicas"] = "restart"
    # fault.mode=replicas: the torchft Lighthouse's address (http://HOST:PORT); empty: plait run and plait train
    # start one on this machine's loopback.
    lighthouse: str = ""
    # fault.mode=replicas: fewest live replica groups a step may commit with.
    min_replicas: int = 1
    # Restarts of the whole worker group after a failure, each resuming from the newest good checkpoint
    # (0: none). Not for errors a restart cannot fix (configuration, data, a failure before the first step).
    max_restarts: int = 3
    # Seconds before a restart; doubled over failures in quick succession (at most 60), reset by an attempt
    # that ran for a minute. fault.mode=replicas: a replacement group waits this long before it joins (not doubled).
    restart_backoff_s: float = 1.0
    # Mean time between failures in seconds, for checkpoint.every=auto.
    mtbf_s: float = 3600.0
    # Loss-spike detection (docs/troubleshooting.md states the rule and the figures behind its defaults): a loss
    # is a spike when, past fault.spike_warmup_steps, it exceeds the running median both by more than this many
    # robust deviations (1.4826 x the median absolute deviation) and by more than fault.spike_jump of the
    # median. A spike rolls training back to an earlier checkpoint and leaves out the data of the spike's
    # window (0 disables detection).
    spike_threshold: float = 6.0
    # The relative part of the rule: a spike exceeds the running median by more than this fraction of it.
    spike_jump: float = 0.5
    # Steps before the detector judges at all (-1: the larger of optim.warmup_steps and 2 x fault.spike_window):
    # early training's loss falls fast and bumps often, and a plain loop rides through those bumps.
    spike_warmup_steps: int = -1
    # Losses in the running window the detector judges against (it judges once it holds half of them).
    spike_window: int = 50
    # A rollback goes to a checkpoint at least this many steps before the spike.
    rollback_steps: int = 1
    # Global batches a rollback leaves out, counted from the checkpoint it returns to (as PaLM did: restart
    # before the spike, skip the batches that follow). At least the window up to the spike step is left out;
    # a larger value leaves out more.
    skip_batches: int = 0
    # Rollbacks allowed in one run; a spike after them is a warning and training goes on.
    max_rollbacks: int = 3
    # With train.deterministic, the first rollback for a spike replays the same batches: a spike that comes
    # back bit for bit is the data (then rolled back again, its window left out); one that does not was the
    # hardware or a transient fault, and training goes on with the replayed steps.
    spike_replay: bool = True
    # Consecutive steps above the spike limit that, with no rollback left to try, stop the run with
    # TrainingDiverged: a loss that does not come back. A loss that comes back is never a stop.
    spike_patience: int = 50
    # Keep each rank's share of the newest checkpoint also in host memory, in a holder process that plait train
    # starts on each machine beside its workers (loopback only on one machine); on several machines a second copy
    # goes to the next machine's holder, so a lost machine's ranks reload from their peer's: a restart of the
    # workers then loads from memory instead of the disk, which stays the record and the fallback
    # (docs/checkpoints.md). Costs the copies' host memory (one per rank on one machine, two on several) and their
    # time at each save (on several machines a network transfer of each rank's share to its peer).
    memory_checkpoint: bool = False
    # A rank whose smoothed step time exceeds the median rank's by this factor is named a straggler.
    straggler_factor: float = 1.3
    # Data parallelism: give each rank a share of every global batch proportional to its measured speed
    # (gradients weighted so the update equals the uniform one).
    rebalance: bool = False
    # Testing aid: make this rank (-1: none) slower by slow_factor (it sleeps after its compute).
    slow_rank: int = -1
    # Testing aid: how much slower slow_rank is (3.0: three times the step time).
    slow_factor: float = 1.0

@dataclass
class PsConfig:
    # Ranks that serve parameters (the last ps.servers ranks of the world); the others are workers. Each
    # server holds one size-balanced contiguous slice of all parameters (large tensors are split) and runs
    # the optimizer on it.
    servers: int = 1
    # Consistency: sync (every worker's gradient of a version, averaged: all-reduce data parallelism's
    # update), async (each gradient applied when it arrives), ssp (stale-synchronous, clock-aggregated: the mean
    # of every worker's gradient of clock c is version c + 1, and a worker at clock c reads only parameters of
    # version >= c - staleness, i.e. every update up to clock c - staleness - 1), backup (sync taking the first
    # workers - backup_workers gradients of each version and dropping the rest), dc (async with delay
    # compensation, DC-ASGD).
    mode: Literal["sync", "async", "ssp", "backup", "dc"] = "sync"
    # ssp: the staleness bound s (0 is bulk-synchronous: exactly sync).
    staleness: int = 2
    # backup: b, the gradients of each version not waited for (the slowest b are dropped and counted).
    backup_workers: int = 1
    # dc: lambda of the compensation g + lambda * g * g * (w_now - w_read) (Zheng et al. 2017).
    dc_lambda: float = 0.04
    # dc: adaptive lambda, lambda / sqrt(mean square of g) per element (DC-ASGD-a; mean square momentum 0.95).
    dc_adaptive: bool = False
    # async, ssp, dc: a gradient more than this many versions stale is rejected and counted (-1: never; ssp
    # leaves it out of its clock's mean).
    max_staleness: int = -1
    # async, ssp, dc: a gradient of staleness t is applied with the learning rate / (1 + a * t), a being this
    # value (0: no scaling; staleness-aware ASGD; ssp: a clock's by its gradients' mean staleness).
    staleness_scaling: float = 0.0
    # Workers push their gradient every this many steps (the mean over those steps).
    push_every: int = 1
    # async, dc: workers pull fresh parameters after every this many pushes (computing on their own copy
    # in between).
    pull_every: int = 1

@dataclass
class LaunchConfig:
    # What `plait launch slurm|k8s` writes for a shared cluster; a run itself reads none of it.
    # slurm: the partition (empty: the cluster's default).
    partition: str = ""
    # slurm: the quality of service (--qos); where the cluster preempts by QoS, a lower one may be preempted.
    qos: str = ""
    # slurm: the account the job is charged to (--account).
    account: str = ""
    # slurm: a job array, one task per entry, each entry the config changes of its task, e.g.
    # ["--optim.lr=1e-3", "--optim.lr=3e-4 --train.seed=2"]; each task has its own run directory.
    array: list[str] = field(default_factory=list)
    # Seconds between the scheduler's warning and the kill (SLURM's --signal=B:USR1@<grace>, a pod's
    # terminationGracePeriodSeconds). 0: sized from the run's own step and save times in run.dir, else 120.
    grace_s: int = 0
    # k8s: Kubeflow Trainer v2's TrainJob, or the training operator's PyTorchJob (v1).
    api: Literal["trainjob", "pytorchjob"] = "trainjob"
    # k8s trainjob: the ClusterTrainingRuntime the TrainJob runs on.
    runtime: str = "torch-distributed"
    # k8s: the Kueue LocalQueue (label kueue.x-k8s.io/queue-name); empty: no Kueue.
    queue: str = ""
    # k8s: the Kueue WorkloadPriorityClass (label kueue.x-k8s.io/priority-class); empty: the queue's default.
    priority_class: str = ""
    # k8s: with priority_class, also write that WorkloadPriorityClass with this value (cluster-scoped: creating
    # it needs the right to); 0: it exists already.
    priority: int = 0
