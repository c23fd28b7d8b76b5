"""Files written by the main rank: atomic, durable, never half-written.

Only rank 0 writes, to ``DIR/.<name>.<host>-<pid>-<n>.tmp`` first, then ``fsync`` and
``os.replace``: a kill during the write leaves the old file intact (a rename is atomic on
POSIX), and the directory is synced so that the rename itself survives a power loss.
The temporary name is this writer's own, so two writers of one path (two threads, two
jobs) never write into or rename each other's file: the last rename wins, whole.
A write that fails (a read-only place, a full disk, a path that is a directory, a value
that cannot be pickled) removes its temporary file, leaves the file at the path as it
was, and raises one UserError line naming the path, the cause and the fix.
A background write (:class:`BackgroundWriter`) keeps every one of these rules; only
the copy of the state to host memory stays on the training path.
"""
from __future__ import annotations

import errno
import itertools
import os
import pickle
import shutil
import socket
import threading
from typing import Any, Callable, Dict, Optional, Sequence

import torch
from torch.utils.serialization import config as _serialization_config

from ..errors import UserError, first_line

# What torch.load(weights_only=True) reads back besides tensors and the containers below.
PLAIN_TYPES = (int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device, torch.Size)


class CorruptCheckpoint(UserError):
    """A checkpoint file that cannot be read at all (truncated, not a torch file): the only kind set aside."""


def _loadable_globals() -> set:
    try:
        from torch._weights_only_unpickler import _get_allowed_globals
        allowed = set(_get_allowed_globals())
    except (ImportError, AttributeError):  # another torch: trust torch.save's own checks
        return set()
    return allowed | {f"{g.__module__}.{g.__qualname__}" for g in torch.serialization.get_safe_globals()
                      if hasattr(g, "__qualname__")}


def state_mismatch(model: torch.nn.Module, state: Dict[str, Any]) -> Optional[str]:
    """The missing, unexpected and mis-shaped keys of ``state`` for ``model``, in a phrase; None when it fits."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    mismatched = [k for k in own if k in state and getattr(state[k], "shape", None) != own[k].shape]
    if not (missing or unexpected or mismatched):
        return None

    def short(keys):
        return ", ".join(keys[:6]) + (f" (+{len(keys) - 6} more)" if len(keys) > 6 else "") if keys else "none"
    return (f"missing keys: {short(missing)}; unexpected keys: {short(unexpected)}; "
            f"shape mismatches: {short(mismatched)}")


def unloadable_value(obj: Any, where: str = "") -> Optional[str]:
    """Where ``obj`` holds a value that ``torch.load(weights_only=True)`` refuses, and what it is; None if nowhere.

    A file holding one could be written but never read back (a numpy scalar, an
    ``argparse.Namespace``, a named tuple, a ``pathlib.Path``, a function).
    """
    allowed = _loadable_globals()
    if not allowed:
        return None
    stack = [(where, obj)]
    while stack:
        path, value = stack.pop()
        if type(value) in PLAIN_TYPES or isinstance(value, torch.Tensor):  # exact: numpy.float64 is a float too
            continue
        kind = type(value)
        if kind in (dict, list, tuple, set, frozenset) or f"{kind.__module__}.{kind.__qualname__}" in allowed:
            if isinstance(value, dict):
                stack += [(f"{path}[{k!r}]", v) for k, v in value.items()] + [(f"{path} key", k) for k in value]
            elif isinstance(value, (list, tuple, set, frozenset)):
                stack += [(f"{path}[{i}]", v) for i, v in enumerate(value)]
            continue
        return f"{path or 'the object'} holds a {kind.__module__}.{kind.__qualname__} ({first_line(repr(value), 60)})"
    return None


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _WriteErrors:
    """The file torch.save writes to, keeping the OSError of a failed write.

    torch turns a failed write into an opaque RuntimeError ("unexpected pos 704
    vs 598"); the OSError kept here says what happened ("No space left on device").
    """

    def __init__(self, file) -> None:
        self.file, self.error = file, None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.file.flush()


_writes = itertools.count()  # numbers this process's temporary files


def temporary_path(path: str) -> str:
    """``DIR/.<name>.<host>-<pid>-<n>.tmp``: a name no other writer (thread, process, host) uses at the same time."""
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{name}.{socket.gethostname()}-{os.getpid()}-{next(_writes)}.tmp")


def check_targets(paths: Sequence[str], keep_previous: Optional[str] = None) -> None:
    """UserError, before anything is written, when a path to write (or rotate to) is an existing directory."""
    for target in (*paths, keep_previous):
        if target and os.path.isdir(target):
            raise UserError(f"cannot write the checkpoint {paths[0]}: {target} is an existing directory, not a file; "
                            f"nothing was written and the directory is left as it is; give a file path "
                            f"(e.g. {os.path.join(target, 'last.pt')}) or move the directory away")


def atomic_save(obj: Dict[str, Any], path: str, keep_previous: Optional[str] = None) -> None:
    """Write ``obj`` to ``path`` so that a crash at any moment leaves a loadable file there (or none).

    With ``keep_previous``, the file being replaced is first renamed to that path.
    A failed write raises UserError, removes its temporary file and leaves ``path``
    and ``keep_previous`` as they were.
    """
    check_targets([path], keep_previous)
    directory = os.path.dirname(os.path.abspath(path))
    tmp, sink = temporary_path(path), None
    try:
        os.makedirs(directory, exist_ok=True)
        with open(tmp, "wb") as f:
            sink = _WriteErrors(f)
            # torch.load never checks the zip's CRC-32s, and computing them is a third of a save's CPU time.
            with _serialization_config.patch({"save.compute_crc32": False}):
                torch.save(obj, sink)
            f.flush()
            os.fsync(f.fileno())
        if keep_previous:
            _rotate(path, keep_previous)
        os.replace(tmp, path)
    except BaseException as exc:
        _remove(tmp)
        _raise_why_not_written(path, exc, sink.error if sink is not None else None)
        raise  # not the file system, not pickling: a bug, keep its traceback
    fsync_dir(directory)


def atomic_copy(source: str, path: str) -> None:
    """Copy the file ``source`` to ``path`` with :func:`atomic_save`'s guarantees, in the kernel (no re-pickling)."""
    check_targets([path])
    directory = os.path.dirname(os.path.abspath(path))
    tmp = temporary_path(path)
    try:
        shutil.copyfile(source, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        _remove(tmp)
        _raise_why_not_written(path, exc)
        raise
    fsync_dir(directory)


def _rotate(path: str, keep_previous: str) -> None:
    """Rename ``path`` to ``keep_previous``; nothing to do when there is no file (yet, or another writer moved it)."""
    try:
        os.replace(path, keep_previous)
    except FileNotFoundError:
        # Not whether path exists now: another writer may have renamed it and written a new one since.
        if not os.path.isdir(os.path.dirname(os.path.abspath(keep_previous))):
            raise  # keep_previous's folder is missing


def _remove(tmp: str) -> None:
    try:
        os.remove(tmp)
    except OSError:
        pass  # never created


def _raise_why_not_written(path: str, exc: BaseException, write_error: Optional[OSError] = None) -> None:
    """One UserError line for a write that failed because of the file system or an unpicklable value; else return.

    torch turns a failed write into an opaque RuntimeError: ``write_error`` is the OSError behind it.
    """
    directory = os.path.dirname(os.path.abspath(path))
    unchanged = f"the checkpoints already in {directory} are unchanged"
    failed = write_error if isinstance(exc, RuntimeError) and write_error is not None else exc
    if isinstance(failed, OSError):
        if failed.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            fix = f"make {directory} writable or write elsewhere (another --output-dir)"
        elif failed.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            fix = "free space there or pass another --output-dir"
        else:
            fix = f"check {directory} or pass another --output-dir"
        raise UserError(f"cannot write the checkpoint {path}: {failed.strerror or failed}; {unchanged}; {fix}") from exc
    if isinstance(exc, pickle.PicklingError) or (isinstance(exc, (AttributeError, TypeError))
                                                 and "pickle" in str(exc).lower()):
        raise UserError(f"cannot write the checkpoint {path}: a value in it cannot be pickled "
                        f"({first_line(exc, 120)}); {unchanged}; save plain values (tensors, numbers, strings, "
                        f"lists, dicts), not lambdas, local functions, locks or open files") from exc


def read_file(path: str, map_location: Any = "cpu", missing: str = "check the path",
              corrupt: str = "delete it or load another file") -> Any:
    """``torch.load(path, weights_only=True)``; a missing or unreadable file is one UserError line
    ending in ``missing`` or ``corrupt`` (what to do about it)."""
    if not os.path.isfile(path):
        raise UserError(f"checkpoint {path} does not exist; {missing}")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - truncated zip, bad pickle, ... all mean "unreadable"
        if "Weights only load failed" in str(exc):  # readable, but holds a type outside the allow-list
            refused = next((line.strip() for line in str(exc).splitlines() if "GLOBAL" in line or "Unsupported" in line),
                           first_line(exc))
            raise UserError(f"checkpoint {path} is intact but holds a value torch.load(weights_only=True) refuses "
                            f"({refused[:200]}); load it with torch.serialization.add_safe_globals([...]) for that "
                            f"type, or, if you trust the file, torch.load(weights_only=False)") from None
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt or truncated ({type(exc).__name__}: "
                                f"{first_line(exc)}); {corrupt}") from None


def save_all(obj: Dict[str, Any], paths: Sequence[str], keep_previous: Optional[str] = None) -> None:
    """:func:`atomic_save` to the first of ``paths`` (``keep_previous`` applies to it), then copies of that file."""
    atomic_save(obj, paths[0], keep_previous=keep_previous)
    for path in paths[1:]:
        atomic_copy(paths[0], path)


def host_copy(obj: Any) -> Any:
    """``obj`` with every tensor copied to host memory: a snapshot that training can no longer change."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if hasattr(obj, "_fields"):  # a named tuple: built from its fields, not from one iterable
        return type(obj)(*(host_copy(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return obj


class BackgroundWriter:
    """Writes snapshots with :func:`atomic_save` on a thread while training goes on.

    One write is in flight at a time: :meth:`submit` first waits for the previous
    one, so writes land in order and ``keep_previous`` rotates the right file.
    :meth:`wait` (before a read, at the end, on a stop or an error) finishes the
    write in flight and raises its error, if it had one, as the UserError that a
    synchronous write would have raised.
    """

    def __init__(self, name: str = "trainbridge-checkpoint-writer", daemon: bool = False) -> None:
        self.name, self.daemon = name, daemon
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def submit(self, obj: Dict[str, Any], paths: Sequence[str], keep_previous: Optional[str] = None) -> None:
        """Write ``obj`` to each of ``paths`` in the background (``keep_previous`` for the first)."""
        self.wait()
        check_targets(paths, keep_previous)  # a directory in the way: say so at the call, not at the next one
        snapshot = host_copy(obj)  # the only part on the training path
        self.start(lambda: save_all(snapshot, paths, keep_previous))

    def start(self, write: Callable[[], None]) -> None:
        """Run ``write`` on the writer's thread once the previous write is done; its error comes out of :meth:`wait`."""
        self.wait()

        def run() -> None:
            try:
                write()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread by wait()
                self._error = exc

        self._thread = threading.Thread(target=run, name=self.name, daemon=self.daemon)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
