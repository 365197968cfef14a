"""Tensor (and sequence) parallelism's step of the composition (``apply_tensor``) and its config check
(``check_tensor``). Which plan applies (``tp_function``): a user's ``parallelize_fn``, the ``parallelize`` of the spec
registered for the model's class (plait's GPT; ``plait.parallel.train_spec``), a Hugging Face model's shipped plan as
transformers means it (``plait.parallel.tensor.hf``), or a dict / "auto" plan (``plait.parallel.tensor.plan``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from plait.config import Config, ConfigError, ParallelConfig
from plait.parallel.model_specs import spec_for
from plait.parallel.spec import ModelSpec
from plait.parallel.tensor.hf import hf_tp_function
from plait.parallel.tensor.plan import resolve_tp, retie, tied_names
from plait.topology import Topology


def tp_function(model: nn.Module, p: ParallelConfig, spec: ModelSpec) -> Callable[[nn.Module, Any], nn.Module]:
    """The function that shards ``model`` over a tp mesh (see the module docstring); raises when no plan applies."""
    registered = getattr(spec_for(model), "parallelize", None)
    if spec.parallelize_fn is None and registered is None:  # a Hugging Face plan, as transformers means it
        hf = hf_tp_function(model, spec.tp_plan, p.ep > 1, p.sequence_parallel)
        if hf is not None:
            return hf
    return resolve_tp(model, spec.tp_plan, spec.parallelize_fn,
                      (lambda m, mesh: registered(m, mesh, p)) if registered is not None else None,
                      sequence_parallel=p.sequence_parallel)


def apply_tensor(model: nn.Module, topo: Topology, p: ParallelConfig, spec: ModelSpec) -> nn.Module:
    """Tensor (and sequence) parallelism by ``spec``'s plan over the tp axis; the model unchanged at tp = 1."""
    if topo.degree("tp") == 1:
        return model
    tied = tied_names(model)
    model = tp_function(model, p, spec)(model, topo.mesh["tp"])
    retie(model, tied)  # whatever sharded it (a user's parallelize_fn too), a tied weight stays one tensor
    return model


def check_tensor(cfg: Config, degrees: dict[str, int]) -> None:
    """Tensor parallelism's own settings."""
    p = cfg.parallel
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1")
