"""``hvd.elastic.ElasticSampler``: a DistributedSampler that remembers how far the epoch got.

Same contract as Horovod's: call ``record_batch`` after each batch and
``set_epoch`` at the *end* of each epoch; when tracked by a TorchState, a resumed
job skips the samples processed before the last commit and splits the rest
over the current ranks.
"""

from __future__ import annotations

import math
import random
from typing import Dict, Iterator

import torch.utils.data

from ..process import rank, size


class ElasticSampler(torch.utils.data.Sampler):
    def __init__(self, dataset, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: reshuffle and forget the processed samples."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one batch of ``batch_size`` per rank as processed."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> Dict[str, int]:
        return dict(epoch=self.epoch, processed_num=self.processed_num)

    def load_state_dict(self, state_dict: Dict[str, int]) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Re-partition the epoch's unprocessed indices over the current ranks."""
        self.num_replicas, self.rank = size(), rank()
        indices = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(indices)  # the same order on every rank
        self.remaining_indices = indices[self.processed_num :]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        indices = self.remaining_indices[:]
        indices += indices[: self.total_size - len(indices)]  # pad to a multiple of the ranks
        return iter(indices[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
