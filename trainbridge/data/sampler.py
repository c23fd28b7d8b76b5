"""The training sampler: DistributedSampler's order, able to start mid-epoch.

Every rank draws the same permutation from ``seed + epoch`` (exactly as
``torch.utils.data.DistributedSampler``, padded to a multiple of the world size)
and rank r takes every world_size-th index. ``set_epoch(epoch, position)`` skips
the first ``position`` samples of that global order, which is how a resumed run
continues at the next unseen batch:

* same world size and batch: position = steps done x world x batch, so each rank
  continues with exactly the indices it would have had (bitwise resume);
* another world size: the remaining samples of the epoch are re-dealt among the
  new ranks. Every sample of the epoch is still seen exactly once, but which
  rank sees which, and so the composition of each batch, changes from there on.
"""
from __future__ import annotations

import math
from typing import Iterator

import torch
from torch.utils.data import DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    def __init__(self, dataset_size: int, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(range(dataset_size), num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.position = 0

    def set_epoch(self, epoch: int, position: int = 0) -> None:
        super().set_epoch(epoch)
        self.position = position

    def _global_order(self):
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.dataset), generator=generator).tolist()
        padding = self.total_size - len(order)
        # Same padding as DistributedSampler: repeat the start of the order.
        order += (order * math.ceil(padding / max(len(order), 1)))[:padding]
        return order

    def __iter__(self) -> Iterator[int]:
        return iter(self._global_order()[self.position + self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        remaining = self.total_size - self.position - self.rank
        return max(0, math.ceil(remaining / self.num_replicas))
