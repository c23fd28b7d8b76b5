"""``hvd.SyncBatchNorm``: batch statistics over the whole global batch, on CPU and GPU.

The mean and variance are computed from per-channel sums allreduced over all
ranks in float64 (two passes: the mean first, then the centred squares, which is
more accurate than E[x^2] - E[x]^2). Because our allreduce is differentiable (the gradient of a Sum
allreduce is the Sum allreduce of the gradient), autograd derives the same
backward pass as Horovod's hand-written one: input gradients include every
rank's contribution through the shared statistics, weight and bias gradients
stay local (DistributedOptimizer averages them).
"""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from .collectives import allreduce
from .process import size
from .reduce_ops import Sum


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over N-D input (N, C, ...) whose statistics span all ranks in training mode."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalise ``input`` with the statistics of the whole global batch (training) or the running ones."""
        self._check_input_dim(input)
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats or size() == 1:
            return super().forward(input)
        factor = 0.0
        if self.training and self.track_running_stats:
            assert self.num_batches_tracked is not None  # _BatchNorm registers it with track_running_stats
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum

        dims = [0] + list(range(2, input.dim()))
        shape = [1, -1] + [1] * (input.dim() - 2)
        count = torch.tensor([input.numel() / input.shape[1]], dtype=torch.float64, device=input.device)
        # Global sum and element count per channel in one allreduce, then the global mean. The
        # per-channel sums cross ranks in float64, so the statistics do not depend on the order in
        # which the ranks' sums are added (a float32 ring sum of 3 ranks may round differently).
        totals = allreduce(torch.cat([input.sum(dims).double(), count]), op=Sum)
        total_count = totals[-1]
        mean = (totals[:-1] / total_count).to(input.dtype)
        centred = input - mean.view(shape)
        var = (allreduce((centred * centred).sum(dims).double(), op=Sum) / total_count).to(input.dtype)
        output = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            output = output * self.weight.view(shape) + self.bias.view(shape)

        if self.training and self.track_running_stats:
            # _BatchNorm registers the running statistics with track_running_stats
            assert self.running_mean is not None and self.running_var is not None
            with torch.no_grad():
                unbiased = var * total_count / (total_count - 1).clamp(min=1)
                self.running_mean.mul_(1 - factor).add_(mean.detach() * factor)
                self.running_var.mul_(1 - factor).add_(unbiased.detach() * factor)
        return output
