"""Stopping together: the SIGTERM agreement and the no-progress watchdog.

SIGTERM, as sent by SLURM before a time limit or by Kubernetes before eviction,
sets a flag, once the loop has asked for it (:meth:`StopSignal.agreed`, that is
``job.should_stop()``); before that, and in a loop that never asks, it ends the
process as it would without trainbridge. Ranks must agree on the step at which they stop, or one would wait
in a collective for a peer that already left, so the flag is max-allreduced
each step. The allreduce is asynchronous and its result is read one step later:
no host sync, no extra Horovod cycle, and the run stops at most one step after
the signal.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable, Optional

import torch

WATCHDOG_EXIT_CODE = 124


class StopSignal:
    def __init__(self, allreduce_async: Callable[[torch.Tensor, str, str], Callable[[], torch.Tensor]]) -> None:
        self.allreduce_async = allreduce_async
        self.received = False
        self.asked = False  # the loop calls should_stop(): it will stop cleanly on the flag
        self.pending: Optional[Callable[[], torch.Tensor]] = None
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        if not self.asked:  # nobody would read the flag: the signal's own default, death by SIGTERM
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.received = True

    def agreed(self) -> bool:
        """True on every rank at the same step once any rank got SIGTERM (read one step late)."""
        self.asked = True
        stop = self.drain()
        self.pending = self.allreduce_async(torch.tensor([1.0 if self.received else 0.0]), "max", "stop_signal")
        return stop

    def drain(self) -> bool:
        """Finish the allreduce in flight; whether it said stop."""
        stop = False
        if self.pending is not None:
            stop = bool(self.pending()[0] > 0)
            self.pending = None
        return stop


class Watchdog:
    """Ends this rank when training makes no progress for ``timeout`` seconds.

    Collective timeouts do not cover every stall: with Horovod's MPI controller,
    a frozen peer (e.g. SIGSTOP, a hung GPU) blocks the negotiation itself, and
    the stall check never runs; a TCP handshake with a program that is not the
    rendezvous store can wait for ever. The loop calls :meth:`beat` after each step
    and evaluation batch, and :func:`trainbridge.init` arms it around start-up; a
    daemon thread exits the process with one clear line when the beats stop, so
    the launcher can tear the job down.
    """

    def __init__(self, timeout: float, rank: int) -> None:
        self.timeout, self.rank = timeout, rank
        self.limit = timeout
        self.waiting = "training progress"
        self.last = time.monotonic()
        self.armed = False
        threading.Thread(target=self._watch, name="trainbridge-watchdog", daemon=True).start()

    def beat(self) -> None:
        self.last = time.monotonic()
        self.limit, self.waiting = self.timeout, "training progress"
        self.armed = True

    def expect(self, waiting: str, seconds: float) -> None:
        """Arm for one wait that must end within ``seconds`` (e.g. joining the job)."""
        self.waiting, self.limit = waiting, seconds
        self.last = time.monotonic()
        self.armed = True

    def disarm(self) -> None:
        self.armed = False

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 10))
            idle = time.monotonic() - self.last
            if self.armed and idle > self.limit:
                print(f"trainbridge: error: rank {self.rank}: no {self.waiting} for {idle:.0f}s "
                      f"(--timeout {self.timeout:.0f}); another rank probably died or stalled: see its log",
                      file=sys.stderr, flush=True)
                os._exit(WATCHDOG_EXIT_CODE)
