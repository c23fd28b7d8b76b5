"""Horovod's process sets on torch.distributed: ``hvd.ProcessSet``, ``add_process_set``, ``remove_process_set``.

A process set is a sorted list of global ranks; collectives given
``process_set=`` are negotiated and run among those ranks only (the set's own
``torch.distributed.new_group`` and engine thread, see engine.py), average over
the set's size and number unnamed operations per process and set. Root ranks
(``broadcast``) stay *global* ranks, as in Horovod.

* Static sets: ``hvd.init(process_sets=[ProcessSet([0, 2]), ...])``. Every rank
  must pass the same sets (the order of ranks inside a set does not matter);
  ranks that disagree, a set given twice (or equal to the global set) and ranks
  outside the job fail ``init()`` on every rank with ``ValueError``.
* Dynamic sets: ``hvd.init(process_sets="dynamic")`` or
  ``HOROVOD_DYNAMIC_PROCESS_SETS=1``; then every rank calls
  ``add_process_set(ranks)`` / ``remove_process_set(ps)`` in the same order
  (they are collective operations, negotiated like the others, so ranks that
  pass different ranks all get ``ValueError`` instead of waiting).
* An operation on a set this rank is not in, or on a set that is not (or no
  longer) registered, raises ``ValueError`` at once.

The ids are Horovod's: 0 for the global set, then 1, 2, ... in the order the
sets were registered; they are the same on every rank.
"""

from __future__ import annotations

import os
from typing import Any, List, Optional, Sequence, Tuple, Union

from .errors import UnregisteredProcessSetError
from .running_job import is_initialized, runtime

DYNAMIC_VARIABLE = "HOROVOD_DYNAMIC_PROCESS_SETS"


class ProcessSet:
    """A set of ranks that run collectives together; pass it to ``hvd.init`` or ``hvd.add_process_set``."""

    process_set_id: Optional[int] = None
    ranks: List[int]  # set by __init__ (an MPI communicator, which would leave it None, is refused)
    mpi_comm: Any = None

    def __init__(self, ranks_or_comm: Union[Sequence[int], Any]) -> None:
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise NotImplementedError(
                "a ProcessSet built from an MPI communicator needs the real Horovod (start the "
                "job with horovodrun --mpi); on the torch backend give the list of ranks"
            ) from None
        if any(not isinstance(r, int) for r in ranks):
            raise ValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py Comm object")
        self.ranks = ranks
        """The global ranks of the set, sorted."""

    def _invalidate(self) -> None:
        self.process_set_id = None

    def _registered(self) -> Optional[Tuple[int, ...]]:
        if self.process_set_id is None or not is_initialized():
            return None
        return runtime().engine.process_sets.get(self.process_set_id)

    def size(self) -> Optional[int]:
        """Number of ranks in the set, or None if it is not registered."""
        ranks = self._registered()
        return None if ranks is None else len(ranks)

    def rank(self) -> Optional[int]:
        """This process's rank inside the set (e.g. to read an allgather), or None if not registered.

        Collectives still take *global* ranks (``broadcast``'s root_rank).
        """
        ranks = self._registered()
        if ranks is None:
            return None
        rank = runtime().rank
        if rank not in ranks:
            raise ValueError(f"rank {rank} is not a member of {self}")
        return ranks.index(rank)

    def included(self) -> Optional[bool]:
        """Whether this process is in the set (None for a set without ranks)."""
        return None if self.ranks is None else runtime().rank in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__


global_process_set = ProcessSet([])
"""The set of all ranks (``process_set_id`` 0): the default ``process_set`` of every operation."""
global_process_set.process_set_id = 0


def dynamic_enabled() -> bool:
    return os.environ.get(DYNAMIC_VARIABLE, "0").lower() in ("1", "true")


def static_sets(process_sets: Any) -> List[ProcessSet]:
    """The ProcessSet objects of ``hvd.init(process_sets=...)`` ("dynamic" turns dynamic sets on)."""
    if process_sets is None:
        return []
    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise ValueError(f"process_sets must be a list of hvd.ProcessSet or 'dynamic', got {process_sets!r}")
        os.environ[DYNAMIC_VARIABLE] = "1"  # as Horovod does
        return []
    sets = list(process_sets)
    if any(not isinstance(ps, ProcessSet) for ps in sets):
        raise ValueError("process_sets must hold hvd.ProcessSet objects")
    return sets


def check_static_sets(by_rank: Sequence[Sequence[Tuple[int, ...]]], size: int) -> None:
    """Raise ValueError unless every rank gave the same valid, distinct sets (the same check on every rank)."""
    if any(list(sets) != list(by_rank[0]) for sets in by_rank):
        described = "; ".join(f"rank {r} has {[list(s) for s in sets]}" for r, sets in enumerate(by_rank))
        raise ValueError(f"hvd.init(process_sets=...): the ranks passed different process sets: {described}")
    seen = {tuple(range(size))}
    for index, ranks in enumerate(by_rank[0]):
        if not ranks or any(not 0 <= r < size for r in ranks) or len(set(ranks)) != len(ranks):
            raise ValueError(
                f"Horovod could not be initialized because process_sets entry number {index} "
                f"({list(ranks)}) is not a set of distinct ranks of this job of {size} processes"
            )
        if ranks in seen:
            raise ValueError(
                f"Horovod could not be initialized because process_sets entry number {index} is a "
                f"duplicate: ProcessSet(ranks={list(ranks)})"
            )
        seen.add(ranks)


def set_ranks(process_set: Any, rank: int) -> Tuple[int, Tuple[int, ...]]:
    """(id, ranks) of a registered set that includes ``rank``; ValueError otherwise (before anything is sent)."""
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"process_set must be an hvd.ProcessSet, got {type(process_set).__name__}")
    registered, set_id = runtime().engine.process_sets, process_set.process_set_id
    if set_id is None or set_id not in registered:
        raise UnregisteredProcessSetError(
            f"{process_set} is not registered: pass it to "
            f"hvd.init(process_sets=[...]) or hvd.add_process_set() first "
            f"(or it was removed)"
        )
    ranks = registered[set_id]
    if rank not in ranks:
        raise ValueError(f"rank {rank} is not a member of the provided process set {list(ranks)}")
    return set_id, ranks


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a new set on every rank (all ranks call it, in the same order); returns it, registered."""
    engine = runtime().engine
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if not dynamic_enabled():
        raise ValueError(
            "hvd.add_process_set() needs dynamic process sets: call hvd.init(process_sets='dynamic') "
            f"or set {DYNAMIC_VARIABLE}=1"
        )
    ranks = tuple(process_set.ranks)
    if not ranks or any(not 0 <= r < engine.size for r in ranks) or len(set(ranks)) != len(ranks):
        raise ValueError(
            f"hvd.add_process_set({list(ranks)}): ranks must be distinct ranks of this job of {engine.size} processes"
        )
    process_set_id = engine.add_process_set(ranks).wait()
    if process_set_id is None:
        raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
    process_set.process_set_id = process_set_id
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` on every rank (all ranks call it); False for the global or an unknown set."""
    engine = runtime().engine
    process_set_id = process_set.process_set_id
    if process_set_id is None or process_set_id == 0:
        return False
    if not dynamic_enabled():
        raise ValueError(
            "hvd.remove_process_set() needs dynamic process sets: call "
            f"hvd.init(process_sets='dynamic') or set {DYNAMIC_VARIABLE}=1"
        )
    process_set._invalidate()
    return bool(engine.remove_process_set(process_set_id).wait())
