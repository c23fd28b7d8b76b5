"""Stopping together: the SIGTERM agreement, and the watchdog on waits for the other ranks.

SIGTERM, as sent by SLURM before a time limit or by Kubernetes before eviction (and
SIGINT and SIGHUP, a terminal's Ctrl-C and hang-up, where they have their default action),
sets a flag, once the loop has asked for it (:meth:`StopSignal.agreed`, that is
``job.should_stop()``); before that, and in a loop that never asks, it ends the
process as it would without trainbridge. Ranks must agree on the step at which they stop, or one would wait
in a collective for a peer that already left, so the flag is max-allreduced
each step. The allreduce is asynchronous and its result is read one step later:
no host sync, no extra Horovod cycle, and the run stops at most one step after
the signal.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch

from ..runtime.watchdog import WatchdogThread
from .loader_workers import describe_workers, kill_workers

WATCHDOG_EXIT_CODE = 124
FOR_PEERS = (
    "the other ranks",
    "a rank died or stalled, or the ranks called different operations; compare with the other ranks' lines",
)
FOR_WORKERS = (
    "this rank's DataLoader workers",
    "a worker is stuck (a read that never returns, or a lock held when it was forked); their stacks follow",
)


# Besides SIGTERM, the signals of a terminal: Ctrl-C reaches every process of a torchrun job
# (SIGINT), closing the terminal too (SIGHUP). Each is taken over only where it has its default
# action: an ignored one (nohup, tb.spawn's workers) or a handler of the script's own stays.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StopSignal:
    def __init__(self, allreduce_async: Callable[[torch.Tensor, str, str], Callable[[], torch.Tensor]]) -> None:
        self.allreduce_async = allreduce_async
        self.received = False
        self.signum = 0  # the first signal received
        self.name = "SIGTERM"  # the signal the ranks agreed on, for the stop line: the same on every rank
        self.asked = False  # the loop calls should_stop(): it will stop cleanly on the flag
        self.pending: Optional[Callable[[], torch.Tensor]] = None
        self.stopping = False  # every rank has read a "stop" from the agreement
        self.previous: Dict[int, Any] = {}  # each taken signal's handler before, for a loop that never asks
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                before = signal.getsignal(signum)
                if signum == signal.SIGTERM or before in (signal.SIG_DFL, signal.default_int_handler):
                    self.previous[signum] = before
                    signal.signal(signum, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        if not self.asked:  # nobody would read the flag: what the signal did without trainbridge
            before = self.previous.get(signum, signal.SIG_DFL)
            if callable(before):  # SIGINT's KeyboardInterrupt
                before(signum, frame)
                return
            signal.signal(signum, signal.SIG_DFL)  # death by the signal
            os.kill(os.getpid(), signum)
            return
        if not self.received:
            self.signum = signum
        self.received = True

    def agreed(self) -> bool:
        """True on every rank at the same step once any rank got SIGTERM (read one step late)."""
        self.asked = True
        if self.drain() or self.stopping:  # once agreed, on every rank: a loop that missed it stops now
            return True
        # The flag is the signal's number (SIGHUP 1, SIGINT 2, SIGTERM 15): every rank learns one to name.
        flag = float(self.signum or signal.SIGTERM) if self.received else 0.0
        self.pending = self.allreduce_async(torch.tensor([flag]), "max", "stop_signal")
        return False

    def abandon(self) -> None:
        """Drop the allreduce in flight unread: it was started in a world that has since changed (elastic)."""
        self.pending = None

    def drain(self) -> bool:
        """Finish the allreduce in flight; whether it said stop."""
        if self.pending is not None:
            agreed = int(self.pending()[0])
            if agreed > 0 and not self.stopping:
                self.stopping, self.name = True, signal.Signals(agreed).name
            self.pending = None
        return self.stopping


class Watchdog:
    """Ends this rank when one wait for the other ranks lasts longer than ``timeout`` seconds.

    Collective timeouts do not cover every wait: with Horovod's MPI controller, a
    frozen peer (e.g. SIGSTOP, a hung GPU) blocks the negotiation itself, and the
    stall check never runs; a TCP handshake with a program that is not the
    rendezvous store can wait for ever. So the job marks every call that waits for
    the other ranks (:meth:`waiting`: its collectives, the gradient averaging of
    ``job.backward``, saves and loads, the stop agreement), and ``tb.init`` marks
    joining the job. A daemon thread ends the process with one line naming the call
    when one lasts too long, so the launcher can tear the job down; the ranks'
    lines side by side then show a rank that died (no line) or ranks that wait in
    different calls (a mismatch). The time between waits is this rank's own work
    (a long evaluation, data preparation) and is never cut short. The checks run on
    :class:`trainbridge.runtime.watchdog.WatchdogThread`, as ``trainbridge.hvd``'s stall check does.
    """

    def __init__(self, timeout: float, rank: int) -> None:
        self.timeout, self.rank = timeout, rank
        self.limit = timeout
        self.since = time.monotonic()
        self.what: Optional[str] = None  # the wait in progress
        self.waited_for = FOR_PEERS
        self.failed_in: Optional[str] = None  # the wait an exception (a collective's own timeout) ended
        self._thread = WatchdogThread(self._check, min(1.0, timeout / 10), name="trainbridge-watchdog")

    @contextlib.contextmanager
    def waiting(self, what: str, waited_for: Tuple[str, str] = FOR_PEERS) -> Iterator[None]:
        """Bound the block, a wait described by ``what``, by ``timeout``; ``waited_for``: whom, and likely causes."""
        if self.what is not None:  # inside another wait (a save's barrier): the outer one names it
            yield
            return
        self.expect(what, self.timeout, waited_for)
        try:
            yield
        except BaseException:
            self.failed_in = what
            raise
        finally:
            self.what = None

    def expect(self, what: str, seconds: float, waited_for: Tuple[str, str] = FOR_PEERS) -> None:
        """Arm for one wait that must end within ``seconds`` (e.g. joining the job), until :meth:`disarm`."""
        self.limit, self.since, self.waited_for = seconds, time.monotonic(), waited_for
        self.what = what

    def disarm(self) -> None:
        self.what = None

    def _check(self) -> None:
        what, (whom, causes), waited = self.what, self.waited_for, time.monotonic() - self.since
        if what is not None and waited > self.limit:
            # One write, as report_error's: the other ranks' watchdogs may be writing theirs at this moment.
            sys.stderr.write(
                f"trainbridge: error: rank {self.rank}: waited {waited:.0f}s in {what} for {whom} "
                f"(timeout {self.timeout:g}s): {causes}\n"
            )
            sys.stderr.flush()
            if self.waited_for is FOR_WORKERS:
                print(describe_workers(), file=sys.stderr, flush=True)
            kill_workers()  # a stuck DataLoader worker would keep the launcher's output open
            os._exit(WATCHDOG_EXIT_CODE)
