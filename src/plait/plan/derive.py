"""What the simulator takes from the code that trains, so that it cannot drift from the trainer.

* ``reducer_buckets``: the data-parallel reducer's buckets, by the grouping rule the reducer itself uses
  (``plait.plan.buckets.reducer_groups``) over the rank's parameter sizes (25 MB buckets, the first capped
  at 1 MiB, reverse registration order).
* ``zero_buckets``: ZeRO-1/2's flat buckets and their padding, by the ZeRO optimizer's own rule
  (``plait.plan.buckets.zero_groups``; under tensor parallelism a bucket holds one sharding pattern: tp shards, or
  parameters replicated over tp).
* ``fsdp_units``: ZeRO-3's units as ``plait.parallel.fsdp.shard.apply_fsdp`` wraps them: each block
  (``plait.parallel.units.find_blocks``) and the root with everything else.
* ``tp_collectives``: the tensor-parallel collectives of one block and of the rest of the model, recorded
  from a forward and backward of the real model with the real tensor-parallel plan applied, built on the
  meta device and run over PyTorch's fake process group (no memory, no peers). A model with one block
  and one with two give the per-block pattern as their difference.
* ``operator_counts``: how many operators the dispatcher runs per block and for the rest of the model,
  forward and backward (recomputation included when the blocks are checkpointed), and how many of them
  are DTensor operators under tensor parallelism, and the fraction of parameter tensors that are DTensors
  (each optimizer operator on one goes through DTensor too): counted on the real model built on the meta
  device, like the collectives. On a CPU each costs the calibrated per-operator overhead.
* ``optimizer_traffic``: operators per parameter tensor and bytes per element of one step of the
  optimizer plait builds from ``[optim]`` (``plait.components.optim.adamw``), counted on tiny real tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.plan.buckets import padded, reducer_groups, zero_groups
from plait.plan.params import Param


def reducer_buckets(params: list[Param], tp: int, bucket_mb: float) -> list[list[int]]:
    """Indices into ``params`` of each data-parallel bucket, in launch order (the reducer's own grouping, of
    the parameters in reverse: the order their gradients are ready)."""
    n = len(params)
    sizes = [(4 * params[i].local_numel(tp), "fp32") for i in reversed(range(n))]
    return [[n - 1 - j for j in group] for group in reducer_groups(sizes, int(bucket_mb * 2**20))]


def zero_buckets(params: list[Param], tp: int, bucket_mb: float, world: int) -> list[tuple[list[int], int]]:
    """ZeRO-1/2 buckets (the optimizer's own grouping, one param group, fp32): (indices into ``params``, padded
    element count) in launch order. Under tensor parallelism each sharding pattern (tp shards, replicated) fills its
    own buckets, the patterns numbered as the parameters first show them (``plait.parallel.zero.optimizer``: a
    bucket's squares are summed over one set of groups)."""
    numels = [p.local_numel(tp) for p in params]
    patterns: dict[bool, int] = {}
    owners = [patterns.setdefault(tp > 1 and p.shard_dim is not None, len(patterns)) for p in params]
    groups = zero_groups(numels, owners, max(1, int(bucket_mb * 2**20 / 4)))
    return [(index, padded(sum(numels[i] for i in index), world)) for _, index in groups]


def fsdp_units(params: list[Param], n_layer: int) -> list[list[int]]:
    """ZeRO-3 units: one per block (in model order), then the root unit (embedding, final norm, head)."""
    blocks: dict[int, list[int]] = {}
    root: list[int] = []
    for i, p in enumerate(params):
        if 0 <= p.layer < n_layer:
            blocks.setdefault(p.layer, []).append(i)
        else:
            root.append(i)
    return [blocks[k] for k in sorted(blocks)] + [root]


def fsdp_shard_numel(p: Param, tp: int, world: int) -> int:
    """Elements of ``p`` one rank holds under FSDP2: dim 0 of the (tp-local) tensor split in ``world``
    equal padded chunks."""
    shape = p.local_shape(tp)
    rest = 1
    for d in shape[1:]:
        rest *= d
    return -(-shape[0] // world) * rest


# -- tensor-parallel collectives --------------------------------------------------------------------
@dataclass(frozen=True)
class Collective:
    """One collective a rank issued: ``op`` (all_reduce, all_gather, reduce_scatter), the bytes of its
    full buffer and whether it ran in backward."""

    op: str
    nbytes: int
    backward: bool


@dataclass(frozen=True)
class OperatorCounts:
    """Dispatcher operators per block (``block``, checkpointed ``block_recomputed``) and for the rest of
    the model, each ``(forward, backward)``; ``dtensor_*`` the DTensor operators among them (tp > 1)."""

    block: tuple[int, int]
    block_recomputed: tuple[int, int]
    rest: tuple[int, int]
    dtensor_block: tuple[int, int] = (0, 0)
    dtensor_rest: tuple[int, int] = (0, 0)
    dtensor_params: float = 0.0  # fraction of the parameter tensors that are DTensors (the optimizer's steps)
