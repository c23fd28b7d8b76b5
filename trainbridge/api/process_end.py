"""How a rank's process ends: one line instead of a traceback for bad input and for a
peer's failure (``sys.excepthook`` from ``tb.init`` on), and an exit that skips the
interpreter's C++ teardown."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, NoReturn, Optional

from ..errors import UserError
from ..launch import detect_launch, report_error
from ..launch.rendezvous import finalize_mpi
from .loader_workers import kill_workers

if TYPE_CHECKING:
    from .job import Job

QUIET_RANK_GRACE_SECONDS = 10.0
PEER_FAILURE_DELAY_SECONDS = 2.0


def exit_process(code: int) -> NoReturn:
    """Exit with ``code`` once the work is done, skipping the interpreter's C++ teardown.

    After a clean shutdown of the process group, gloo and the rendezvous store can
    still hold helper threads in static objects; destroying them at interpreter exit
    sometimes aborts the process ("terminate called without an active exception",
    SIGABRT), which a launcher reports as a failed rank. Everything this process
    owes the job (checkpoints, metrics, the shutdown barrier) is finished here, so
    flush and leave directly (after a collection, so DataLoader workers are shut down).
    It also closes a race: the interpreter's teardown restores the default SIGTERM
    action, so a launcher that stops the other ranks once the first has exited would
    kill a rank that had finished its work.
    A failed rank skips MPI_Finalize, which could wait on peers that are gone; mpirun
    then reports it as failed, as it should.
    A failed rank also skips the collection: its process group is still alive, held by a
    DDP model in a reference cycle, and collecting it would run the group's destructor
    with the GIL held while a gloo thread, finishing the last collective, waits for the GIL
    under the lock that destructor takes: a deadlock (seen in CI: rank 0 hung after its
    one-line error, and its peer with it). kill_workers ends the loaders' workers anyway.
    """
    if code == 0:
        gc.collect()
    kill_workers()  # live loaders' workers, as Python's own exit would terminate them
    if code == 0:
        finalize_mpi()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _LiveJob:
    job: Optional["Job"] = None  # the live job, whose backend can tell a peer's failure from a bug


current = _LiveJob()  # set by tb.init, cleared by job.shutdown


def report_failure(exc: BaseException) -> Optional[int]:
    """Report ``exc`` as one line if it is the user's or a peer's fault; the exit status, or None for a bug.

    Input and launcher errors are the same on every rank: one line from rank 0 is
    enough. Before the job has started, the other ranks give rank 0 time to report
    first (a launcher kills the rest of the job on the first exit) and speak only
    if still alive, i.e. when the error was theirs alone. After that, an error may
    be one rank's and each reports it, unless it is raised with ``quiet=True``
    (``tb.UserError(message, quiet=not job.is_main)`` for one that every rank hits).
    """
    if isinstance(exc, UserError):
        if (current.job is None and _launch_rank() != 0) or exc.quiet:
            _leave_on_sigterm()
            time.sleep(QUIET_RANK_GRACE_SECONDS)
        if not exc.quiet:
            report_error(str(exc))
        return 2
    job = current.job
    message = job.backend.describe_failure(exc) if job is not None else None
    if job is None or message is None:
        return None
    if job.watchdog.failed_in is not None:  # so that ranks in different calls read as a mismatch
        message = f"{message} (this rank waited in {job.watchdog.failed_in})"
    # A peer's failure is the consequence of another rank's: let that rank's own line
    # reach the launcher's summary first (torchrun names the earliest error as the cause).
    _leave_on_sigterm()
    time.sleep(PEER_FAILURE_DELAY_SECONDS)
    report_error(message)
    return 1


def _launch_rank() -> int:
    """This process's rank as the launcher announced it; 0 when the announcement itself is the error."""
    try:
        return detect_launch().rank
    except UserError:
        return 0


def _leave_on_sigterm() -> None:
    """While this rank waits to report, the launcher's SIGTERM ends it (the stop agreement's handler would not)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def excepthook(exc_type, exc, tb) -> None:
    """``sys.excepthook`` from ``tb.init`` on: bad input and a peer's failure are one line (:func:`report_failure`)."""
    sys.stderr = sys.__stderr__  # not a capture buffer that os._exit would discard
    code = report_failure(exc)
    if code is None:  # a bug: its traceback, then the exit status Python gives it
        sys.__excepthook__(exc_type, exc, tb)
        code = 1
    leave_after_failure(code)


def leave_after_failure(code: int) -> NoReturn:
    """End a rank whose failure has been reported: leave the job without waiting for the
    peers, then exit at once with ``code``.

    At once, without the interpreter's teardown: the collective library's threads must not
    hold the process open, and a gloo group alive at the teardown can abort the process
    (``runtime/gloo_threads.py``). The group is left to this exit (``TorchBackend.shutdown``).
    """
    if current.job is not None:
        current.job.backend.shutdown(clean=False)
    kill_workers()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os._exit(code)
