"""Random transforms that do not depend on the world size, and resume bitwise: each sample has its own seed.

A DataLoader worker seeds torch, ``random`` and numpy once, when it starts, and
then draws from them sample after sample, so a sample's random crop depends on
which rank and worker load it, and on what they loaded before: another world size,
another worker count or a resumed run would augment it differently. Here the three
generators are reseeded before every sample from the seed its
:class:`~trainbridge.data.sampler.SeededBatch` gives it (from the loader's seed,
the epoch and the sample's index), in a worker or in the main process (where the
training's own generators are put back afterwards, so dropout draws the same
numbers whether data loads in workers or not).

Reseeding costs about 10 us a sample on one CPU core (8 us to seed the three
generators, Python's ``random.seed`` half of it), and putting the main process's
generators back about 0.1 ms a batch: little beside reading and decoding an image,
and spread over the workers when there are some. Datasets that only read
(``TensorDataset``, a list) are not reseeded at all.

A dataset that loads whole batches itself (``__getitems__``) draws for the batch
under one seed, its first sample's: its randomness is deterministic and resumes
bitwise at the same world size, but depends on how the global batch is dealt
among the ranks. Random transforms belong in ``__getitem__``.
"""

from __future__ import annotations

from typing import Any, List, Sized, cast

from torch.utils.data import Dataset, TensorDataset, get_worker_info

from ..random_state import host_streams_kept, seed_host
from .sampler import SeededBatch

# Datasets whose items are read, never drawn: reseeding before each would change nothing.
READ_ONLY = (TensorDataset, list, tuple, range)


class SeededDataset(Dataset):
    """``dataset`` whose samples are loaded under their own seeds (``__getitems__``, used by the DataLoader)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(cast(Sized, self.dataset))  # the loaders take sized datasets only (api.loaders.dataset_size)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: List[int]) -> Any:
        if not isinstance(indices, SeededBatch) or not indices:
            return self._fetch(indices)
        in_worker = get_worker_info() is not None
        if type(self.dataset) in READ_ONLY:
            if in_worker:  # a collate_fn drawing here finds the streams the last sample's seed would leave
                seed_host(indices.seed_of(indices[-1]))
            return self._fetch(indices)
        if in_worker:  # a worker's generators serve only the data
            return self._fetch_seeded(indices)
        with host_streams_kept():  # the main process's streams are the training's (dropout)
            return self._fetch_seeded(indices)

    def _fetch_seeded(self, indices: SeededBatch) -> Any:
        if getattr(self.dataset, "__getitems__", None):  # whole batches: one seed
            seed_host(indices.seed_of(indices[0]))
            return self._fetch(indices)
        samples = []
        for index in indices:
            seed_host(indices.seed_of(index))
            samples.append(self.dataset[index])
        return samples

    def _fetch(self, indices: List[int]) -> Any:
        getitems = getattr(self.dataset, "__getitems__", None)
        return getitems(list(indices)) if getitems else [self.dataset[i] for i in indices]
