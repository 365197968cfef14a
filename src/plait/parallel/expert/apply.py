"""Expert parallelism's step of the composition (``apply_expert``: this rank's slice of the experts, and the shards of
each sequence the MoE layers' balancing statistics are summed over) and its config check (``check_expert``); the
gradients of the experts are ``plait.parallel.expert.sync``'s."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch import nn

from plait.config import Config
from plait.nn.moe import moe_layers
from plait.parallel.compile import check_compile
from plait.parallel.expert.dispatch import check_expert_layout, shard_experts
from plait.parallel.expert.hf import shard_hf_experts
from plait.topology import Topology


class ShardedTokens:
    """A rank's MoE layers see one of ``shards`` equal shards of every sequence (context parallelism; with sequence
    parallelism, the tensor-parallel ranks' shards too): the balancing losses take their expert counts over the whole
    sequences (``sum``: an all-reduce over ``group`` in the forward, of ``E`` counts per layer, or ``B x E`` for the
    sequence-wise loss; no gradient flows through it), so they equal one process's on the whole sequences
    (``plait.nn.moe.WholeTokens``). ``summed``: the ranks of the group whose gradients add (sequence parallelism's)."""

    def __init__(self, group: dist.ProcessGroup | None, shards: int, summed: int) -> None:
        self.group, self.shards, self.summed = group, shards, summed

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return fc.all_reduce(t, "sum", self.group)


def token_axes(topo: Topology, sequence_parallel: bool) -> tuple[str, ...]:
    """The mesh axes whose ranks hold other tokens of the same sequences: cp, and tp under sequence parallelism (each
    tp rank's MoE layers route its own sequence shard)."""
    return ("cp", "tp") if sequence_parallel and topo.degree("tp") > 1 else ("cp",)


def apply_expert(model: nn.Module, topo: Topology, dispatcher: str, sequence_parallel: bool = False) -> nn.Module:
    """This rank's slice of the experts (dispatched by ``moe.dispatcher``): plait's MoE layers or a Hugging Face
    model's sparse blocks; and plait's MoE layers' balancing statistics summed over the shards of each sequence
    (``ShardedTokens``). The model unchanged at ep = 1 with whole sequences."""
    layers = moe_layers(model)
    if topo.ep > 1:
        shard = shard_experts if layers else shard_hf_experts
        shard(model, topo.ep, topo.coord("ep"), topo.ep_group, dispatcher)
    axes = token_axes(topo, sequence_parallel)
    shards = math.prod(topo.degree(a) for a in axes)
    if shards > 1:
        tokens = ShardedTokens(topo.group(*axes), shards, shards // topo.degree("cp"))
        for layer in layers:
            layer.tokens = tokens
    return model


def check_expert(cfg: Config, degrees: dict[str, int]) -> None:
    """The MoE settings and expert parallelism's own (every config: an MoE model may run at ep = 1)."""
    check_expert_layout(cfg.moe, cfg.parallel)
    check_compile(cfg.train.compile, degrees["ep"], cfg.moe.dispatcher)
