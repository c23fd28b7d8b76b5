"""Data loaders of the public API: a resumable training shard and an exact evaluation shard.

Training: every rank draws one permutation of the dataset from ``seed + epoch``;
step k covers one slice of it, of one global batch, and rank r takes every
world_size-th sample of the slice (:mod:`trainbridge.data.sampler`). So 2 ranks
with batch B see the same samples per step as 1 rank with batch 2B, and a loop
ends with the same weights under every launcher, at any dataset size. Each sample
is loaded under its own seed, from (seed, epoch, sample index)
(:mod:`trainbridge.data.seeded`), so random augmentation is the same at any world
size and worker count, and resumes bitwise too.

Evaluation: strided and unpadded. ``DistributedSampler`` pads the last shard
with repeats, which counts some samples twice; here shards differ in length by
at most one and each sample is scored on exactly one rank, so allreduced sums
are exact.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Dict, Iterator, Optional, Tuple

import torch
from torch.utils.data import DataLoader, Dataset, Subset

from ..data.sampler import TrainBatches, mix_seed, steps_in_pass
from ..data.seeded import SeededDataset
from ..errors import UserError
from .loader_workers import with_worker_setup

_END = object()


def NO_WAIT_BOUND(what: str) -> ContextManager:
    """The default ``worker_wait``: a wait for workers is not bounded."""
    return contextlib.nullcontext()


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
    collate_fn = getattr(dataset, "collate_fn", None)
    if "collate_fn" not in options and collate_fn is not None:
        options["collate_fn"] = collate_fn
    return options


TRAIN_REFUSALS = {
    "shuffle": "the train loader shuffles itself, every pass from seed + epoch; pass seed= to change the order",
    "sampler": "the train loader picks this rank's samples itself (the same steps on every world size); "
    "give it the dataset (a Subset for part of it)",
    "batch_sampler": "the train loader forms the batches itself; pass batch_size=",
    "generator": "the train loader owns its random streams; pass seed=",
    "drop_last=False": "the train loader trains whole global batches only, so that every world size trains the "
    "same samples per step; leave drop_last out",
}
EVAL_REFUSALS = {
    "sampler": "the eval loader shards the dataset itself (each sample on one rank); give it the dataset",
    "batch_sampler": "the eval loader forms the batches itself; pass batch_size=",
    "drop_last=True": "dropping a last batch would leave samples unscored; leave drop_last out",
    "shuffle=True": "the eval loader's order does not change a summed metric; leave shuffle out",
}


def _refuse(options: Dict[str, Any], refusals: Dict[str, str], what: str) -> Dict[str, Any]:
    """One line for a DataLoader option that cannot apply to this loader; the options without the harmless rest.

    A refusal ``name`` refuses any value but None; ``name=value`` only that value.
    """
    for key, why in refusals.items():
        name, _, value = key.partition("=")
        given = options.pop(name, None)
        if given is not None and (not value or str(bool(given)) == value):
            raise UserError(f"{what}: {name}={given!r} cannot apply: {why}")
    return options


def dataset_size(dataset: Any, what: str) -> int:
    """``len(dataset)``, or one line saying that ``what`` needs a map-style dataset."""
    try:
        return len(dataset)
    except TypeError:
        raise UserError(
            f"{what} needs a map-style dataset (with __len__ and __getitem__), got "
            f"{type(dataset).__name__}; wrap an iterable in a list or a torch Dataset"
        ) from None


def per_rank_batch_size(batch_size: Optional[int], global_batch_size: Optional[int], world_size: int) -> Any:
    """This rank's batch from exactly one of ``batch_size`` (this rank's) and ``global_batch_size`` (all ranks').

    A global batch the ranks cannot share evenly is one line naming the multiples of the world size around it.
    """
    if (batch_size is None) == (global_batch_size is None):
        raise UserError(
            "train_loader: give either batch_size= (per rank) or global_batch_size= (over all ranks), "
            f"not {'both' if batch_size is not None else 'neither'}"
        )
    if global_batch_size is None:
        return batch_size  # checked by TrainLoader
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise UserError(
            f"train_loader: global_batch_size must be a whole number of at least 1 (got {global_batch_size!r})"
        )
    if global_batch_size % world_size:
        lower = global_batch_size // world_size * world_size
        around = f"{lower} or {lower + world_size}" if lower else str(world_size)
        raise UserError(
            f"train_loader: a global batch of {global_batch_size} cannot be dealt evenly among {world_size} "
            f"ranks; use a multiple of {world_size} ({around})"
        )
    return global_batch_size // world_size


class TrainLoader:
    """This rank's batches of ``dataset``, reshuffled on every pass, on the job's device.

    It behaves like a DataLoader over an epoch: ``len(loader)`` is the number of
    batches of a pass (fixed while it runs), and every ``iter()`` is a new pass
    with the next epoch's order (no ``set_epoch`` to forget). A ``break`` ends the
    pass; the next ``for`` starts the next epoch. ``state_dict()`` holds the epoch
    and the samples of it already handed out, so a loader restored from a
    checkpoint continues, in its first pass, at the next unseen batch: bitwise the
    same run.

    Only whole global batches are trained (see :mod:`trainbridge.data.sampler`):
    ``dataset_size mod global_batch_size`` samples wait for a later epoch, on every
    world size, so every world size trains the same samples per step.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        seed: int = 0,
        before_fork: Callable[[], None] = lambda: None,
        worker_wait: Callable[[str], ContextManager] = NO_WAIT_BOUND,
        **dataloader_options: Any,
    ) -> None:
        self.before_fork = before_fork
        self.worker_wait = worker_wait  # bounds each wait for the DataLoader workers (the job's watchdog)
        size = dataset_size(dataset, "train_loader")
        dataloader_options = _refuse(dataloader_options, TRAIN_REFUSALS, "train_loader")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise UserError(f"train_loader: batch_size must be a whole number of at least 1 (got {batch_size!r})")
        if size == 0:
            raise UserError("train_loader: the dataset is empty; check where it reads its files from")
        if size < batch_size * world_size:
            raise UserError(
                f"train_loader: the dataset has {size} samples, fewer than one global batch of "
                f"{batch_size * world_size} ({batch_size} per rank x {world_size} ranks), so no step "
                f"would train; lower batch_size to at most {size // world_size}"
            )
        self.dataset, self.size, self.batch_size, self.device, self.seed = dataset, size, batch_size, device, seed
        self.world_size, self.rank = world_size, rank
        self.batches = TrainBatches(size, batch_size, rank, world_size, seed)
        self.options = _loader_options(dataset, device, dict(dataloader_options))
        self._worker_setup = with_worker_setup(self.options)
        # The loader owns its random streams: the DataLoader's base seed for its
        # workers comes from this generator, not from the global one that dropout
        # draws from (iter() would otherwise draw once more in a resumed run).
        self._generator = torch.Generator()
        self._epoch, self._position = 0, 0  # the open pass, or where the next one starts
        self._open: Optional[object] = None  # the open pass's token
        self._steps = self._handed = 0  # batches in the open pass, and handed out of it
        self._loader: Optional[DataLoader] = None

    @property
    def global_batch_size(self) -> int:
        """Samples per step over all ranks: ``batch_size * world_size``."""
        return self.batch_size * self.world_size

    @property
    def epoch(self) -> int:
        """The epoch of the pass in progress, or of the next pass when none is (0-based)."""
        return self._epoch if self._open is not None else self._next_pass()[0]

    @property
    def position(self) -> int:
        """Samples of that epoch's order already handed out, over all ranks."""
        return self._position if self._open is not None else self._next_pass()[1]

    def __len__(self) -> int:
        """Batches in the pass in progress (or the next one): a whole epoch, or after a resume its rest."""
        if self._open is not None:
            return self._steps
        return steps_in_pass(self.size, self.global_batch_size, self._next_pass()[1])

    def _next_pass(self) -> Tuple[int, int]:
        if steps_in_pass(self.size, self.global_batch_size, self._position) == 0:
            return self._epoch + 1, 0  # the epoch is trained to its end
        return self._epoch, self._position

    def __iter__(self) -> Iterator[Any]:
        if self._open is not None and self._handed:  # a pass left unfinished (a break, next(iter(...))) ends here
            self._end_pass()
        self._handed = 0  # an iterator that never handed out a batch used up nothing
        self._epoch, self._position = self._next_pass()
        self._open = token = object()
        self.batches.set_pass(self._epoch, self._position)
        self._steps = len(self.batches)
        self._generator.manual_seed(mix_seed(self.seed, self._epoch, self.rank))
        if self._loader is None:  # built once: persistent workers survive across epochs
            self._loader = DataLoader(
                SeededDataset(self.dataset), batch_sampler=self.batches, generator=self._generator, **self.options
            )
        loader = self._loader
        if self._worker_setup is not None and (
            not loader.persistent_workers or getattr(loader, "_iterator", None) is None
        ):
            self.before_fork()  # the workers are forked now
            self._worker_setup.before_fork()
        with self._waiting("train_loader's start of its DataLoader workers"):
            batches = iter(loader)
        return self._pass(token, batches)

    def _waiting(self, what: str) -> ContextManager:
        return self.worker_wait(what) if self._worker_setup is not None else contextlib.nullcontext()

    def _pass(self, token: object, batches: Iterator[Any]) -> Iterator[Any]:
        try:
            for _ in range(self._steps):
                if self._open is not token:  # a newer pass (or load_state_dict) replaced this one
                    return
                with self._waiting("train_loader's next batch"):
                    batch = next(batches)
                # Counted before the batch is handed out: a checkpoint written after the
                # loop body has used it resumes at the next one.
                self._position += self.global_batch_size
                self._handed += 1
                yield to_device(batch, self.device)
        finally:
            if self._open is token:  # exhausted, or closed by a break
                self._end_pass()

    def _end_pass(self) -> None:
        self._epoch, self._position, self._open = self._epoch + 1, 0, None

    def state_dict(self) -> Dict[str, int]:
        """The loader's position: epoch, samples of it already handed out, seed, dataset size, global batch."""
        epoch, position = self._next_pass()
        return {
            "epoch": epoch,
            "position": position,
            "seed": self.seed,
            "dataset_size": self.size,
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Continue from a :meth:`state_dict`: the next pass starts there. Dataset size and seed must match.

        Another world size is accepted: with the same global batch, the same steps
        follow, dealt among the new ranks.
        """
        if state["dataset_size"] != self.size:
            raise UserError(
                f"the checkpoint's train loader had {state['dataset_size']} samples, this one has "
                f"{self.size}; resume with the same dataset or start a fresh run"
            )
        if state["seed"] != self.seed:
            raise UserError(
                f"the checkpoint's train loader was seeded with {state['seed']}, this one with "
                f"{self.seed}; pass seed={state['seed']} to resume the same order"
            )
        self._epoch, self._position, self._open = state["epoch"], state["position"], None


class EvalLoader:
    """Batches of this rank's unpadded evaluation shard (indices rank, rank + world_size, ...), on ``device``.

    ``before_pass`` runs at the start of every pass (the job's check that the ranks hold the same model).
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        before_fork: Callable[[], None] = lambda: None,
        worker_wait: Callable[[str], ContextManager] = NO_WAIT_BOUND,
        before_pass: Callable[[], None] = lambda: None,
        **dataloader_options: Any,
    ) -> None:
        self.before_fork = before_fork
        self.worker_wait = worker_wait
        self.before_pass = before_pass
        size = dataset_size(dataset, "eval_loader")
        dataloader_options = _refuse(dataloader_options, EVAL_REFUSALS, "eval_loader")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise UserError(f"eval_loader: batch_size must be a whole number of at least 1 (got {batch_size!r})")
        self.device = device
        shard = Subset(dataset, range(rank, size, world_size))
        options = _loader_options(dataset, device, dict(dataloader_options))
        options.pop("persistent_workers", None)
        # Evaluation draws nothing from the global stream that dropout and augmentation use: iter() takes
        # its workers' base seed from this generator, so a run continues as if it had not evaluated (and
        # a checkpoint written after an evaluation resumes bitwise).
        options.setdefault("generator", torch.Generator())
        self._worker_setup = with_worker_setup(options)
        self.loader = DataLoader(shard, batch_size=batch_size, shuffle=False, **options)

    def __len__(self) -> int:
        """Batches in this rank's shard."""
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self.before_pass()
        if self._worker_setup is None:  # no workers
            return (to_device(batch, self.device) for batch in self.loader)
        self.before_fork()  # every pass forks its workers
        self._worker_setup.before_fork()
        return self._from_workers()

    def _from_workers(self) -> Iterator[Any]:
        with self.worker_wait("eval_loader's start of its DataLoader workers"):
            batches = iter(self.loader)
        while True:
            with self.worker_wait("eval_loader's next batch"):
                batch = next(batches, _END)
            if batch is _END:
                return
            yield to_device(batch, self.device)
