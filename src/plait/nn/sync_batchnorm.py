"""BatchNorm whose training statistics span every rank's batch, on any device and backend (gloo included).

``torch.nn.SyncBatchNorm`` refuses CPU tensors, so CPU runs on gloo need their own. This one moves two
small flat tensors per layer and step: forward all-reduces the per-channel [sum, sum of squares] and the
sample count, backward all-reduces the per-channel [sum(dy), sum(dy * x_hat)]. Outside training, or
with no process group or a group of one, it is exactly ``nn.BatchNorm``.

Gradient contract (the same as ``torch.nn.SyncBatchNorm``, so data parallelism needs nothing special).
Let rank r hold ``n_r`` samples and compute a loss ``L_r``; let ``W`` be the group size and ``M`` the
sum of the ``n_r``. The gradient this layer passes to its input on rank r is the gradient of the SUM
``L_1 + ... + L_W`` with respect to rank r's inputs (the all-reduced sums carry every rank's ``dy``, and
are divided by ``M`` only, never by ``W``); the gradients of ``weight`` and ``bias`` are rank r's LOCAL
share of that sum's gradient (this rank's samples only, no all-reduce). Summing any parameter's
gradients over ranks therefore gives the gradient of ``sum_r L_r``, and averaging them, as plait's
data-parallel reducer does, gives the gradient of ``mean_r L_r``. Hence:

* equal local batches (``n_r = M / W``) with each rank's loss the MEAN over its own samples, gradients
  AVERAGED over ranks: exactly the gradient of single-process training on the concatenated batch with
  the loss averaged over all ``M`` samples (input gradients on each rank are then ``W`` times the
  single-process ones; the averaging divides the ``W`` back out of every parameter gradient);
* uneven local batches: ``mean_r L_r`` weights the ranks' means equally, not the samples. For equality
  either scale rank r's mean loss by ``W * n_r / M`` before averaging, or make it ``sum_i l_i / M`` and
  SUM the gradients over ranks (then input gradients equal the single-process ones exactly).

The normalisation itself (outputs, running statistics) is that of the global batch whatever the split.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


def _reduce_dims(x: torch.Tensor) -> list[int]:
    """Every dim but channels (dim 1): the batch and the spatial dims."""
    return [0, *range(2, x.dim())]


def _per_channel(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``(C,)`` -> ``(1, C, 1, ...)``, broadcastable against ``x``."""
    return t.view(1, -1, *([1] * (x.dim() - 2)))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # Half-precision inputs are normalised in float32, as torch's BatchNorm kernels do.
    return torch.promote_types(x.dtype, torch.float32)


def _global_stats(x: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-channel mean and biased variance of ``x`` over the whole group's batch, and the global count.

    Communication: forward, one all-reduce (sum) of a flat float64 tensor ``[sum (C), sum of squares (C),
    count (1)]`` over ``group``; backward, none (it runs on detached values; the gradient through the
    statistics is ``_SyncBatchNormFn``'s). Every rank must call it, with any local batch size, zero included.
    Raises ValueError on every rank alike when the group holds at most one value per channel.
    """
    num_channels = x.size(1)
    n = x.numel() // num_channels
    if n > 0:
        var, mean = torch.var_mean(x.detach().to(_compute_dtype(x)), dim=_reduce_dims(x), correction=0)
        mean, var = mean.double(), var.double()  # (C,), (C,)
    else:
        mean = var = torch.zeros(num_channels, dtype=torch.float64, device=x.device)
    # The sum of squares is rebuilt as n * (var + mean^2) from a centred local pass and combined in float64:
    # summing raw x^2 in float32 and subtracting mean^2 later cancels badly when |mean| >> std.
    stats = torch.cat([mean * n, (var + mean * mean) * n, mean.new_full((1,), n)])  # (2C + 1,)
    dist.all_reduce(stats, group=group)
    count = int(stats[-1].item())
    if count <= 1:
        raise ValueError(f"SyncBatchNorm expects more than 1 value per channel when training; got {count} "
                         f"across the group for input of size {tuple(x.shape)}")
    mean = stats[:num_channels] / count
    var = (stats[num_channels:-1] / count - mean * mean).clamp_min(0)
    return mean, var, count


class _SyncBatchNormFn(torch.autograd.Function):
    """Normalise with given global statistics; backward accounts for their dependence on every rank's input.

    Communication: forward, none; backward, one all-reduce (sum) of a flat ``[sum(dy) (C),
    sum(dy * x_hat) (C)]`` over the group when the input needs a gradient (the same on every rank, since
    every rank runs the same model). ``weight``/``bias`` gradients are local sums (see the module docstring).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                mean: torch.Tensor, invstd: torch.Tensor, count: int,
                group: dist.ProcessGroup | None) -> torch.Tensor:
        # Keep x, not x_hat: x is usually saved by the layer before anyway; x_hat is recomputed in backward.
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.count, ctx.group = count, group
        ctx.bias_dtype = None if bias is None else bias.dtype
        y = (x.to(mean.dtype) - _per_channel(mean, x)) * _per_channel(invstd, x)  # (N, C, *)
        if weight is not None:
            y = y * _per_channel(weight.to(mean.dtype), x)
        if bias is not None:
            y = y + _per_channel(bias.to(mean.dtype), x)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        dims = _reduce_dims(x)
        dyf = dy.to(mean.dtype)  # (N, C, *)
        x_hat = (x.to(mean.dtype) - _per_channel(mean, x)) * _per_channel(invstd, x)  # (N, C, *)
        sum_dy = dyf.sum(dims)  # (C,)
        sum_dy_xhat = (dyf * x_hat).sum(dims)  # (C,)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            sums = torch.cat([sum_dy, sum_dy_xhat])  # (2C,); a copy, so the local sums stay local
            dist.all_reduce(sums, group=ctx.group)
            # Divided by the global count only: the reduced sums already hold every rank's dy, so this is
            # d(sum_r L_r)/dx; the reducer's average over ranks supplies the 1/W (module docstring).
            mean_dy, mean_dy_xhat = (sums / ctx.count).chunk(2)
            scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
            grad_x = (dyf - _per_channel(mean_dy, x) - x_hat * _per_channel(mean_dy_xhat, x)) * _per_channel(scale, x)
            grad_x = grad_x.to(x.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(ctx.bias_dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the concatenation of every rank's batch, for input ``(N, C, *)`` of any rank >= 2.

    Contract: in training mode, with ``torch.distributed`` initialised and more than one rank in
    ``process_group`` (None: the default group), outputs and running statistics equal those of
    ``nn.BatchNorm`` applied to the concatenation of all ranks' inputs (local batch sizes may differ,
    zero included); gradients follow the module docstring's contract. Every rank of the group must call
    forward (and backward) for this layer in the same order. Communication: forward, one all-reduce of
    ``[sum (C), sum of squares (C), count]``; backward, one all-reduce of ``[sum(dy) (C), sum(dy*x_hat) (C)]``.
    Otherwise (eval mode, no process group, or a group of one) it is exactly ``nn.BatchNorm`` and moves
    nothing. Its parameters, buffers and state-dict keys are those of ``nn.BatchNorm``.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: dist.ProcessGroup | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects input of shape (N, C, *) with at least 2 dims; "
                             f"got {input.dim()}D input")

    def _synchronised(self) -> bool:
        return (self.training and dist.is_available() and dist.is_initialized()
                and dist.get_world_size(self.process_group) > 1)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``input``: ``(N, C, *)`` -> normalised ``(N, C, *)`` (see the class contract)."""
        self._check_input_dim(input)
        if not self._synchronised():
            return super().forward(input)
        mean, var, count = _global_stats(input, self.process_group)  # (C,), (C,) float64
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            self._update_running_stats(mean, var, count)
        dtype = _compute_dtype(input)
        invstd = torch.rsqrt(var + self.eps)
        return _SyncBatchNormFn.apply(input, self.weight, self.bias, mean.to(dtype), invstd.to(dtype), count,
                                      self.process_group)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: int) -> None:
        # The same bookkeeping as _BatchNorm.forward + F.batch_norm: a cumulative average when momentum is
        # None, and the unbiased variance of the global batch.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = var * (count / (count - 1))
        self.running_mean.copy_(self.running_mean.double().lerp(mean, factor))
        self.running_var.copy_(self.running_var.double().lerp(unbiased, factor))


def convert_sync_batchnorm(module: nn.Module, process_group: dist.ProcessGroup | None = None) -> nn.Module:
    """Replace every ``nn.BatchNorm1d/2d/3d`` (any ``_BatchNorm``) in ``module`` with a ``SyncBatchNorm``.

    Contract: like ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``. Children are replaced in place
    under the same names, so ``state_dict`` keys and values do not change; the new layers share the old
    ones' weight and bias Parameters (an optimizer built earlier still holds the right ones) and running
    buffers, and copy eps, momentum, affine, track_running_stats and the train/eval mode. Returns
    ``module`` itself, or a new ``SyncBatchNorm`` when ``module`` is itself a BatchNorm. Layers that are
    already plait ``SyncBatchNorm``s are kept as they are. Raises ValueError for a lazy BatchNorm that
    has not yet seen an input.
    """
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
            raise ValueError("convert_sync_batchnorm: run one forward through the lazy BatchNorm first, "
                             "so its number of features is known")
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group)
        if module.affine:
            out.weight, out.bias = module.weight, module.bias
        # Buffers are assigned, not copied, so device, dtype and the None of untracked stats carry over.
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, process_group))
    return out
