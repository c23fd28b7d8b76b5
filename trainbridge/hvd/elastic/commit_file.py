"""Where committed elastic state survives a torchrun restart, and which job it belongs to.

torchrun (``--max-restarts N``) restarts *every* worker when one fails, so the
in-memory commit of Horovod's elastic mode is lost with the processes. Under
torchrun, rank 0 therefore also writes each commit to

    $TRAINBRIDGE_ELASTIC_DIR/state.pt     (default: <tmp>/trainbridge-elastic-<uid>-<TORCHELASTIC_RUN_ID>/)

atomically and durably (write, fsync, rename, fsync the directory: the writer of
trainbridge's checkpoints, :mod:`trainbridge.runtime.atomic_files`), on a thread:
``commit()`` returns once the state is copied, as Horovod's in-memory commit does,
and the next commit waits for the previous write. The commit that returned is still
the one a restart finds: torchrun stops the other workers with SIGTERM when one fails
(and SIGKILLs them 30 s later), and rank 0 finishes its write before it obeys the
signal, as it does before it exits. A crash during a write leaves the previous commit,
complete. On a restart (TORCHELASTIC_RESTART_COUNT > 0) rank 0 loads it and
``state.sync()`` broadcasts it to the other ranks, which may run on other nodes.
Outside torchrun nothing is written.

The default folder is in the shared temporary directory, so it is made with mode 0700
and checked before every read and write: a folder that is a link, another user's, or
open to others stops the job with one line (another user could plant a commit there,
or redirect the writes through links). Temporary files are made new, never through a
link; in an explicit TRAINBRIDGE_ELASTIC_DIR a commit file of another user is ignored.

The file belongs to one torchrun invocation (:func:`job_identity`), which it
records:

* a first attempt (restart count 0) never loads it, and rank 0 removes a file
  left there by an earlier job before training starts;
* a restart loads it only if this invocation wrote it; otherwise it prints one
  line and starts from the initial state;
* when ``hvd.elastic.run`` returns on every rank, rank 0 removes it from the
  default directory (an explicit TRAINBRIDGE_ELASTIC_DIR keeps the last commit,
  which no later job will load).

The file is read with ``torch.load(..., weights_only=True)``, like every other
checkpoint of trainbridge. Numpy scalars, enums, named tuples and defaultdicts
are stored as plain values and rebuilt with their types on a restart
(:mod:`.plain_values`); any other value that loader refuses fails ``commit()``
with a ``TypeError`` naming it, instead of a file the restart could not read.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import sys
import tempfile
import threading
from typing import Any, Mapping, Optional

import torch

from ...runtime.atomic_files import BackgroundWriter, checksum_error, leftover_temporary_files, save_atomically
from ...runtime.safe_files import owner_problem, private_directory
from .plain_values import from_plain, to_plain

SHARED_RUN_ID = "none"  # torchrun's default --rdzv-id (static rendezvous): every such job has it


def commit_path(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The commit file of this torchrun job, or None outside torchrun."""
    environ = os.environ if environ is None else environ
    directory = environ.get("TRAINBRIDGE_ELASTIC_DIR")
    if directory is None:
        run_id = environ.get("TORCHELASTIC_RUN_ID")
        if run_id is None:
            return None
        # Per user: two users' jobs with torchrun's default run id never meet in one folder.
        directory = os.path.join(tempfile.gettempdir(), f"trainbridge-elastic-{os.geteuid()}-{run_id}")
    return os.path.join(directory, "state.pt")


def check_directory(path: str) -> None:
    """The default folder (in the shared temporary directory) made if missing and checked to be this user's
    alone: UserError otherwise. An explicit TRAINBRIDGE_ELASTIC_DIR is made as it is, the user's choice."""
    directory = os.path.dirname(path)
    if not is_default_location():
        os.makedirs(directory, exist_ok=True)
        return
    private_directory(
        directory,
        "hvd.elastic: the commit folder",
        "remove it, or set TRAINBRIDGE_ELASTIC_DIR to a folder of your own",
    )


def is_restart(environ: Optional[Mapping[str, str]] = None) -> bool:
    environ = os.environ if environ is None else environ
    return int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def job_identity(environ: Optional[Mapping[str, str]] = None) -> str:
    """This torchrun invocation: the same in all its restarts, another in the next invocation.

    The run id, unless it is torchrun's default "none" (plain ``torchrun --master-port``,
    multi-node static rendezvous): then also the agent's own directory, which torchrun
    creates afresh per invocation and passes in TORCHELASTIC_ERROR_FILE, or else the
    agent's host and process id (the worker's parent, alive across restarts).
    """
    environ = os.environ if environ is None else environ
    run_id = environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id != SHARED_RUN_ID:
        return run_id
    error_file = environ.get("TORCHELASTIC_ERROR_FILE", "")
    agent = (
        error_file.split(f"{os.sep}attempt_")[0]
        if f"{os.sep}attempt_" in error_file
        else f"{socket.gethostname()}:{os.getppid()}"
    )
    return f"{run_id}@{agent}"


def check_plain(value: Any, where: str = "state") -> Any:
    """``value`` as the commit file stores it (:func:`.plain_values.to_plain`); TypeError naming the first
    value that ``torch.load(weights_only=True)`` would refuse."""
    return to_plain(value, where)


def save(snapshot: Any, path: str, job: str = "") -> None:
    """Check ``snapshot`` (:func:`check_plain`) and write it for ``job`` to ``path`` so that a crash or power
    loss at any moment leaves the previous commit or this one there, never a torn file.

    The writer of trainbridge's checkpoints (:func:`trainbridge.runtime.atomic_files.save_atomically`):
    a temporary file in the same directory, flushed and fsynced, renamed over ``path`` (atomic on
    POSIX), then the directory fsynced so that the rename itself is on disk. A failed write raises
    its own error (an ``OSError`` for a full disk) and leaves the previous commit as it was.
    """
    _write(check_plain(snapshot), path, job)  # checked before anything is written


def _write(plain: Any, path: str, job: str) -> None:
    check_directory(path)
    save_atomically({"job": job, "state": plain}, path)


class CommitWriter(BackgroundWriter):
    """The runtime's background writer (one write at a time, in order, errors at ``wait()``) for commits,
    which never lets the process end mid-write."""

    def __init__(self) -> None:
        super().__init__(name="hvd-elastic-commit", daemon=True)
        self._guarded = False

    def save(self, snapshot: Any, path: str, job: str = "") -> None:
        """:func:`save` on a thread: ``snapshot`` is checked (TypeError) here; the previous write finishes first."""
        plain = check_plain(snapshot)
        self.wait()
        self._guard_exits()
        self.start(lambda: _write(plain, path, job))

    def _guard_exits(self) -> None:
        if self._guarded:
            return
        self._guarded = True
        atexit.register(self._wait_at_exit)
        if threading.current_thread() is threading.main_thread():  # signal handlers belong to the main thread
            previous = signal.getsignal(signal.SIGTERM)

            def finish_then_obey(signum: int, frame: Any) -> None:
                # torchrun's SIGTERM after a peer's crash: the returned commit reaches the file first.
                self._wait_at_exit()
                signal.signal(signal.SIGTERM, previous)
                if callable(previous):
                    previous(signum, frame)
                elif previous == signal.SIG_DFL:
                    os.kill(os.getpid(), signal.SIGTERM)

            signal.signal(signal.SIGTERM, finish_then_obey)

    def _wait_at_exit(self) -> None:
        try:
            self.wait()
        except Exception as exc:  # noqa: BLE001 - the process is ending: say why the last commit is missing
            print(f"hvd.elastic: the last commit was not written: {exc}", file=sys.stderr, flush=True)


writer = CommitWriter()


def _read(path: str) -> Optional[dict]:
    check_directory(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    stranger = owner_problem(info)
    if stranger is not None:  # in an explicit TRAINBRIDGE_ELASTIC_DIR that others can write
        print(f"hvd.elastic: ignoring {path}: it {stranger}; starting from the initial state", flush=True)
        return None
    changed = checksum_error(path)  # a flipped bit must not be broadcast to every rank as the state
    if changed is not None:
        print(f"hvd.elastic: ignoring {path}: {changed}; starting from the initial state", flush=True)
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


def load(path: str, job: Optional[str] = None) -> Optional[Any]:
    """The snapshot in ``path``; None if there is none or, when ``job`` is given, if another job wrote it."""
    document = _read(path)
    if document is None:
        return None
    written_by = document.get("job") if isinstance(document, dict) else None
    if job is not None and written_by != job:
        print(
            f"hvd.elastic: ignoring {path}: it was written by another torchrun job ({written_by or 'unknown'}, "
            f"this is {job}); starting from the initial state (give each job its own --rdzv-id or "
            f"TRAINBRIDGE_ELASTIC_DIR)",
            flush=True,
        )
        return None
    return from_plain(document["state"])


def remove(path: str, why: str = "") -> None:
    """Delete the commit file (and the default directory, once empty); ``why`` is printed if there was one."""
    writer.wait()  # a write in flight would bring it back
    check_directory(path)
    if os.path.lexists(path):
        os.remove(path)
        if why:
            print(f"hvd.elastic: removed {path}: {why}", flush=True)
    for partial in leftover_temporary_files(path):  # a writer killed mid-write (torchrun stops every
        with contextlib.suppress(OSError):  # worker when one fails)
            os.remove(partial)
    if is_default_location():
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(path))  # once empty; an explicit TRAINBRIDGE_ELASTIC_DIR stays


def is_default_location(environ: Optional[Mapping[str, str]] = None) -> bool:
    environ = os.environ if environ is None else environ
    return "TRAINBRIDGE_ELASTIC_DIR" not in environ
