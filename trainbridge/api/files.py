"""Files written by the main rank: atomic, durable, never half-written.

Only rank 0 writes, to ``DIR/.<name>.<host>-<pid>-<n>-<random>.tmp`` first, then ``fsync`` and
``os.replace``: a kill during the write leaves the old file intact (a rename is atomic on
POSIX), and the directory is synced so that the rename itself survives a power loss.
The temporary name is this writer's own, so two writers of one path (two threads, two
jobs) never write into or rename each other's file: the last rename wins, whole.
A write that fails (a read-only place, a full disk, a path that is a directory, a value
that cannot be pickled) removes its temporary file, leaves the file at the path as it
was, and raises one UserError line naming the path, the cause and the fix.
A background write (:class:`BackgroundWriter`) keeps every one of these rules; only
the copy of the state to host memory stays on the training path. The writes themselves
are :mod:`trainbridge.runtime.atomic_files`' (``hvd.elastic``'s commit file uses them too);
this module words their errors for the user and reads the files back. Every file carries
its zip CRC-32s and every read checks them first, so a bit flipped on disk is found
before anything trains on it; the files still load with plain ``torch.load``.
"""

from __future__ import annotations

import errno
import os
import pickle
import time
from typing import Any, Dict, Mapping, Optional, Sequence

import torch

from ..errors import UserError, first_line
from ..runtime import atomic_files
from ..runtime.weights_only import unloadable_value  # noqa: F401 - job.save's check, imported from here

# The fix a failed write offers, in the library's words: a script chose the path. trainbridge train
# says "pass another --output-dir" instead (trainbridge.cli.flags), since its checkpoints live there.
ELSEWHERE = "save to another folder"


class CorruptCheckpoint(UserError):
    """A checkpoint file whose bytes are bad (truncated, not a torch file, failing its CRC-32): the only kind
    set aside."""


def state_mismatch(model: torch.nn.Module, state: Mapping[str, Any]) -> Optional[str]:
    """The missing, unexpected and mis-shaped keys of ``state`` for ``model``, in a phrase; None when it fits."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    mismatched = [k for k in own if k in state and getattr(state[k], "shape", None) != own[k].shape]
    if not (missing or unexpected or mismatched):
        return None

    def short(keys):
        return ", ".join(keys[:6]) + (f" (+{len(keys) - 6} more)" if len(keys) > 6 else "") if keys else "none"

    return (
        f"missing keys: {short(missing)}; unexpected keys: {short(unexpected)}; shape mismatches: {short(mismatched)}"
    )


def check_targets(paths: Sequence[str], keep_previous: Optional[str] = None) -> None:
    """UserError, before anything is written, when a path to write (or rotate to) is an existing directory."""
    for target in (*paths, keep_previous):
        if target and os.path.isdir(target):
            raise UserError(
                f"cannot write the checkpoint {paths[0]}: {target} is an existing directory, not a file; "
                f"nothing was written and the directory is left as it is; give a file path "
                f"(e.g. {os.path.join(target, 'last.pt')}) or move the directory away"
            )


def atomic_save(obj: Dict[str, Any], path: str, keep_previous: Optional[str] = None) -> None:
    """Write ``obj`` to ``path`` so that a crash at any moment leaves a loadable file there (or none).

    With ``keep_previous``, the file being replaced is first renamed to that path.
    A failed write raises UserError, removes its temporary file and leaves ``path``
    and ``keep_previous`` as they were.
    """
    check_targets([path], keep_previous)
    try:
        atomic_files.save_atomically(obj, path, keep_previous)
    except BaseException as exc:
        _raise_why_not_written(path, exc)
        raise  # not the file system, not pickling: a bug, keep its traceback


def atomic_copy(source: str, path: str) -> None:
    """Copy the file ``source`` to ``path`` with :func:`atomic_save`'s guarantees, in the kernel (no re-pickling)."""
    check_targets([path])
    try:
        atomic_files.copy_atomically(source, path)
    except BaseException as exc:
        _raise_why_not_written(path, exc)
        raise


def _raise_why_not_written(path: str, exc: BaseException) -> None:
    """One UserError line for a write that failed because of the file system or an unpicklable value; else return."""
    directory = os.path.dirname(os.path.abspath(path))
    unchanged = f"the checkpoints already in {directory} are unchanged"
    if isinstance(exc, OSError):
        if not os.path.lexists(directory):  # deleted while the job ran: nothing there is "unchanged"
            raise UserError(
                f"cannot write the checkpoint {path}: {directory} no longer exists (deleted while the job ran?); "
                f"nothing was written; create it again or {ELSEWHERE}"
            ) from exc
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            fix = f"make {directory} writable or {ELSEWHERE}"
        elif exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            fix = f"free space there or {ELSEWHERE}"
        else:
            fix = f"check {directory} or {ELSEWHERE}"
        raise UserError(f"cannot write the checkpoint {path}: {exc.strerror or exc}; {unchanged}; {fix}") from exc
    if isinstance(exc, pickle.PicklingError) or (
        isinstance(exc, (AttributeError, TypeError)) and "pickle" in str(exc).lower()
    ):
        raise UserError(
            f"cannot write the checkpoint {path}: a value in it cannot be pickled "
            f"({first_line(exc, 120)}); {unchanged}; save plain values (tensors, numbers, strings, "
            f"lists, dicts), not lambdas, local functions, locks or open files"
        ) from exc


# Seconds before each new try of a read that failed for a passing reason (a descriptor limit, a
# network file system's hiccup): such a file is never called corrupt, whatever the outcome.
READ_RETRY_DELAYS = (0.2, 1.0)


def read_file(
    path: str,
    map_location: Any = "cpu",
    missing: str = "check the path",
    corrupt: str = "delete it or load another file",
) -> Any:
    """``torch.load(path, weights_only=True)``; a missing or unreadable file is one UserError line
    ending in ``missing`` or ``corrupt`` (what to do about it).

    Only a file whose bytes are bad raises :class:`CorruptCheckpoint`. A read that fails for a
    reason outside the file (too many open files, EIO, ENOMEM, a stale NFS handle) is tried
    again, and then raises a plain UserError: a caller sets nothing aside because of it.
    """
    if not os.path.isfile(path):
        raise UserError(f"checkpoint {path} does not exist; {missing}")
    delays = list(READ_RETRY_DELAYS)
    while True:
        try:
            return _load(path, map_location, corrupt)
        except _PassingReadError as exc:
            if isinstance(exc.cause, FileNotFoundError):  # removed since the check above
                raise UserError(f"checkpoint {path} does not exist; {missing}") from None
            if not delays:
                raise UserError(
                    f"cannot read the checkpoint {path} ({exc.why}; tried {len(READ_RETRY_DELAYS) + 1} times); "
                    f"it is left where it is, nothing was moved; {exc.fix}, then try again"
                ) from exc.cause
            time.sleep(delays.pop(0))


class _PassingReadError(Exception):
    """A read that failed because of this process or the file system, not because of the file's bytes."""

    def __init__(self, cause: BaseException, path: str) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.why = getattr(cause, "strerror", None) or str(cause) or type(cause).__name__
        number = getattr(cause, "errno", None)
        if number in (errno.EMFILE, errno.ENFILE):
            self.fix = "close files this process holds open or raise the open-file limit (ulimit -n)"
        elif number == errno.ENOMEM or isinstance(cause, MemoryError):
            self.fix = "free memory"
        else:
            self.fix = f"check the file system that holds {os.path.dirname(os.path.abspath(path))}"


def _passing_cause(exc: BaseException) -> Optional[BaseException]:
    """The OSError or MemoryError behind ``exc`` (torch wraps a failed read of its file object), if any."""
    seen = set()
    cause: Optional[BaseException] = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, (OSError, MemoryError)):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def _load(path: str, map_location: Any, corrupt: str) -> Any:
    """One try of :func:`read_file`; :class:`_PassingReadError` for a failure outside the file's bytes."""
    try:
        changed = atomic_files.checksum_error(path)  # before torch.load, which never checks the CRC-32s
        if changed is None:
            return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - truncated zip, bad pickle, ... all mean "unreadable"
        passing = _passing_cause(exc)
        if passing is not None:
            raise _PassingReadError(passing, path) from exc
        if "Weights only load failed" in str(exc):  # readable, but holds a type outside the allow-list
            refused = next(
                (line.strip() for line in str(exc).splitlines() if "GLOBAL" in line or "Unsupported" in line),
                first_line(exc),
            )
            raise UserError(
                f"checkpoint {path} is intact but holds a value torch.load(weights_only=True) refuses "
                f"({refused[:200]}); load it with torch.serialization.add_safe_globals([...]) for that "
                f"type, or, if you trust the file, torch.load(weights_only=False)"
            ) from None
        raise CorruptCheckpoint(
            f"checkpoint {path} is corrupt or truncated ({type(exc).__name__}: {first_line(exc)}); {corrupt}"
        ) from None
    raise CorruptCheckpoint(f"checkpoint {path} is corrupt: {changed} (a bit changed on disk or in transit); {corrupt}")


def save_all(obj: Dict[str, Any], paths: Sequence[str], keep_previous: Optional[str] = None) -> None:
    """:func:`atomic_save` to the first of ``paths`` (``keep_previous`` applies to it), then copies of that file."""
    atomic_save(obj, paths[0], keep_previous=keep_previous)
    for path in paths[1:]:
        atomic_copy(paths[0], path)


def host_copy(obj: Any, copy: bool = True) -> Any:
    """``obj`` with every tensor in host memory. ``copy=True`` copies host tensors too: a snapshot
    that training can no longer change; ``copy=False`` moves only device tensors."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=copy)
    if isinstance(obj, dict):
        return {k: host_copy(v, copy) for k, v in obj.items()}
    if hasattr(obj, "_fields"):  # a named tuple: built from its fields, not from one iterable
        return type(obj)(*(host_copy(v, copy) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v, copy) for v in obj)
    return obj


class BackgroundWriter(atomic_files.BackgroundWriter):
    """Writes checkpoint snapshots with :func:`atomic_save` on a thread while training goes on.

    The runtime's one-write-at-a-time writer (:class:`trainbridge.runtime.atomic_files.BackgroundWriter`):
    :meth:`submit` first waits for the previous write, so writes land in order and
    ``keep_previous`` rotates the right file. :meth:`wait` (before a read, at the end, on a
    stop or an error) finishes the write in flight and raises its error, if it had one, as
    the UserError that a synchronous write would have raised.
    """

    def __init__(self, name: str = "trainbridge-checkpoint-writer", daemon: bool = False) -> None:
        super().__init__(name, daemon)

    def submit(self, obj: Dict[str, Any], paths: Sequence[str], keep_previous: Optional[str] = None) -> None:
        """Write ``obj`` to each of ``paths`` in the background (``keep_previous`` for the first)."""
        self.wait()
        check_targets(paths, keep_previous)  # a directory in the way: say so at the call, not at the next one
        snapshot = host_copy(obj)  # the only part on the training path
        self.start(lambda: save_all(snapshot, paths, keep_previous))
