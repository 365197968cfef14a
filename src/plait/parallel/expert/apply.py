"""Expert parallelism's step of the composition (``apply_expert``: this rank's slice of the experts) and its config
check (``check_expert``); the gradients of the experts are ``plait.parallel.expert.sync``'s."""

from __future__ import annotations

from torch import nn

from plait.config import Config
from plait.nn.moe import moe_layers
from plait.parallel.compile import check_compile
from plait.parallel.expert.dispatch import check_expert_layout, shard_experts
from plait.parallel.expert.hf import shard_hf_experts
from plait.topology import Topology


def apply_expert(model: nn.Module, topo: Topology, dispatcher: str) -> nn.Module:
    """This rank's slice of the experts (dispatched by ``moe.dispatcher``): plait's MoE layers or a Hugging Face
    model's sparse blocks; the model unchanged at ep = 1."""
    if topo.ep > 1:
        shard = shard_experts if moe_layers(model) else shard_hf_experts
        shard(model, topo.ep, topo.coord("ep"), topo.ep_group, dispatcher)
    return model


def check_expert(cfg: Config, degrees: dict[str, int]) -> None:
    """The MoE settings and expert parallelism's own (every config: an MoE model may run at ep = 1)."""
    check_expert_layout(cfg.moe, cfg.parallel)
    check_compile(cfg.train.compile, degrees["ep"], cfg.moe.dispatcher)
