"""The watchdog's thread: it checks, every ``period`` seconds, how long the waits it watches have lasted.

Both watchdogs of trainbridge run on it; each decides what a wait too long means:

* the public API's (:class:`trainbridge.api.stop.Watchdog`) watches the one call in
  progress that waits for the other ranks, and ends the process with one line past the
  timeout;
* ``trainbridge.hvd``'s engine watches every operation this rank has submitted: a warning
  past HOROVOD_STALL_CHECK_TIME_SECONDS, the job shut down past
  HOROVOD_STALL_SHUTDOWN_TIME_SECONDS (at most the timeout).

The thread is a daemon: it never keeps the process alive, and it ends with :meth:`stop`
or once ``alive()`` turns false (the hvd engine's own thread ended).
"""

from __future__ import annotations

import threading
from typing import Callable


class WatchdogThread:
    """Calls ``check()`` every ``period`` seconds on a daemon thread ``name``, until :meth:`stop` or not ``alive()``."""

    def __init__(
        self, check: Callable[[], None], period: float, name: str, alive: Callable[[], bool] = lambda: True
    ) -> None:
        self.period = period
        self._check, self._alive = check, alive
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self._alive() and not self._stopped.wait(self.period):
            self._check()

    def stop(self) -> None:
        """End the thread (after the check in progress, if any) and wait for it."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
