"""Synchronized BatchNorm: batch statistics over the whole global batch, on every backend, CPU and GPU.

Plain BatchNorm normalises each rank's share of a batch with that share's statistics, so
the model depends on the world size. :class:`SyncBatchNorm` computes each channel's mean
and variance over every rank's samples from two sums over the ranks: the sum and the count
first, then the squares centred on the global mean (more accurate than E[x^2] - E[x]^2).
The sums cross ranks in float64, so the statistics do not depend on the order in which the
ranks' sums are added. Every rank gets the same sums, so every rank holds the same running
statistics.

The backward pass needs every rank's share too: an input's gradient depends on all the
samples through the shared statistics, so the per-channel sums of the output gradient
(and of its product with the normalised input) cross the ranks in one more sum. Weight and
bias gradients stay per rank, averaged with the model's other gradients. The backend gives
the sum over the ranks (``Backend.sum_over_ranks``).

Cost: two small allreduces (``2 * channels + 1`` and ``channels`` float64 values) per layer
per training forward and one (``2 * channels``) in backward, each a wait for every rank.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

from ..errors import UserError

SumOverRanks = Callable[[torch.Tensor], torch.Tensor]


class RankSum:
    """A layer's sum over the ranks of its job; a copy of the model (``deepcopy``, ``AveragedModel``) shares it."""

    def __init__(self, sum_over_ranks: SumOverRanks) -> None:
        self.sum_over_ranks = sum_over_ranks

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.sum_over_ranks(tensor)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "RankSum":
        return self  # the copy lives in this process and sums over the same ranks


class _GlobalBatchNorm(torch.autograd.Function):
    """BatchNorm's training forward and backward with the statistics of every rank's samples.

    Returns the output, and the batch's mean and unbiased variance (float64, per channel) for the
    running statistics. Half-precision inputs (under autocast) are normalised in float32, as
    BatchNorm's own kernels do, and the output and input gradient are in the input's dtype.
    """

    @staticmethod
    def forward(ctx: Any, input, weight, bias, eps: float, sum_over_ranks: SumOverRanks):
        dims, shape = _channel_dims(input)
        x = input.to(_compute_dtype(input.dtype))
        per_channel = x.numel() // x.shape[1] if x.shape[1] else 0
        count = torch.full((1,), per_channel, dtype=torch.float64, device=x.device)
        # The per-channel sums and counts of every rank's samples in one allreduce, then the global mean.
        totals = sum_over_ranks(torch.cat([x.sum(dims).double(), count]))
        total = totals[-1:]
        if per_channel <= 1 and float(total) <= 1:  # total is the same on every rank: all raise, or none
            raise ValueError(
                f"Expected more than 1 value per channel when training, got input size {list(input.shape)} "
                f"with {int(total)} value(s) per channel over all ranks"
            )
        mean = totals[:-1] / total
        normalized = x - mean.to(x.dtype).view(shape)
        # The centred squares over every rank's samples: the global (biased) variance.
        var = sum_over_ranks((normalized * normalized).sum(dims).double()) / total
        invstd = torch.rsqrt(var + eps).to(x.dtype)
        normalized.mul_(invstd.view(shape))
        output = normalized if weight is None else normalized * weight.to(x.dtype).view(shape)
        output = output if bias is None else output + bias.to(x.dtype).view(shape)
        ctx.save_for_backward(normalized.to(input.dtype), invstd, weight, total)
        ctx.sum_over_ranks = sum_over_ranks
        unbiased_var = var * total / (total - 1)
        ctx.mark_non_differentiable(mean, unbiased_var)
        return output.to(input.dtype), mean, unbiased_var

    @staticmethod
    def backward(ctx: Any, grad_output, _mean, _var):
        normalized, invstd, weight, total = ctx.saved_tensors
        dims, shape = _channel_dims(grad_output)
        dy, normalized = grad_output.to(invstd.dtype), normalized.to(invstd.dtype)
        sum_dy = dy.sum(dims)
        sum_dy_normalized = (dy * normalized).sum(dims)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            # dL/dx = w * invstd * (dy - mean(dy) - x_hat * mean(dy * x_hat)), the means over every rank's samples.
            means = ctx.sum_over_ranks(torch.cat([sum_dy, sum_dy_normalized]).double()) / total
            mean_dy, mean_dy_normalized = means.to(dy.dtype).chunk(2)
            scale = invstd if weight is None else invstd * weight.to(dy.dtype)
            grad_input = dy - mean_dy.view(shape) - normalized * mean_dy_normalized.view(shape)
            grad_input = grad_input.mul_(scale.view(shape)).to(grad_output.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_normalized.to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(weight.dtype if weight is not None else grad_output.dtype)
        return grad_input, grad_weight, grad_bias, None, None


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision inputs (their sums would round at every step), else the input's own."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _channel_dims(tensor: torch.Tensor):
    """The dimensions a channel's statistics are taken over, and the shape that broadcasts a channel's value."""
    return [0, *range(2, tensor.dim())], [1, -1] + [1] * (tensor.dim() - 2)


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over (N, C, ...) input whose training statistics span every rank's samples.

    ``sum_over_ranks``: the job's sum of a tensor over all ranks (identity in one process).
    Every rank must run the same training forwards, as it runs the same backward passes
    (each is a collective). In eval mode the layer waits for no rank: it normalises with its running
    statistics (without them, with its own batch's, as plain BatchNorm does), so evaluation
    shards may be uneven.
    """

    # Every rank holds the same running statistics: the job's same-model check compares them.
    synchronized = True

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        *,
        sum_over_ranks: SumOverRanks,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.sum_over_ranks = sum_over_ranks if isinstance(sum_over_ranks, RankSum) else RankSum(sum_over_ranks)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _over_ranks(self) -> bool:
        """Whether this forward takes the global batch's statistics (then every rank must run it)."""
        return self.training

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalise ``input`` with the whole global batch's statistics (training) or as plain BatchNorm (eval)."""
        self._check_input_dim(input)
        if not self._over_ranks():
            return super().forward(input)
        output, mean, unbiased_var = _GlobalBatchNorm.apply(
            input, self.weight, self.bias, self.eps, self.sum_over_ranks
        )
        if self.training and self.track_running_stats:
            self._update_running_stats(mean, unbiased_var)
        return output

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
        # _BatchNorm registers these with track_running_stats.
        assert self.running_mean is not None and self.running_var is not None and self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype) * factor)
        self.running_var.mul_(1 - factor).add_(unbiased_var.to(self.running_var.dtype) * factor)


def synchronized_copy(norm: _BatchNorm, sum_over_ranks: SumOverRanks) -> SyncBatchNorm:
    """A :class:`SyncBatchNorm` holding ``norm``'s own parameters and buffers (so an optimizer built on them
    still steps it), with its settings and training flag."""
    sync = SyncBatchNorm(
        norm.num_features,
        norm.eps,
        norm.momentum,
        norm.affine,
        norm.track_running_stats,
        sum_over_ranks=sum_over_ranks,
        device="meta",  # every tensor is replaced by norm's next
    )
    if norm.affine:
        sync.weight, sync.bias = norm.weight, norm.bias
    if norm.track_running_stats:
        sync.running_mean, sync.running_var = norm.running_mean, norm.running_var
        sync.num_batches_tracked = norm.num_batches_tracked
    sync.train(norm.training)
    if hasattr(norm, "qconfig"):
        sync.qconfig = norm.qconfig
    return sync


def meant_to_sync(module: nn.Module) -> bool:
    """A BatchNorm layer its author meant to be synchronized: torch's, trainbridge's or another library's
    ``SyncBatchNorm`` (Horovod's, apex's), which alone would not span the ranks on every backend."""
    return isinstance(module, _BatchNorm) and (
        isinstance(module, (nn.SyncBatchNorm, SyncBatchNorm)) or type(module).__name__ == "SyncBatchNorm"
    )


def synchronize_batchnorm(model: nn.Module, sum_over_ranks: SumOverRanks, every_batchnorm: bool) -> nn.Module:
    """``model`` with its BatchNorm layers (every ``_BatchNorm`` when ``every_batchnorm``, else those
    :func:`meant_to_sync`) replaced by :class:`SyncBatchNorm` layers summing with ``sum_over_ranks``.

    The state_dict keys stay the same; a layer used at two places becomes one synchronized layer.
    """
    rank_sum = RankSum(sum_over_ranks)
    replaced: Dict[int, nn.Module] = {}

    def convert(module: nn.Module) -> nn.Module:
        if id(module) in replaced:
            return replaced[id(module)]
        new = module
        if isinstance(module, _BatchNorm) and (every_batchnorm or meant_to_sync(module)):
            if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
                raise UserError(
                    f"job.prepare: the {type(module).__name__} layer has not seen its input yet, so it cannot be "
                    f"synchronized; run one forward pass (a batch through the model) before job.prepare"
                )
            new = synchronized_copy(module, rank_sum)
        replaced[id(module)] = new
        # Every child slot, also a second slot of one module (named_children() names it once).
        for name, child in list(module._modules.items()):
            converted = convert(child) if child is not None else None
            if converted is not child:
                new.add_module(name, converted)
        return new

    return convert(model)
