"""The one timeout: how long a rank waits for the others before the job fails instead of hanging.

Every wait for the other ranks is bounded by it: joining the job, each collective, the
watchdog. The public API takes it as ``tb.init(timeout=...)`` (``trainbridge train
--timeout``); ``trainbridge.hvd``, whose ``hvd.init()`` keeps Horovod's signature, reads it
from ``TRAINBRIDGE_HVD_TIMEOUT``. Both default to :data:`DEFAULT_TIMEOUT_S` and refuse a
value that is not a positive number of seconds with one line.
"""

from __future__ import annotations

import math
import os
from typing import Mapping, Optional

from ..errors import UserError

DEFAULT_TIMEOUT_S = 300.0
HVD_TIMEOUT_VARIABLE = "TRAINBRIDGE_HVD_TIMEOUT"


def check_timeout(seconds: float, setting: str = "timeout") -> float:
    """``seconds``, or a UserError naming ``setting`` when it is not a positive, finite number (a string,
    NaN, which no comparison bounds, and infinity, which no clock reaches, are refused too)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise UserError(
            f"{setting} must be a number of seconds, got the {type(seconds).__name__} {seconds!r}; "
            f"pass a number (default {DEFAULT_TIMEOUT_S:g})"
        )
    if not (math.isfinite(seconds) and seconds > 0):
        raise UserError(
            f"{setting} must be a positive, finite number of seconds (got {seconds}); it bounds every wait "
            f"for the other ranks (default {DEFAULT_TIMEOUT_S:g})"
        )
    return float(seconds)


def timeout_from_environ(environ: Optional[Mapping[str, str]] = None) -> float:
    """The timeout of ``trainbridge.hvd``: ``TRAINBRIDGE_HVD_TIMEOUT`` seconds, else :data:`DEFAULT_TIMEOUT_S`."""
    environ = os.environ if environ is None else environ
    text = environ.get(HVD_TIMEOUT_VARIABLE, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        raise UserError(
            f"{HVD_TIMEOUT_VARIABLE}={text!r} is not a number of seconds; set it to the seconds a "
            f"rank may wait for the others (default {DEFAULT_TIMEOUT_S:g}) or unset it"
        ) from None
    return check_timeout(seconds, f"{HVD_TIMEOUT_VARIABLE}={text}")
