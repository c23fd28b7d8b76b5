"""The training order: which samples each rank takes at each step, as a pure function.

Every rank draws the same permutation of the dataset from ``seed + epoch`` (the
order ``torch.utils.data.DistributedSampler`` draws). Step k of a pass covers the
slice ``[k*G, (k+1)*G)`` of it, G being the global batch (batch size x world
size), and rank r takes every world_size-th sample of that slice. So a step sees
the same samples whatever the world size: 2 ranks with batch B train what 1 rank
with batch 2B trains.

Only whole global batches are trained. The ``N mod G`` samples left at the end of
an epoch's order are not (the next epoch reshuffles, so they are different ones
each time), on every world size, one process included. Padding the last batch
with repeats, as DistributedSampler does, would train more samples on more ranks
and change the weights with the world size.

Each sample's random draws in the dataset (augmentation) come from a seed of its
own, made from (seed, epoch, sample index): not from the rank, the world size, the
batch or the worker that loads it, so augmentation too is the same at any world size.

``position`` (samples of the epoch's order already trained) lets a pass start
where a checkpoint stopped:

* same world size and batch: each rank continues with exactly the samples it
  would have had (bitwise resume);
* another world size, same global batch: the same steps follow, dealt among the
  new ranks, each sample with the random draws it would have had.
"""

from __future__ import annotations

from typing import Iterator, List

import torch

MASK64 = (1 << 64) - 1


def mix_seed(*values: int) -> int:
    """A well-spread 63-bit seed from integers (splitmix64 over them): nearby inputs give unrelated streams."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & MASK64)) * 0xBF58476D1CE4E5B9 & MASK64
        state = (state ^ (state >> 27)) * 0x94D049BB133111EB & MASK64
        state ^= state >> 31
    return state >> 1


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of sample ``index``'s random draws in ``epoch``: the same on every rank and world size."""
    return mix_seed(seed, epoch, index)


class SeededBatch(list):
    """One rank's indices for one step, and what seeds each sample's random transforms (see :mod:`..data.seeded`).

    The seeds are made where the samples are loaded (:meth:`seed_of`), in the
    DataLoader worker when there is one, not in the training's process.
    """

    def __init__(self, indices: List[int], seed: int, epoch: int) -> None:
        super().__init__(indices)
        self.seed, self.epoch = seed, epoch

    def seed_of(self, index: int) -> int:
        """The seed of sample ``index``'s draws: :func:`sample_seed` of the loader's seed and this epoch."""
        return sample_seed(self.seed, self.epoch, index)


def epoch_order(size: int, seed: int, epoch: int) -> List[int]:
    """The epoch's permutation of ``range(size)``, the same on every rank."""
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(size, generator=generator).tolist()


def steps_in_pass(size: int, global_batch: int, position: int = 0) -> int:
    """Whole global batches left in an epoch after ``position`` samples."""
    return max(0, size - position) // global_batch


class TrainBatches:
    """A batch sampler: this rank's indices for each step of one pass, from ``position`` on.

    Set the pass with :meth:`set_pass` before iterating. Each batch gives each of
    its samples a seed from (seed, epoch, sample index), so random augmentation
    depends neither on the world size nor on which worker process, or which run,
    loads it.
    """

    def __init__(self, size: int, batch_size: int, rank: int, world_size: int, seed: int) -> None:
        self.size, self.batch_size, self.rank, self.world_size, self.seed = size, batch_size, rank, world_size, seed
        self.epoch, self.position = 0, 0

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    def set_pass(self, epoch: int, position: int = 0) -> None:
        self.epoch, self.position = epoch, position

    def __len__(self) -> int:
        return steps_in_pass(self.size, self.global_batch, self.position)

    def __iter__(self) -> Iterator[SeededBatch]:
        order = epoch_order(self.size, self.seed, self.epoch)
        g, w = self.global_batch, self.world_size
        for step in range(len(self)):
            start = self.position + step * g
            yield SeededBatch(order[start + self.rank : start + g : w], self.seed, self.epoch)
