"""A cheap check that every rank passes the same small value: one fixed-size allreduce, no pickling.

``job.allreduce`` runs it before each reduction: a dtype or shape that differs between ranks
would give garbage or abort inside gloo. The backend's ``check_same_on_every_rank`` names each
rank's value, but gathers pickled objects (two collectives and pickling, about 15 times a small
allreduce); so the ranks first compare a 52-bit digest of the value, and only a mismatch, when
every rank sees it, pays for the gather that names the values.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from ..backends import Backend

_DIGEST_BITS = 52  # a float64 holds every integer below 2**53 exactly


def digest(value: Any) -> int:
    """A 52-bit digest of ``repr(value)``, the same in every process (unlike ``hash``)."""
    raw = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") >> (64 - _DIGEST_BITS)


def same_on_every_rank(backend: Backend, value: Any, name: str) -> bool:
    """Whether every rank passed a ``value`` of the same digest: one max-allreduce of ``(d, -d)``, which
    gives ``(max d, -min d)``; all equal exactly when both are this rank's ``d``. ``name``: the call site
    (Horovod negotiates a fixed name once). Every rank gets the same answer."""
    d = float(digest(value))
    highest, negated_lowest = backend.allreduce_async(torch.tensor([d, -d], dtype=torch.float64), "max", name)()
    return float(highest) == d and -float(negated_lowest) == d
