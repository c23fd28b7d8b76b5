"""Files written by the main rank: atomic, durable, never half-written.

Only rank 0 writes, to ``DIR/.<name>.tmp`` first, then ``fsync`` and ``os.replace``:
a kill during the write leaves the old file intact (a rename is atomic on POSIX),
and the directory is synced so that the rename itself survives a power loss.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch

from ..errors import UserError


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


def atomic_save(obj: Dict[str, Any], path: str, keep_previous: Optional[str] = None) -> None:
    """Write ``obj`` to ``path`` so that a crash at any moment leaves a loadable file there (or none).

    With ``keep_previous``, the file being replaced is first renamed to that path.
    A failed write raises UserError and leaves ``path`` and ``keep_previous`` as they were.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp")
    with open(tmp, "wb") as f:
        sink = _WriteErrors(f)
        try:
            torch.save(obj, sink)
            f.flush()
            os.fsync(f.fileno())
        except (OSError, RuntimeError) as exc:
            failed = sink.error or (exc if isinstance(exc, OSError) else None)
            if failed is None:
                raise  # not the file system: a bug, keep its traceback
            f.close()
            os.remove(tmp)
            raise UserError(f"cannot write the checkpoint {path}: {failed.strerror or failed}; the checkpoints "
                            f"already in {directory} are unchanged; free space there or pass another --output-dir"
                            ) from None
    if keep_previous and os.path.exists(path):
        os.replace(path, keep_previous)
    os.replace(tmp, path)
    fsync_dir(directory)
