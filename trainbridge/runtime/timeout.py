"""The one timeout: how long a rank waits for the others before the job fails instead of hanging.

Every wait for the other ranks is bounded by it: joining the job, each collective, the
watchdog. The public API takes it as ``tb.init(timeout=...)`` (``trainbridge train
--timeout``); ``trainbridge.hvd``, whose ``hvd.init()`` keeps Horovod's signature, reads it
from ``TRAINBRIDGE_HVD_TIMEOUT``. Both default to :data:`DEFAULT_TIMEOUT_S` and refuse a
value that is not a positive number of seconds with one line.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

from ..errors import UserError

DEFAULT_TIMEOUT_S = 300.0
HVD_TIMEOUT_VARIABLE = "TRAINBRIDGE_HVD_TIMEOUT"


def check_timeout(seconds: float, setting: str = "timeout") -> float:
    """``seconds``, or a UserError naming ``setting`` when it is not a positive number."""
    if not seconds > 0:
        raise UserError(f"{setting} must be positive (got {seconds})")
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
