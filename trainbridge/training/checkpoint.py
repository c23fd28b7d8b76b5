"""Checkpoint files: atomic writes, a kept previous copy, and safe loading.

Contract (the *why* of each rule):

* Only rank 0 writes, to ``DIR/.<name>.tmp`` first, then ``fsync`` and ``os.replace``:
  a kill during the write leaves the old file intact (a rename is atomic on POSIX).
* ``last.pt`` is rotated to ``previous.pt`` before being replaced, so a checkpoint
  that turns out unreadable (a truncated copy, a bad disk) has a fallback.
* ``best.pt`` holds the checkpoint with the best validation accuracy (lower
  validation loss breaks ties).
* Everything is loaded with ``torch.load(..., weights_only=True)``: checkpoints
  hold only tensors, numbers, strings, lists and dicts, never pickled code.
* A corrupt file is never overwritten silently: with ``--resume auto`` it is moved
  aside to ``<name>.corrupt`` (and the run says so) before ``previous.pt`` is tried.
* A write that fails (a full disk, a quota, a file size limit) removes its
  temporary file and stops the run with one line naming the file, the reason and
  the fix; the checkpoints already there are untouched.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional, Tuple

import torch


from ..api.files import CorruptCheckpoint, read_file, state_mismatch
from ..errors import UserError

LAST, PREVIOUS, BEST = "last.pt", "previous.pt", "best.pt"
FORMAT = "trainbridge-checkpoint-1"


def read_checkpoint(path: str, map_location: Any = "cpu") -> Dict[str, Any]:
    """Load a trainbridge checkpoint; UserError naming the file when it is missing or unreadable."""
    checkpoint = read_file(path, map_location, missing="check the path, or use --resume auto/never",
                           corrupt="delete it or pass --resume with another file")
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != FORMAT:
        raise UserError(f"checkpoint {path} is not a trainbridge checkpoint (no format tag {FORMAT!r}); "
                        f"for weights only, load it with torch.load and --resume never")
    return checkpoint


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
    found_corrupt = []
    for path in candidates:
        if not os.path.exists(path):
            continue
        try:
            return path, read_checkpoint(path)
        except CorruptCheckpoint as exc:  # only an unreadable file; a readable one is never moved
            aside = path + ".corrupt"
            try:
                os.replace(path, aside)
            except FileNotFoundError:  # another process moved it first
                pass
            found_corrupt.append(path)
            note(f"[trainbridge] {exc}; moved it to {aside}; trying the previous checkpoint")
    if found_corrupt:
        raise UserError(f"no loadable checkpoint in {output_dir}: {', '.join(found_corrupt)} corrupt (moved aside "
                        f"as *.corrupt); use --resume never to start over")
    return None, None


def load_model_state(model: torch.nn.Module, state: Dict[str, torch.Tensor], path: str) -> None:
    """load_state_dict with a one-line error naming missing and unexpected keys."""
    mismatch = state_mismatch(model, state)
    if mismatch:
        raise UserError(f"checkpoint {path} is for another model: {mismatch}; use the --model it was trained with, "
                        f"or --resume never")
    model.load_state_dict(state)


# What a run writes in --output-dir (fault-injection markers stay: they belong to the run being restarted).
RUN_FILES = (LAST, PREVIOUS, BEST, "final.pt", "metrics.jsonl")
RUN_FILE_PATTERNS = ("report_*.json", "confusion_*.png", "*.pt.corrupt")


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
