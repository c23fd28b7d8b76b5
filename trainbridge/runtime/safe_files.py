"""Files and folders in places that other local users can write too (``/tmp``, a shared ``--output-dir``).

In such a place a name can be taken before this job uses it. A symbolic link where a file
is about to be written sends the write to any file this user may write (as root: any file);
a folder made in advance by another user lets that user plant files in it, or swap them.
So, everywhere trainbridge writes:

* a new file (every temporary file) is created with ``O_CREAT | O_EXCL | O_NOFOLLOW``: never
  an existing file, never through a link (:func:`create_new`);
* a folder meant for this user alone (the default place of ``hvd.elastic``'s commit file, in
  the shared temporary directory) is made with mode 0700, and then checked: a real directory,
  not a link, owned by this user, closed to group and others (:func:`private_directory`);
* a file that was found rather than made can be checked for its owner before it is trusted
  (:func:`owner_problem`, against the owner this user's new files get there: :func:`new_file_owner`).
"""

from __future__ import annotations

import os
import stat
import tempfile
from typing import BinaryIO, Optional

from ..errors import UserError


def create_new(path: str, mode: int = 0o666) -> BinaryIO:
    """``path`` opened for writing, made now: ``FileExistsError`` if anything (a link too) is there.

    ``mode`` is filtered by the umask, as ``open(path, "wb")`` does.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    return os.fdopen(fd, "wb")


def owner_problem(info: os.stat_result, private: bool = False, owner: Optional[int] = None) -> Optional[str]:
    """Why a file or folder with ``os.lstat`` result ``info`` is not this user's own, in a phrase; None if it is.

    ``private``: also refuse access for group or others (a folder only this user may use).
    ``owner``: the uid this user's files get there (:func:`new_file_owner`); default: this user's.
    """
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if info.st_uid != (os.geteuid() if owner is None else owner):
        return f"belongs to another user (uid {info.st_uid})"
    if private and info.st_mode & 0o077:
        return f"is open to other users (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def new_file_owner(directory: str) -> int:
    """The owner a file made in ``directory`` gets: this user's uid, or the one the file system maps it
    to (root on an NFS export with root_squash gets nobody's). Probed with a file made and removed."""
    fd, probe = tempfile.mkstemp(prefix=".owner-probe-", dir=directory)
    try:
        return os.fstat(fd).st_uid
    finally:
        os.close(fd)
        os.remove(probe)


def private_directory(path: str, what: str, fix: str) -> None:
    """Make the folder ``path`` (mode 0700) unless it exists, then check that it is this user's alone.

    UserError ``"<what> <path> <problem>: ...; <fix>"`` when it is a link, not a folder,
    another user's, or open to others: another user could plant or redirect files there.
    """
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    problem = owner_problem(info, private=True)
    if problem is None and not stat.S_ISDIR(info.st_mode):
        problem = "is not a folder"
    if problem is not None:
        raise UserError(
            f"{what} {path} {problem}: another local user could plant files there or redirect this job's "
            f"writes; nothing was read or written there; {fix}"
        )
