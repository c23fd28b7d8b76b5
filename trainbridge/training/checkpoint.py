"""The checkpoint files of ``trainbridge train``'s output directory: which one to resume from,
and one job per directory.

The writes themselves are the public API's (``job.save``, :mod:`trainbridge.api.files`):
rank 0 writes a temporary file, syncs it to disk and renames it over the old one, so a kill
during the write leaves the old file intact. On top of that, the engine's contract
(the *why* of each rule):

* ``last.pt`` is rotated to ``previous.pt`` before being replaced, so a checkpoint
  that turns out unreadable (a truncated copy, a bad disk) has a fallback.
* ``best.pt`` holds the checkpoint with the best validation accuracy (lower
  validation loss breaks ties).
* Everything is loaded with ``torch.load(..., weights_only=True)``: checkpoints
  hold only tensors, numbers, strings, lists and dicts, never pickled code.
* A corrupt file is never overwritten silently: with ``--resume auto`` it is moved
  aside to ``<name>.corrupt`` (``.corrupt.2``, ... when that name is taken: nothing set
  aside is overwritten) before ``previous.pt`` is tried, and the run says which file it
  resumed from instead. Only bytes that prove a file bad move it: a read that fails for
  a passing reason (too many open files, EIO, ENOMEM, a stale NFS handle) is tried again
  and then stops the run with one line, every file left where it is.
* A write that fails (a full disk, a quota, a file size limit, a read-only place)
  removes its temporary file and stops the run with one line naming the file, the
  reason and the fix; the checkpoints already there are untouched.
* One job per output directory: rank 0 holds a lock on ``DIR/.trainbridge.lock``
  (holder's host and pid inside) for the job's life, taken before anything there is
  read or moved. A second job in the same folder would resume from the first's live
  ``last.pt`` (or, with ``--resume never``, move it aside) and both would write there;
  it stops at once instead. The kernel drops the lock when the process ends, however
  it ends, so a crashed job never blocks the next.
* The output directory is this user's alone: one of another user, or one every user
  can write (``/tmp/runs``), is refused before anything there is read, the lock file is
  never opened through a link, and ``--resume auto`` never resumes from a ``last.pt``
  another user wrote (``weights_only`` stops planted code, not planted weights).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import os
import socket
import stat
from typing import IO, TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

import torch

from ..api.files import CorruptCheckpoint, read_file, state_mismatch
from ..errors import UserError
from ..runtime.safe_files import new_file_owner, owner_problem
from .state import FORMAT, Progress

if TYPE_CHECKING:
    from ..api import Job

LAST, PREVIOUS, BEST = "last.pt", "previous.pt", "best.pt"
LOCK = ".trainbridge.lock"
_held: Dict[str, IO[str]] = {}  # output directory -> its lock file, open until this process ends
_owners: Dict[str, int] = {}  # output directory -> the uid this user's files get there


def lock_output_dir(output_dir: str, note: Callable[[str], None]) -> None:
    """Hold ``DIR/.trainbridge.lock`` until this process ends, or raise UserError naming the job that holds it.

    A POSIX record lock (``fcntl.lockf``), taken without waiting: the kernel releases it
    when the process ends, however it ends, and, unlike ``flock``, forked children
    (DataLoader workers still winding down) never keep a dead job's lock. The price of
    POSIX locks: closing any descriptor of the lock file in this process drops the lock,
    so nothing else here may open it.
    """
    directory = os.path.abspath(output_dir)
    if directory in _held:
        return
    path = os.path.join(directory, LOCK)
    try:
        os.makedirs(directory, exist_ok=True)
        owner = new_file_owner(directory)  # this user's uid there (an NFS root_squash maps root's)
    except OSError as exc:
        raise UserError(
            f"--output-dir {output_dir} is not writable ({exc.strerror or exc}); pass a folder you can write to"
        ) from exc
    problem = shared_folder_problem(directory, owner)
    if problem is not None:
        raise UserError(
            f"--output-dir {output_dir} {problem}: another local user could plant a last.pt there for this job "
            f"to resume from, or redirect its writes; pass a folder of your own (e.g. "
            f"{os.path.join(output_dir, 'runs')}, made by this job)"
        )
    try:
        # Never through a link, and not emptied before it is held: a second job reads the holder in it.
        lock = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644), "r+")
    except OSError as exc:
        why = "it is a symbolic link" if exc.errno == errno.ELOOP else (exc.strerror or str(exc))
        raise UserError(
            f"--output-dir {output_dir}: cannot open its lock file {path} ({why}); remove it, or pass another "
            f"--output-dir"
        ) from exc
    info = os.fstat(lock.fileno())
    problem = owner_problem(info, owner=owner) or (None if stat.S_ISREG(info.st_mode) else "is not a regular file")
    if problem is not None:
        lock.close()
        raise UserError(
            f"--output-dir {output_dir}: its lock file {path} {problem}; remove it, or pass another --output-dir"
        )
    _owners[directory] = owner
    try:
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        lock.seek(0)
        holder = lock.read().strip()
        lock.close()
        if exc.errno not in (errno.EACCES, errno.EAGAIN):  # a file system without locks (some NFS setups)
            note(
                f"[trainbridge] cannot lock {path} ({exc.strerror or exc}): nothing keeps a second job out of "
                f"{output_dir} while this one runs"
            )
            return
        raise UserError(
            f"--output-dir {output_dir} is in use by another job ({holder or 'holder unknown'}): "
            f"this one would resume from its live checkpoints and write over them; wait for it to "
            f"finish, or pass another --output-dir"
        ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"host {socket.gethostname()}, pid {os.getpid()}\n")
    lock.flush()
    _held[directory] = lock


def shared_folder_problem(directory: str, owner: int) -> Optional[str]:
    """Why another local user could plant or redirect files in ``directory``, in a phrase; None when no one can.

    ``owner``: the uid this user's files get there. A link to the folder counts as the link's
    owner's choice: another user's link is refused too.
    """
    link = os.lstat(directory)
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (owner, 0):
        return f"is a symbolic link of another user (uid {link.st_uid})"
    info = os.stat(directory)
    if info.st_uid != owner:
        return f"belongs to another user (uid {info.st_uid})"
    if info.st_mode & stat.S_IWOTH:
        return f"can be written by every user (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def planted_problem(path: str) -> Optional[str]:
    """Why the checkpoint ``path`` found in an output folder may not be this job's user's, in a phrase; or None."""
    directory = os.path.dirname(os.path.abspath(path))
    return owner_problem(os.lstat(path), owner=_owners.get(directory))


def claim_output_dir(output_dir: str, job: "Job") -> None:
    """One job per output directory: rank 0 takes the lock, every rank learns the outcome and stops alike."""

    def claim() -> Optional[str]:
        if not job.is_main:  # Horovod elastic runs the decision on every rank
            return None
        try:
            lock_output_dir(output_dir, note=job.print)
            return None
        except UserError as exc:
            return str(exc)

    error = job.decide_on_main(claim)  # a broadcast: no rank goes on to read or write the folder alone
    if error is not None:
        raise UserError(error, quiet=not job.is_main)


def read_checkpoint(path: str, map_location: Any = "cpu") -> Dict[str, Any]:
    """Load a trainbridge checkpoint; UserError naming the file when it is missing or unreadable."""
    checkpoint = read_file(
        path,
        map_location,
        missing="check the path, or use --resume auto/never",
        corrupt="delete it or pass --resume with another file",
    )
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != FORMAT:
        raise UserError(
            f"checkpoint {path} is not a trainbridge checkpoint (no format tag {FORMAT!r}); "
            f"for weights only, load it with torch.load and --resume never"
        )
    problems = layout_problems(checkpoint)
    if problems:
        raise UserError(
            f"checkpoint {path} has the format tag {FORMAT!r} but not its layout ({'; '.join(problems)}): "
            f"written by another version of trainbridge, or changed by hand; resume with the release that "
            f"wrote it, or use --resume never to start over"
        )
    return checkpoint


# What the loop reads from a checkpoint, and the type of each.
LAYOUT = {"model": dict, "optimizer": dict, "scheduler": dict, "progress": dict, "config": dict, "world_size": int}
COUNTERS = ("epoch", "position", "step", "samples")  # the progress counters the loop counts with


def layout_problems(checkpoint: Dict[str, Any]) -> list:
    """What in ``checkpoint`` differs from the layout this release writes (a missing key, a wrong type,
    progress counters of another version), in phrases; empty when it fits."""
    missing = [key for key in LAYOUT if key not in checkpoint]
    problems = [f"missing {', '.join(missing)}"] if missing else []
    problems += [
        f"{key} is a {type(checkpoint[key]).__name__}, not a {kind.__name__}"
        for key, kind in LAYOUT.items()
        if key in checkpoint and not isinstance(checkpoint[key], kind)
    ]
    progress = checkpoint.get("progress")
    if isinstance(progress, dict):
        fields = {field.name: field for field in dataclasses.fields(Progress)}
        absent = [name for name in fields if name not in progress]
        unknown = [str(name) for name in progress if name not in fields]
        not_whole = [name for name in COUNTERS if name in progress and type(progress[name]) is not int]
        if absent:
            problems.append(f"progress counters missing: {', '.join(absent)}")
        if unknown:
            problems.append(f"unknown progress counters: {', '.join(unknown)}")
        if not_whole:
            problems.append(f"progress counters not whole numbers: {', '.join(not_whole)}")
    return problems


def choose_resume(resume: str, output_dir: str, note: Callable[[str], None]) -> Tuple[Optional[str], Optional[dict]]:
    """Which checkpoint to resume from (rank 0 decides): ``(path, checkpoint)`` or ``(None, None)``.

    ``resume`` is "auto" (last.pt, else previous.pt, else a fresh start),
    "never", or a path that must exist and load.
    """
    if resume == "never":
        return None, None
    if resume != "auto":
        return resume, read_checkpoint(resume)
    candidates = [os.path.join(output_dir, name) for name in (LAST, PREVIOUS)]
    set_aside: Dict[str, str] = {}  # each bad file's line, said once the outcome is known
    for path in candidates:
        if not os.path.exists(path):
            continue
        planted = planted_problem(path)
        if planted is not None:
            raise UserError(
                f"checkpoint {path} {planted}: this job's user did not write it, and resuming would train on "
                f"whatever weights it holds; nothing was moved; move it away, or pass --resume {path} if you trust it"
            )
        try:
            checkpoint = read_checkpoint(path)
        except CorruptCheckpoint as exc:  # only bytes proven bad; a readable file, or a failed read, is never moved
            set_aside[path] = f"{exc}; moved it to {move_aside(path)}"
            continue
        for line in set_aside.values():
            note(f"[trainbridge] {line}; resuming from {path} instead")
        return path, checkpoint
    if set_aside:
        for line in set_aside.values():
            note(f"[trainbridge] {line}")
        raise UserError(
            f"no loadable checkpoint in {output_dir}: {', '.join(set_aside)} "
            f"corrupt (moved aside as *.corrupt); use --resume never to start over"
        )
    return None, None


def move_aside(path: str) -> str:
    """Rename a corrupt ``path`` to ``<path>.corrupt`` (``.corrupt.2``, ... when taken: nothing set aside is
    overwritten); the new name."""
    aside, number = path + ".corrupt", 1
    while os.path.lexists(aside):  # the output directory is this job's alone (its lock): no race
        number += 1
        aside = f"{path}.corrupt.{number}"
    try:
        os.replace(path, aside)
    except FileNotFoundError:  # another process moved it first
        pass
    return aside


def load_model_state(model: torch.nn.Module, state: Dict[str, torch.Tensor], path: str) -> None:
    """load_state_dict with a one-line error naming missing and unexpected keys."""
    mismatch = state_mismatch(model, state)
    if mismatch:
        raise UserError(
            f"checkpoint {path} is for another model: {mismatch}; use the --model it was trained with, "
            f"or --resume never"
        )
    model.load_state_dict(state)


# What a run writes in --output-dir (fault-injection markers stay: they belong to the run being restarted).
RUN_FILES = (LAST, PREVIOUS, BEST, "final.pt", "metrics.jsonl")
RUN_FILE_PATTERNS = ("report_*.json", "confusion_*.png", "*.pt.corrupt", "*.pt.corrupt.*")


def set_aside_previous_run(output_dir: str, note: Callable[[str], None]) -> Optional[str]:
    """Move an earlier run's files to ``DIR/previous-run-<time>/`` before a fresh start writes over them.

    A fresh start (``--resume never``, or a checkpoint from elsewhere) must never
    destroy the only good model. Returns the folder, or None when there was nothing.
    """
    import glob
    import time

    found = [os.path.join(output_dir, name) for name in RUN_FILES if os.path.exists(os.path.join(output_dir, name))]
    for pattern in RUN_FILE_PATTERNS:
        found += sorted(glob.glob(os.path.join(output_dir, pattern)))
    if not found:
        return None
    base = aside = os.path.join(output_dir, "previous-run-" + time.strftime("%Y%m%d-%H%M%S"))
    number = 1
    while os.path.exists(aside):  # two fresh starts within a second
        number += 1
        aside = f"{base}.{number}"
    os.makedirs(aside)
    for path in found:
        os.replace(path, os.path.join(aside, os.path.basename(path)))
    note(f"[trainbridge] starting afresh: the earlier run's files in {output_dir} were moved to {aside}")
    return aside
