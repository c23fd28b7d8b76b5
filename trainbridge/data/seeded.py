"""Random transforms that do not depend on the world size, and resume bitwise: each sample has its own seed.

A DataLoader worker seeds torch, ``random`` and numpy once, when it starts, and
then draws from them sample after sample, so a sample's random crop depends on
which rank and worker load it, and on what they loaded before: another world size,
another worker count or a resumed run would augment it differently. Here the three
generators are reseeded before every sample from the seed its
:class:`~trainbridge.data.sampler.SeededBatch` carries for it (from the loader's
seed, the epoch and the sample's index), in a worker or in the main process (where
the training's own generators are put back afterwards, so dropout draws the same
numbers whether data loads in workers or not). Reseeding costs about 8 us a sample.

A dataset that loads whole batches itself (``__getitems__``) draws for the batch
under one seed, its first sample's: its randomness resumes bitwise, but depends on
how the global batch is dealt among the ranks. Random transforms belong in
``__getitem__``.
"""

from __future__ import annotations

from typing import Any, List, Sized, cast

from torch.utils.data import Dataset, get_worker_info

from ..random_state import host_streams_kept, seed_host


class SeededDataset(Dataset):
    """``dataset`` whose samples are loaded under their own seeds (``__getitems__``, used by the DataLoader)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(cast(Sized, self.dataset))  # the loaders take sized datasets only (api.loaders.dataset_size)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: List[int]) -> Any:
        seeds = getattr(indices, "seeds", None)
        if seeds is None:
            return self._fetch(indices)
        if get_worker_info() is not None:  # a worker's generators serve only the data
            return self._fetch_seeded(indices, seeds)
        with host_streams_kept():  # the main process's streams are the training's (dropout)
            return self._fetch_seeded(indices, seeds)

    def _fetch_seeded(self, indices: List[int], seeds: List[int]) -> Any:
        if getattr(self.dataset, "__getitems__", None):  # whole batches: one seed
            seed_host(seeds[0])
            return self._fetch(indices)
        samples = []
        for index, seed in zip(indices, seeds):
            seed_host(seed)
            samples.append(self.dataset[index])
        return samples

    def _fetch(self, indices: List[int]) -> Any:
        getitems = getattr(self.dataset, "__getitems__", None)
        return getitems(list(indices)) if getitems else [self.dataset[i] for i in indices]
