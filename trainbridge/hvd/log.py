"""trainbridge.hvd's log lines, at Horovod's levels (HOROVOD_LOG_LEVEL, HOROVOD_LOG_HIDE_TIME).

``warning`` (the default) shows the stall warnings; ``info`` adds one line per rank at ``hvd.init()``
with the settings in force; ``debug`` one line per decided operation; ``trace`` one line per
negotiation cycle; ``error`` and ``fatal`` hide the warnings. As Horovod's, lines up to ``info`` go
to stdout, warnings to stderr, each with the time unless HOROVOD_LOG_HIDE_TIME=1.
"""

from __future__ import annotations

import datetime
import sys

from .settings import LOG_LEVELS, Settings

_threshold = LOG_LEVELS.index("warning")
_show_time = True


def configure(settings: Settings) -> None:
    """Use ``settings``' level and time stamps from now on (``hvd.init()`` calls it)."""
    global _threshold, _show_time
    _threshold, _show_time = LOG_LEVELS.index(settings.log_level), settings.log_time


def enabled(level: str) -> bool:
    """Whether a line at ``level`` is shown (callers skip building costly messages otherwise)."""
    return LOG_LEVELS.index(level) >= _threshold


def log(level: str, message: str) -> None:
    """One line ``trainbridge.hvd: <level>: <message>``, if ``level`` is shown."""
    if not enabled(level):
        return
    stamp = f"[{datetime.datetime.now():%Y-%m-%d %H:%M:%S.%f}] " if _show_time else ""
    stream = sys.stdout if LOG_LEVELS.index(level) <= LOG_LEVELS.index("info") else sys.stderr
    print(f"{stamp}trainbridge.hvd: {level}: {message}", file=stream, flush=True)
