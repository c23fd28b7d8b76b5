"""Which named operations every rank has asked for, and whether they agree.

Horovod matches collectives by *name*, not by call order: rank 0 may submit
``grad.fc1`` before ``grad.fc2`` and rank 1 the other way round. Each rank's
engine thread therefore announces what it wants (an :class:`Announcement` per
operation) and all ranks exchange their announcements once per cycle. Every
rank applies the same gathered messages to its own :class:`NegotiationTable`
in rank order, so all ranks reach the same decisions without a coordinator:
which operations are ready (announced by every rank of the operation's process
set that has not joined), in which order they run, and which must fail because
the ranks disagree on shape, dtype, op or root, or because a rank rejected its
own input (a scalar where a dimension is needed, an unsupported dtype, ...). A
mismatch or a bad input thus becomes an error on every rank, never a hang.

Operations are keyed by (process set id, name): the same name may be in flight
in two process sets at once, as in Horovod, where each set has its own queue.
Each process set negotiates in its own table, among its members only (see
engine.py): ranks outside a set never take part in its operations.

This module is pure bookkeeping (no torch.distributed), so it is unit-tested
without processes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from .reduce_ops import OP_NAMES, Sum

REDUCING_KINDS = ("allreduce", "reducescatter")
PROCESS_SET_KINDS = ("add_process_set", "remove_process_set")  # run by every rank, on the global set
Key = Tuple[int, str]  # (process set id, name)


@dataclasses.dataclass(frozen=True)
class Announcement:
    """What one rank tells the others about one named operation (small, picklable)."""

    kind: str  # allreduce, allgather, broadcast, alltoall, reducescatter, barrier, add/remove_process_set
    shapes: Tuple[Tuple[int, ...], ...] = ()
    dtypes: Tuple[str, ...] = ()
    device: str = "cpu"
    op: int = Sum
    prescale: float = 1.0
    postscale: float = 1.0
    root: int = -1
    splits: Optional[Tuple[int, ...]] = None  # alltoall: rows sent to each rank
    process_set: int = 0
    ranks: Optional[Tuple[int, ...]] = None  # add_process_set: its ranks; remove_process_set: (its id,)
    error: Optional[Tuple[str, str]] = None  # (exception type, message): this rank rejected its input


class Message(NamedTuple):
    """One rank's contribution to one negotiation cycle."""

    announcements: List[Tuple[str, Announcement]]
    join: bool = False
    shutdown: object = False  # True, or the reason (a stalled operation) as a string


@dataclasses.dataclass
class Decision:
    """A named operation every rank has reached, with each rank's announcement."""

    name: str
    by_rank: Dict[int, Announcement]
    error: Optional[str] = None
    error_type: str = "TensorMismatchError"  # or the type a rank raised when it rejected its input
    process_set: int = 0

    @functools.cached_property
    def kind(self) -> str:
        return next(iter(self.by_rank.values())).kind

    def reference(self) -> Announcement:
        """The announcement of the lowest announcing rank (ranks that joined have none)."""
        return self.by_rank[min(self.by_rank)]


class CycleOutcome(NamedTuple):
    ready: List[Decision]
    join_completed_by: Optional[int]  # the rank that joined last, once every rank has joined
    shutdown_by: List[int]
    shutdown_reason: Optional[str] = None  # the first reason given (a stall), if any


class NegotiationTable:
    """The replicated state of all in-flight named operations."""

    def __init__(self, size: int, ranks: Optional[Sequence[int]] = None, set_id: int = 0) -> None:
        """A table for ``size`` ranks; a process set's own table is given its ``ranks`` and ``set_id``."""
        self.size = size
        self.ranks = tuple(range(size) if ranks is None else ranks)  # who sent each gathered message
        self.pending: Dict[Key, Dict[int, Announcement]] = {}  # insertion order = execution order
        self.joined: List[int] = []
        self.members: Dict[int, Tuple[int, ...]] = {set_id: self.ranks}  # process set id -> ranks

    def apply(self, messages: Sequence[Message]) -> CycleOutcome:
        """Record one cycle's messages (in the order of ``ranks``) and return what is now decided."""
        newly_joined, shutdown_by, reason = [], [], None
        for rank, message in zip(self.ranks, messages):
            for name, announcement in message.announcements:
                self.pending.setdefault((announcement.process_set, name), {})[rank] = announcement
            if message.join and rank not in self.joined:
                self.joined.append(rank)
                newly_joined.append(rank)
            if message.shutdown:
                shutdown_by.append(rank)
                if isinstance(message.shutdown, str) and reason is None:
                    reason = message.shutdown
        ready = []
        for key in list(self.pending):
            set_id, name = key
            by_rank = self.pending[key]
            members = self.members.get(set_id)
            if members is None:  # only reachable by a bug: never leave it pending
                del self.pending[key]
                ready.append(
                    Decision(
                        name,
                        by_rank,
                        f"{name!r} names process set {set_id}, which is not registered",
                        "ValueError",
                        set_id,
                    )
                )
                continue
            # hvd.join() covers the global set: joined ranks answer its allreduces with zeros.
            joined = self.joined if set_id == 0 else []
            if all(r in by_rank or r in joined for r in members):
                del self.pending[key]
                ready.append(decide(name, set_id, by_rank, joined))
        join_completed_by = None
        if len(self.joined) == self.size:
            # Horovod returns the rank that joined last; ranks joining in the same
            # cycle are ordered by rank, so every rank picks the same one.
            join_completed_by = max(newly_joined)
            self.joined = []
        return CycleOutcome(ready, join_completed_by, shutdown_by, reason)


def decide(name: str, set_id: int, by_rank: Dict[int, Announcement], joined: Sequence[int] = ()) -> Decision:
    """The decision for an operation every member has reached: run it, or fail it on every rank."""
    rejected = {r: a.error for r, a in sorted(by_rank.items()) if a.error is not None}
    if rejected:
        error_type = next(iter(rejected.values()))[0]
        kind = next(a.kind for a in by_rank.values())
        reasons = "; ".join(f"rank {r}: {message}" for r, (_, message) in rejected.items())
        return Decision(name, by_rank, f"{kind} {name!r} was rejected ({reasons})", error_type, set_id)
    error = disagreement(name, by_rank, joined)
    kinds = {a.kind for a in by_rank.values()}
    error_type = "ValueError" if kinds <= set(PROCESS_SET_KINDS) else "TensorMismatchError"
    return Decision(name, by_rank, error, error_type, set_id)


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
        return f"ranks submitted different operations under the name {name!r}: " + _describe(by_rank, lambda a: a.kind)
    kind = next(iter(by_rank.values())).kind
    absent = [r for r in joined if r not in by_rank]
    if absent and kind != "allreduce":
        return (
            f"{kind} {name!r} cannot run: rank(s) {', '.join(map(str, absent))} already called hvd.join(); "
            f"after join only allreduce continues (joined ranks contribute zeros)"
        )
    if differs(lambda a: len(a.shapes)):
        return problem("number of tensors", lambda a: len(a.shapes))
    if differs(lambda a: a.dtypes):
        return problem("dtype", lambda a: ", ".join(a.dtypes))
    if differs(lambda a: a.device):
        return problem("device type", lambda a: a.device)
    if kind in ("allreduce", "reducescatter", "broadcast") and differs(lambda a: a.shapes):
        return problem("shape", lambda a: ", ".join(str(_shape(s)) for s in a.shapes))
    if kind in ("allgather", "alltoall") and differs(lambda a: [s[1:] for s in a.shapes]):
        return problem("shape after the first dimension", lambda a: ", ".join(str(_shape(s)) for s in a.shapes))
    if kind in REDUCING_KINDS:
        if differs(lambda a: a.op):
            return problem("reduction op", lambda a: OP_NAMES.get(a.op, a.op))
        if differs(lambda a: (a.prescale, a.postscale)):
            return problem("prescale/postscale factors", lambda a: (a.prescale, a.postscale))
    if kind == "broadcast" and differs(lambda a: a.root):
        return problem("root rank", lambda a: a.root)
    if kind in PROCESS_SET_KINDS and differs(lambda a: a.ranks):
        return problem("ranks", lambda a: list(a.ranks or ()))  # process-set announcements carry their ranks
    return None
