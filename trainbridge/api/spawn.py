"""``tb.spawn``: a user's script as N local workers, for plain ``python script.py --nproc N``."""

from __future__ import annotations

import functools
from typing import Any, Callable

from ..launch.spawn import spawn_workers
from .process_end import leave_after_failure, report_failure


def _run(fn: Callable[..., Any], args: tuple) -> int:
    try:
        return fn(*args) or 0
    except Exception as exc:  # noqa: BLE001 - bad input and peer failures become one line, as under a launcher
        code = report_failure(exc)
        if code is None:
            raise
        leave_after_failure(code)  # as under a launcher (the excepthook)


def spawn(fn: Callable[..., Any], nproc: int, *args: Any) -> int:
    """``fn(*args)`` in ``nproc`` local worker processes that :func:`trainbridge.init` sees as one job.

    ``fn`` must be a module-level function (the workers import it). Returns the
    first non-zero exit status, else 0.
    """
    return spawn_workers(nproc, functools.partial(_run, fn, args))
