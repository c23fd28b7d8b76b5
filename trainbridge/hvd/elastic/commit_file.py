"""Where committed elastic state survives a torchrun restart.

torchrun (``--max-restarts N``) restarts *every* worker when one fails, so the
in-memory commit of Horovod's elastic mode is lost with the processes. Under
torchrun, rank 0 therefore also writes each commit to

    $TRAINBRIDGE_ELASTIC_DIR/state.pt     (default: <tmp>/trainbridge-elastic-<TORCHELASTIC_RUN_ID>/)

atomically and durably (write, fsync, rename, fsync the directory). On a restart
(TORCHELASTIC_RESTART_COUNT > 0) rank 0 loads it and ``state.sync()`` broadcasts
it to the other ranks, which may run on other nodes. Outside torchrun nothing is
written.

The file is read with ``torch.load(..., weights_only=True)``, like every other
checkpoint of trainbridge, so it may hold only what that loader accepts: tensors,
numbers, strings, None, and dicts, lists and tuples of them (model, optimizer
and sampler state_dicts all are). ``save`` checks this first and names the value
that is not, instead of writing a file the restart could not read.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any, Mapping, Optional

import torch

from ...api.files import fsync_dir


def commit_path(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The commit file of this torchrun job, or None outside torchrun."""
    environ = os.environ if environ is None else environ
    directory = environ.get("TRAINBRIDGE_ELASTIC_DIR")
    if directory is None:
        run_id = environ.get("TORCHELASTIC_RUN_ID")
        if run_id is None:
            return None
        directory = os.path.join(tempfile.gettempdir(), f"trainbridge-elastic-{run_id}")
    return os.path.join(directory, "state.pt")


def is_restart(environ: Optional[Mapping[str, str]] = None) -> bool:
    environ = os.environ if environ is None else environ
    return int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


PLAIN = (torch.Tensor, int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def check_plain(value: Any, where: str = "state") -> None:
    """Raise TypeError naming the first value ``torch.load(weights_only=True)`` would refuse."""
    if isinstance(value, dict):
        for key, item in value.items():
            check_plain(key, f"{where} key {key!r}")
            check_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
    elif not isinstance(value, PLAIN):
        raise TypeError(f"hvd.elastic: {where} is a {type(value).__name__}; the commit file holds only tensors, "
                        f"numbers, strings, None and dicts/lists/tuples of them (it is loaded with "
                        f"weights_only=True): store a state_dict or plain values instead")


def save(snapshot: Any, path: str) -> None:
    """Write ``snapshot`` to ``path`` so that a crash or power loss at any moment leaves the previous
    commit or this one there, never a torn file.

    The same steps as trainbridge's checkpoint writer (``trainbridge.api.files.atomic_save``),
    written out here because ``hvd`` does not depend on the training layers: a temporary file in
    the same directory, flushed and fsynced, renamed over ``path`` (atomic on POSIX), then the
    directory fsynced so that the rename itself is on disk.
    """
    check_plain(snapshot)
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "wb") as f:
            torch.save(snapshot, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(partial)
        raise
    os.replace(partial, path)  # a crash mid-write leaves the previous commit intact
    fsync_dir(directory)  # the rename itself survives a power loss


def load(path: str) -> Optional[Any]:
    if not os.path.exists(path):
        return None
    return torch.load(path, map_location="cpu", weights_only=True)
