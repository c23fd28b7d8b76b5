"""Which named operations every rank has asked for, and whether they agree.

Horovod matches collectives by *name*, not by call order: rank 0 may submit
``grad.fc1`` before ``grad.fc2`` and rank 1 the other way round. Each rank's
engine thread therefore announces what it wants (an :class:`Announcement` per
operation) and all ranks exchange their announcements once per cycle. Every
rank applies the same gathered messages to its own :class:`NegotiationTable`
in rank order, so all ranks reach the same decisions without a coordinator:
which operations are ready (announced by every rank that has not joined), in
which order they run, and which must fail because the ranks disagree on shape,
dtype, op or root. A mismatch thus becomes an error on every rank, never a hang.

This module is pure bookkeeping (no torch.distributed), so it is unit-tested
without processes.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from .reduce_ops import OP_NAMES, Sum

REDUCING_KINDS = ("allreduce", "reducescatter")


@dataclasses.dataclass(frozen=True)
class Announcement:
    """What one rank tells the others about one named operation (small, picklable)."""

    kind: str  # allreduce, allgather, broadcast, alltoall, reducescatter, barrier
    shapes: Tuple[Tuple[int, ...], ...] = ()
    dtypes: Tuple[str, ...] = ()
    device: str = "cpu"
    op: int = Sum
    prescale: float = 1.0
    postscale: float = 1.0
    root: int = -1
    splits: Optional[Tuple[int, ...]] = None  # alltoall: rows sent to each rank


class Message(NamedTuple):
    """One rank's contribution to one negotiation cycle."""

    announcements: List[Tuple[str, Announcement]]
    join: bool = False
    shutdown: bool = False


@dataclasses.dataclass
class Decision:
    """A named operation every rank has reached, with each rank's announcement."""

    name: str
    by_rank: Dict[int, Announcement]
    error: Optional[str] = None

    @property
    def kind(self) -> str:
        return next(iter(self.by_rank.values())).kind

    def reference(self) -> Announcement:
        """The announcement of the lowest announcing rank (ranks that joined have none)."""
        return self.by_rank[min(self.by_rank)]


class CycleOutcome(NamedTuple):
    ready: List[Decision]
    join_completed_by: Optional[int]  # the rank that joined last, once every rank has joined
    shutdown_by: List[int]


class NegotiationTable:
    """The replicated state of all in-flight named operations."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.pending: Dict[str, Dict[int, Announcement]] = {}  # insertion order = execution order
        self.joined: List[int] = []

    def apply(self, messages: Sequence[Message]) -> CycleOutcome:
        """Record one cycle's messages (index = rank) and return what is now decided."""
        newly_joined, shutdown_by = [], []
        for rank, message in enumerate(messages):
            for name, announcement in message.announcements:
                self.pending.setdefault(name, {})[rank] = announcement
            if message.join and rank not in self.joined:
                self.joined.append(rank)
                newly_joined.append(rank)
            if message.shutdown:
                shutdown_by.append(rank)
        ready = []
        for name in list(self.pending):
            by_rank = self.pending[name]
            if all(r in by_rank or r in self.joined for r in range(self.size)):
                del self.pending[name]
                ready.append(Decision(name, by_rank, disagreement(name, by_rank, self.joined)))
        join_completed_by = None
        if len(self.joined) == self.size:
            # Horovod returns the rank that joined last; ranks joining in the same
            # cycle are ordered by rank, so every rank picks the same one.
            join_completed_by = max(newly_joined)
            self.joined = []
        return CycleOutcome(ready, join_completed_by, shutdown_by)


def _describe(by_rank: Dict[int, Announcement], field: Callable[[Announcement], object]) -> str:
    return ", ".join(f"rank {r} has {field(a)}" for r, a in sorted(by_rank.items()))


def _shape(shape: Tuple[int, ...]) -> List[int]:
    return list(shape)


def disagreement(name: str, by_rank: Dict[int, Announcement], joined: Sequence[int] = ()) -> Optional[str]:
    """Why the ranks cannot run ``name`` together, or None when they agree."""

    def differs(field: Callable[[Announcement], object]) -> bool:
        return len({repr(field(a)) for a in by_rank.values()}) > 1

    def problem(what: str, field: Callable[[Announcement], object]) -> str:
        return f"ranks disagree on the {what} of {kind} {name!r}: {_describe(by_rank, field)}"

    if differs(lambda a: a.kind):
        return f"ranks submitted different operations under the name {name!r}: " + \
            _describe(by_rank, lambda a: a.kind)
    kind = next(iter(by_rank.values())).kind
    absent = [r for r in joined if r not in by_rank]
    if absent and kind != "allreduce":
        return (f"{kind} {name!r} cannot run: rank(s) {', '.join(map(str, absent))} already called hvd.join(); "
                f"after join only allreduce continues (joined ranks contribute zeros)")
    if differs(lambda a: len(a.shapes)):
        return problem("number of tensors", lambda a: len(a.shapes))
    if differs(lambda a: a.dtypes):
        return problem("dtype", lambda a: ", ".join(a.dtypes))
    if differs(lambda a: a.device):
        return problem("device type", lambda a: a.device)
    if kind in ("allreduce", "reducescatter", "broadcast") and differs(lambda a: a.shapes):
        return problem("shape", lambda a: ", ".join(str(_shape(s)) for s in a.shapes))
    if kind in ("allgather", "alltoall") and differs(lambda a: [s[1:] for s in a.shapes]):
        return problem("shape after the first dimension",
                       lambda a: ", ".join(str(_shape(s)) for s in a.shapes))
    if kind in REDUCING_KINDS:
        if differs(lambda a: a.op):
            return problem("reduction op", lambda a: OP_NAMES.get(a.op, a.op))
        if differs(lambda a: (a.prescale, a.postscale)):
            return problem("prescale/postscale factors", lambda a: (a.prescale, a.postscale))
    if kind == "broadcast" and differs(lambda a: a.root):
        return problem("root rank", lambda a: a.root)
    return None
