"""Files that are never half-written: atomic, durable, one background write at a time.

A write goes to ``DIR/.<name>.<host>-<pid>-<n>-<random>.tmp`` first (made new: never an existing
file, never through a link, :mod:`.safe_files`), is flushed and ``fsync``-ed,
then ``os.replace``-d over the path: a kill during the write leaves the old file intact
(a rename is atomic on POSIX), and the directory is synced so that the rename itself
survives a power loss. The temporary name is this writer's own, so two writers of one
path (two threads, two jobs) never write into or rename each other's file: the last
rename wins, whole. A write that fails removes its temporary file, leaves the path as it
was and raises the error as it is (an ``OSError`` for a full disk, not torch's opaque
``RuntimeError``); the callers word it for their users. Every record of the zip gets its
CRC-32, which :func:`checksum_error` checks when the file is read back.

Used by the public API's checkpoints (:mod:`trainbridge.api.files`, which turns errors into
one line naming the fix) and by ``hvd.elastic``'s commit file.
"""

from __future__ import annotations

import errno
import glob
import itertools
import os
import secrets
import socket
import threading
import zipfile
from typing import Any, Callable, Optional

import torch
from torch.utils.serialization import config as _serialization_config

from .safe_files import create_new


def fsync_dir(directory: str) -> None:
    """Sync ``directory`` itself, so that a rename inside it survives a power loss."""
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
        self.file = file
        self.error: Optional[OSError] = None

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
    """``DIR/.<name>.<host>-<pid>-<n>-<random>.tmp``: a name no other writer (thread, process, host) uses at the
    same time, and that no other user can guess to plant a link there first."""
    directory, name = os.path.split(os.path.abspath(path))
    unique = f"{socket.gethostname()}-{os.getpid()}-{next(_writes)}-{secrets.token_hex(4)}"
    return os.path.join(directory, f".{name}.{unique}.tmp")


def leftover_temporary_files(path: str) -> list:
    """The temporary files of writes of ``path`` that were killed before their rename."""
    directory, name = os.path.split(os.path.abspath(path))
    return glob.glob(os.path.join(glob.escape(directory), f".{glob.escape(name)}.*.tmp"))


def save_atomically(obj: Any, path: str, keep_previous: Optional[str] = None) -> None:
    """``torch.save(obj)`` to ``path`` so that a crash at any moment leaves a loadable file there (or none).

    With ``keep_previous``, the file being replaced is first renamed to that path. A failed
    write removes its temporary file, leaves ``path`` and ``keep_previous`` as they were and
    raises its error (the ``OSError`` behind torch's ``RuntimeError`` when there is one).
    """
    directory = os.path.dirname(os.path.abspath(path))
    tmp, sink = temporary_path(path), None
    try:
        os.makedirs(directory, exist_ok=True)
        with create_new(tmp) as f:  # never an existing file, never through a link
            sink = _WriteErrors(f)
            # Every record gets its zip CRC-32 (torch.load never checks them; checksum_error does), even
            # where a script turned them off: a flipped bit must be found before a resume trains on it.
            # patch() is added at import by torch's install_config_module, which the stubs do not see;
            # torch.save writes to any object with write() and flush(), the stubs say IO[bytes].
            with _serialization_config.patch({"save.compute_crc32": True}):  # type: ignore[attr-defined]
                torch.save(obj, sink)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        if keep_previous:
            _rotate(path, keep_previous)
        os.replace(tmp, path)
    except BaseException as exc:
        _remove(tmp)
        if isinstance(exc, RuntimeError) and sink is not None and sink.error is not None:
            raise sink.error from exc
        raise
    fsync_dir(directory)


def checksum_error(path: str) -> Optional[str]:
    """What in ``path`` fails its zip CRC-32 (a bit flipped on disk or in transit), or None.

    Reads every record of a torch zip file; :mod:`zipfile` compares each with the CRC-32 written
    with it. A file that is not a zip (torch's legacy format) or whose records carry no CRC-32 at
    all (written with ``compute_crc32`` off, as earlier releases of trainbridge did) cannot be
    checked: None. A zip whose structure is broken raises ``zipfile.BadZipFile``; a failed read
    raises its ``OSError``.
    """
    if not zipfile.is_zipfile(path):
        return None
    with zipfile.ZipFile(path) as archive:
        records = archive.infolist()
        if all(record.CRC == 0 for record in records):
            return None
        for record in records:
            try:
                with archive.open(record) as data:
                    while data.read(1 << 20):
                        pass
            except zipfile.BadZipFile as exc:
                if "CRC-32" not in str(exc):  # a broken structure, not a changed byte
                    raise
                return f"its record {record.filename} does not match the CRC-32 written with it"
    return None


def copy_atomically(source: str, path: str) -> None:
    """Copy the file ``source`` to ``path`` with :func:`save_atomically`'s guarantees, in the kernel (no pickling)."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = temporary_path(path)
    try:
        with open(source, "rb") as src, create_new(tmp) as dst:
            _copy_file(src.fileno(), dst.fileno())
            os.fsync(dst.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    fsync_dir(directory)


def _copy_file(src: int, dst: int) -> None:
    """Copy the open file ``src`` to ``dst`` with sendfile (in the kernel), or by reads where it is refused."""
    offset = 0
    try:
        while sent := os.sendfile(dst, src, offset, 1 << 30):
            offset += sent
    except OSError as exc:
        if offset or exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSOCK):
            raise
        os.lseek(src, 0, os.SEEK_SET)
        while chunk := os.read(src, 1 << 20):
            os.write(dst, chunk)  # a full disk raises here, as in torch.save


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


class BackgroundWriter:
    """Runs writes on a thread while training goes on, one at a time, in order.

    :meth:`start` first waits for the previous write, so writes land in the order they
    were started (and a ``keep_previous`` rotation renames the right file). :meth:`wait`
    (before a read, at the end, on a stop or an error) finishes the write in flight and
    raises its error, if it had one, in the caller's thread.
    """

    def __init__(self, name: str = "trainbridge-background-writer", daemon: bool = False) -> None:
        self.name, self.daemon = name, daemon
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

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
        """Finish the write in flight; raise its error, if it had one."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
