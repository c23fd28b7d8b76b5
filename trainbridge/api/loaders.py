"""Data loaders of the public API: a resumable training shard and an exact evaluation shard.

Training: every rank draws one permutation of the dataset from ``seed + epoch``
and rank r takes every world_size-th index of it
(:class:`~trainbridge.data.sampler.ResumableDistributedSampler`). Step k of the
job therefore covers one contiguous slice of the permutation, whatever the world
size: 2 ranks with batch B see the same samples per step as 1 rank with batch 2B,
and a loop ends with the same weights under every launcher.

Evaluation: strided and unpadded. ``DistributedSampler`` pads the last shard
with repeats, which counts some samples twice; here shards differ in length by
at most one and each sample is scored on exactly one rank, so allreduced sums
are exact.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset, Subset

from ..data.sampler import ResumableDistributedSampler
from ..errors import UserError


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` (a tensor, or tuples, lists and dicts of them) on ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=device.type == "cuda")
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, tuple):  # a named tuple
        return type(batch)(*(to_device(b, device) for b in batch))
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def _loader_options(dataset: Dataset, device: torch.device, options: Dict[str, Any]) -> Dict[str, Any]:
    # Pinned host memory lets the copy to the GPU overlap compute (non_blocking=True).
    options.setdefault("pin_memory", device.type == "cuda" and not getattr(dataset, "on_device", False))
    if options.get("num_workers", 0) > 0:
        options.setdefault("persistent_workers", True)
    # A dataset that gathers whole batches itself (__getitems__ returning a batch) brings its own collate.
    if "collate_fn" not in options and getattr(dataset, "collate_fn", None) is not None:
        options["collate_fn"] = dataset.collate_fn
    return options


def _check_dataset(dataset: Any, what: str) -> int:
    try:
        return len(dataset)
    except TypeError:
        raise UserError(f"{what} needs a map-style dataset (with __len__ and __getitem__), got "
                        f"{type(dataset).__name__}; wrap an iterable in a list or a torch Dataset") from None


class TrainLoader:
    """This rank's batches of ``dataset``, reshuffled on every pass, on the job's device.

    Each ``for batch in loader`` is one epoch; the next pass draws the next
    epoch's order (no ``set_epoch`` to forget). ``state_dict()`` holds the epoch
    and the samples of it already handed out, so a loader restored from a
    checkpoint continues at the next unseen batch: bitwise the same run.
    """

    def __init__(self, dataset: Dataset, batch_size: int, *, rank: int, world_size: int, device: torch.device,
                 seed: int = 0, before_fork: Callable[[], None] = lambda: None, **dataloader_options: Any) -> None:
        self.before_fork = before_fork
        size = _check_dataset(dataset, "train_loader")
        if batch_size < 1:
            raise UserError(f"train_loader: batch_size must be at least 1 (got {batch_size})")
        if size == 0:
            raise UserError("train_loader: the dataset is empty; check where it reads its files from")
        self.dataset, self.batch_size, self.device, self.seed = dataset, batch_size, device, seed
        self.world_size = world_size
        self.sampler = ResumableDistributedSampler(size, num_replicas=world_size, rank=rank, seed=seed)
        self.options = _loader_options(dataset, device, dict(dataloader_options))
        self.epoch, self.position = 0, 0
        self._loader: Optional[DataLoader] = None

    @property
    def global_batch_size(self) -> int:
        """Samples per step over all ranks: ``batch_size * world_size``."""
        return self.batch_size * self.world_size

    def __len__(self) -> int:
        """Batches left in the current pass on this rank."""
        remaining = self.sampler.total_size - self.position
        return -(-remaining // self.global_batch_size)

    def __iter__(self) -> Iterator[Any]:
        self._roll_over()
        epoch = self.epoch
        self.sampler.set_epoch(epoch, self.position)
        if self._loader is None:  # built once: persistent workers survive across epochs
            self._loader = DataLoader(self.dataset, batch_size=self.batch_size, sampler=self.sampler, **self.options)
        if self._loader.num_workers and getattr(self._loader, "_iterator", None) is None:
            self.before_fork()  # the workers are forked now
        for batch in self._loader:
            # Counted before the batch is handed out: a checkpoint written after the
            # loop body has used it resumes at the next one.
            self.position = min(self.position + self.global_batch_size, self.sampler.total_size)
            yield to_device(batch, self.device)
        if self.epoch == epoch:  # the pass is complete (unless state_dict() already rolled it over);
            self.epoch, self.position = epoch + 1, 0  # drop_last may have left a remainder

    def _roll_over(self) -> None:
        if self.position >= self.sampler.total_size:
            self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> Dict[str, int]:
        """The loader's position: epoch, samples of it already handed out, seed, dataset size, global batch."""
        self._roll_over()
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "dataset_size": len(self.dataset), "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Continue from a :meth:`state_dict`; the dataset size and the seed must be the checkpoint's.

        Another world size is accepted: the rest of the epoch is re-dealt among the new ranks.
        """
        if state["dataset_size"] != len(self.dataset):
            raise UserError(f"the checkpoint's train loader had {state['dataset_size']} samples, this one has "
                            f"{len(self.dataset)}; resume with the same dataset or start a fresh run")
        if state["seed"] != self.seed:
            raise UserError(f"the checkpoint's train loader was seeded with {state['seed']}, this one with "
                            f"{self.seed}; pass seed={state['seed']} to resume the same order")
        # Another world size re-deals the rest of the epoch among the new ranks:
        # every sample is still seen once, the batches' composition changes.
        self.epoch, self.position = state["epoch"], state["position"]


class EvalLoader:
    """Batches of this rank's unpadded evaluation shard (indices rank, rank + world_size, ...), on ``device``."""

    def __init__(self, dataset: Dataset, batch_size: int, *, rank: int, world_size: int, device: torch.device,
                 before_fork: Callable[[], None] = lambda: None, **dataloader_options: Any) -> None:
        self.before_fork = before_fork
        size = _check_dataset(dataset, "eval_loader")
        if batch_size < 1:
            raise UserError(f"eval_loader: batch_size must be at least 1 (got {batch_size})")
        self.device = device
        shard = Subset(dataset, range(rank, size, world_size))
        options = _loader_options(dataset, device, dict(dataloader_options))
        options.pop("persistent_workers", None)
        self.loader = DataLoader(shard, batch_size=batch_size, shuffle=False, **options)

    def __len__(self) -> int:
        """Batches in this rank's shard."""
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        if self.loader.num_workers:
            self.before_fork()  # every pass forks its workers
        return (to_device(batch, self.device) for batch in self.loader)
