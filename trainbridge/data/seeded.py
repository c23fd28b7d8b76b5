"""Random transforms that resume bitwise: each batch is loaded with its own seed.

A DataLoader worker seeds torch, ``random`` and numpy once, when it starts, and
then draws from them batch after batch. A run resumed mid-epoch starts fresh
workers, so the same batch would get other random crops than in the run that was
interrupted; with several workers it would also depend on which worker loads it.
Here every batch reseeds the three generators from the seed its
:class:`~trainbridge.data.sampler.SeededBatch` carries, in a worker or in the
main process (where the training's own generators are put back afterwards, so
dropout draws the same numbers whether data loads in workers or not).
"""

from __future__ import annotations

from typing import Any, List, Sized, cast

from torch.utils.data import Dataset, get_worker_info

from ..random_state import host_streams_kept, seed_host


class SeededDataset(Dataset):
    """``dataset`` whose batches are loaded under their own seed (``__getitems__``, used by the DataLoader)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(cast(Sized, self.dataset))  # the loaders take sized datasets only (api.loaders.dataset_size)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: List[int]) -> Any:
        seed = getattr(indices, "seed", None)
        if seed is None:
            return self._fetch(indices)
        if get_worker_info() is not None:  # a worker's generators serve only the data
            seed_host(seed)
            return self._fetch(indices)
        with host_streams_kept():  # the main process's streams are the training's (dropout)
            seed_host(seed)
            return self._fetch(indices)

    def _fetch(self, indices: List[int]) -> Any:
        getitems = getattr(self.dataset, "__getitems__", None)
        return getitems(list(indices)) if getitems else [self.dataset[i] for i in indices]
