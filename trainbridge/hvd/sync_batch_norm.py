"""``hvd.SyncBatchNorm``: batch statistics over the whole global batch, on CPU and GPU.

The layer of :mod:`trainbridge.backends.sync_batchnorm` (float64 per-channel sums over the
ranks in forward and backward), summing with this module's own allreduce.
As Horovod's, it takes the global batch's statistics whenever it uses batch statistics
(also in eval mode without running statistics), and in a job of one process it is plain
BatchNorm.
"""

from __future__ import annotations

import torch

from ..backends.sync_batchnorm import SyncBatchNorm as _SyncBatchNorm
from .collectives import allreduce
from .process import size
from .reduce_ops import Sum


def _sum_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    return allreduce(tensor, op=Sum)


class SyncBatchNorm(_SyncBatchNorm):
    """BatchNorm over N-D input (N, C, ...) whose statistics span all ranks in training mode."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, sum_over_ranks=_sum_over_ranks)

    def _over_ranks(self) -> bool:
        return size() > 1 and (self.training or not self.track_running_stats)
