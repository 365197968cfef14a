"""Sequence parallelism for a module that computes every token on its own (an MoE layer: its router, its experts):
``LocalTokens`` runs it on this rank's sequence shard, as Megatron-LM runs MoE layers under sequence parallelism.

Forward: the module's input, a ``Shard(1)`` DTensor of the residual stream (a ``SequenceParallel`` norm's output),
enters as its local shard ``(B, T / tp, C)``, and the output is the local shard the residual stream adds it to: no
communication in forward, none for the input's gradient in backward, where a gathered input would cost an all-gather
and a reduce-scatter per layer.

Parameters: each becomes a replicated DTensor over tp. The module computes with its local tensor, taken with a
``Partial`` gradient placement: each tp rank's gradient covers its own tokens, and their sum over tp is the whole
sequence's. The sum happens where a gradient-sync policy reads the gradient (``plait.parallel.data.reducer.local_grad``
redistributes it like its parameter; FSDP2 does the same before its reduce-scatter), as for the norms under
``SequenceParallel``; expert-parallel parameters are summed over tp with their expert-data-parallel ranks
(``plait.parallel.expert.sync``). The local tensors are swapped in around the forward of each module holding
parameters (FSDP2 units prepend their own hook, which gathers the parameters first), and swapped back after it.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import ParallelStyle


class LocalTokens(ParallelStyle):
    """The module on this rank's sequence shard, its parameters replicated over tp with gradients summed over tp (see
    the module docstring). Use it for a module whose output for a token depends on that token alone."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for m in module.modules():
            own = list(m.named_parameters(recurse=False))
            for name, q in own:
                if not isinstance(q, DTensor):
                    m.register_parameter(name, nn.Parameter(
                        DTensor.from_local(q.data, device_mesh, [Replicate()], run_check=False),
                        requires_grad=q.requires_grad))
            if own and m is not module:  # acts once the submodule is an FSDP2 unit (its own hook gathers it first)
                m.register_forward_pre_hook(lambda unit, _args: _use_local(unit) if _is_unit(unit) else None)
                m.register_forward_hook(lambda unit, _args, _out: _put_back(unit) if _is_unit(unit) else None)
        # the parameters outside nested FSDP2 units, the module's own included (the module may read a submodule's
        # without calling it: an MoE's router weight)
        module.register_forward_pre_hook(lambda _m, args: _enter(module, args))
        module.register_forward_hook(lambda _m, _args, _out: _put_back(module))
        return module


def _is_unit(m: nn.Module) -> bool:
    return isinstance(m, FSDPModule)


def _outside_units(module: nn.Module) -> list[nn.Module]:
    """``module`` and its submodules, those inside a nested FSDP2 unit left out."""
    out, stack = [], [module]
    while stack:
        m = stack.pop()
        if m is not module and _is_unit(m):
            continue
        out.append(m)
        stack.extend(m.children())
    return out


def _enter(module: nn.Module, args: tuple) -> tuple:
    _use_local(module)
    return tuple(a.to_local() if isinstance(a, DTensor) else a for a in args)


def _use_local(module: nn.Module) -> None:
    """Each replicated parameter of ``module`` and of its submodules outside nested FSDP2 units (or the gathered one a
    unit registered) as its local tensor whose gradient is a partial sum over tp; the parameters are kept to be put
    back after the forward."""
    for m in _outside_units(module):
        held = {}
        for name, q in m._parameters.items():
            if isinstance(q, DTensor):
                held[name] = q
                m._parameters[name] = q.to_local(grad_placements=[Partial()] * q.device_mesh.ndim)
        m._plait_held = held


def _put_back(module: nn.Module) -> None:
    for m in _outside_units(module):
        m._parameters.update(m.__dict__.pop("_plait_held", {}))


__all__ = ["LocalTokens"]
