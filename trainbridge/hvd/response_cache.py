"""Horovod's response cache: operations the ranks have agreed on once negotiate again as one bit each.

Training repeats the same named operations step after step (one allreduce per gradient). Once
every member of a process set has announced a name and the operation ran without error, each
rank records it here under an integer id, the same on every rank: ids are given in the order of
the decisions, which every rank reaches identically. In a later cycle, a rank that submits that
name again with the very announcement it made then (same shapes, dtypes, op, factors, root, ...)
does not announce it: it sets the id's bit in a small fixed-size array that the ranks gather
(:func:`pack` / :func:`unpack`). An id whose bit every member set is decided from the cache, with
no pickled message; a cycle in which every rank has only cached operations exchanges nothing else.

A rank whose announcement differs from its cached one (new shape, ...) announces it in full; on
seeing that, every rank drops the name from the cache, and a rank that had set its bit for it
announces it in full too, so the usual negotiation (and its mismatch errors) takes over. While a
rank has called ``hvd.join()`` nothing is decided from the cache. At most ``capacity`` names are
held (HOROVOD_CACHE_CAPACITY, default 1024, as Horovod's; 0 turns the cache off); a dropped name's
id is given again, lowest first.

Pure bookkeeping: unit-tested without processes.
"""

from __future__ import annotations

import heapq
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch

from .negotiation import Announcement, Decision, Key

CACHEABLE_KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")
DEFAULT_CAPACITY = 1024


class ResponseCache:
    """The replicated table of cached operations (one per process set's engine)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._ids: Dict[Key, int] = {}
        self._entries: Dict[int, Tuple[Key, Dict[int, Announcement]]] = {}
        self._free: List[int] = []  # ids of dropped names, given again lowest first
        self.size = 0  # ids given so far: the length of the bit array

    def lookup(self, key: Key, rank: int, announcement: Announcement) -> Optional[int]:
        """The id under which ``rank`` may submit ``key`` as a bit: its announcement is the cached one."""
        cache_id = self._ids.get(key)
        if cache_id is None or self._entries[cache_id][1].get(rank) != announcement:
            return None
        return cache_id

    def key(self, cache_id: int) -> Key:
        return self._entries[cache_id][0]

    def add(self, decision: Decision, members: Sequence[int]) -> None:
        """Cache an operation every member announced and that runs (every rank calls this in the same order)."""
        key = (decision.process_set, decision.name)
        if (
            decision.error is not None
            or decision.kind not in CACHEABLE_KINDS
            or sorted(decision.by_rank) != sorted(members)
            or key in self._ids
        ):
            return
        if self._free:
            cache_id = heapq.heappop(self._free)
        elif self.size < self.capacity:
            cache_id, self.size = self.size, self.size + 1
        else:
            return  # full: the name keeps negotiating by announcement
        self._ids[key] = cache_id
        self._entries[cache_id] = (key, dict(decision.by_rank))

    def drop(self, key: Key) -> Optional[int]:
        """Forget ``key`` (announced in full by some rank); returns the id it had, if any."""
        cache_id = self._ids.pop(key, None)
        if cache_id is not None:
            del self._entries[cache_id]
            heapq.heappush(self._free, cache_id)
        return cache_id

    def decision(self, cache_id: int) -> Decision:
        """The decision for a cached operation every member submitted again unchanged."""
        (set_id, name), by_rank = self._entries[cache_id]
        return Decision(name, by_rank, process_set=set_id)


def pack(cache_ids: Iterable[int], size: int, announcing: bool) -> torch.Tensor:
    """One rank's part of a cycle: a byte saying whether it announces anything in full, then one bit per id."""
    bits = np.zeros(size, dtype=bool)
    bits[list(cache_ids)] = True
    return torch.from_numpy(np.concatenate([np.array([announcing], dtype=np.uint8), np.packbits(bits)]))


def unpack(parts: Sequence[torch.Tensor], size: int) -> Tuple[bool, List[Set[int]]]:
    """Whether any rank announces in full, and each rank's ids, from the gathered :func:`pack` results."""
    announcing = any(bool(part[0]) for part in parts)
    per_rank = [set(np.flatnonzero(np.unpackbits(part[1:].numpy())[:size]).tolist()) for part in parts]
    return announcing, per_rank
