"""The job this process joined with ``hvd.init()``: read by every operation, set by init and shutdown.

Its own module so that :mod:`.process` (which sets it) and :mod:`.process_sets` (which
reads it, and which init uses) do not import each other.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional

from .engine import Engine
from .settings import Settings
from .timeline import Timeline


@dataclasses.dataclass
class Runtime:
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    homogeneous: bool
    engine: Engine
    groups: List[Any]
    settings: Settings
    timeline: Optional[Timeline]  # rank 0's, when HOROVOD_TIMELINE is set


_current: Optional[Runtime] = None


def runtime() -> Runtime:
    """The running job, or Horovod's ValueError when init() has not been called."""
    if _current is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return _current


def is_initialized() -> bool:
    """True between ``hvd.init()`` and ``hvd.shutdown()``."""
    return _current is not None


def replace(running: Optional[Runtime]) -> Optional[Runtime]:
    """Make ``running`` the current job (None: no job); returns the one it replaces."""
    global _current
    previous, _current = _current, running
    return previous
