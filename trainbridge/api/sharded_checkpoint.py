"""Checkpoints of sharded models: a folder in which every rank writes its own shards.

``job.save`` of a state that holds a model prepared with ``shard=True`` (or sharded by the
user with ``fully_shard``) writes the folder ``PATH``::

    PATH/.metadata, PATH/__<rank>_0.distcp   the sharded models' and their optimizers' tensors
                                             (torch.distributed.checkpoint: each rank its own shards)
    PATH/state.pt                            the rest of the state and every rank's random streams
                                             (the main rank, as job.save writes any file)

No process ever holds the whole model. The folder is written as ``.<name>.tmp-<random>`` beside
``PATH`` and renamed to ``PATH`` once every rank's shards and ``state.pt`` are on disk, so a
half-written checkpoint is never at ``PATH``; ``keep_previous`` receives the folder (or file) it
replaces. ``job.load(PATH, into=...)`` reads, on each rank, the parts of the saved tensors its
own shards cover: a checkpoint loads at any world size, and into an unsharded model too (one
process, or a job prepared without ``shard``). ``job.export`` and ``trainbridge export`` write
a sharded model as one plain ``state_dict`` file for inference.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import sys
import warnings
from typing import Any, Dict, Iterable, Iterator, Mapping, Optional, Sequence, Tuple

import torch

from ..errors import UserError, first_line
from .files import ELSEWHERE, atomic_save, read_file, state_mismatch

REST = "state.pt"  # the main rank's file inside the folder
METADATA = ".metadata"  # torch.distributed.checkpoint's index, written last by its coordinator
SHARDED = "sharded"  # in state.pt: {key: "model", or "optimizer" / "fresh optimizer"} of the folder's entries

# A sharded entry of the state: the module, and for an optimizer the module whose parameters it steps.
Part = Tuple[torch.nn.Module, Optional[torch.optim.Optimizer]]


def is_sharded_checkpoint(path: str) -> bool:
    """Whether ``path`` is a folder written by a sharded :meth:`Job.save`."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, REST))


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@contextlib.contextmanager
def _one_process_quietly() -> Iterator[None]:
    """torch.distributed.checkpoint warns, on every call without a process group, that it reads or writes in
    one process: what a one-process job (the local backend) means to do."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def save_sharded(
    parts: Mapping[str, Part],
    rest: Dict[str, Any],
    path: str,
    is_main: bool,
    agree: Any,
    barrier: Any,
    keep_previous: Optional[str] = None,
    copies: Sequence[str] = (),
) -> None:
    """Write the folder ``path``: every rank calls it (collective). ``parts``: the sharded entries;
    ``rest``: everything else, written by the main rank. ``agree(value)`` gives every rank the main
    rank's value, ``barrier()`` waits for every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    temporary = agree(_temporary_name(path) if is_main else None)
    tensors: Dict[str, Any] = {}
    kinds: Dict[str, str] = {}
    for key, (model, optimizer) in parts.items():
        if optimizer is None:
            tensors[key], kinds[key] = get_model_state_dict(model), "model"
        elif optimizer.state:
            tensors[key], kinds[key] = get_optimizer_state_dict(model, optimizer), "optimizer"
        else:
            # Not stepped yet: no tensors to shard (and torch's conversion would take a step to make some).
            rest[key], kinds[key] = optimizer.state_dict(), "fresh optimizer"
    rest[SHARDED] = kinds
    try:
        with _one_process_quietly():
            dcp.save(tensors, checkpoint_id=temporary, no_dist=not _distributed())
    except OSError as exc:
        if is_main:
            shutil.rmtree(temporary, ignore_errors=True)
        raise UserError(
            f"cannot write the checkpoint {path}: {exc.strerror or first_line(exc)}; the checkpoints already there "
            f"are unchanged; check {os.path.dirname(os.path.abspath(path))} or {ELSEWHERE}"
        ) from exc
    barrier()  # every rank's shards are on disk (torch.distributed.checkpoint syncs each file)
    if is_main:
        atomic_save(rest, os.path.join(temporary, REST))
        _replace(temporary, path, keep_previous)
        for copy in copies:
            copied = _temporary_name(copy)
            shutil.copytree(path, copied)
            _replace(copied, copy)
    barrier()  # the folder is complete before any rank may read it


def _temporary_name(path: str) -> str:
    folder, name = os.path.split(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f".{name}.tmp-{secrets.token_hex(4)}")


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _replace(temporary: str, path: str, keep_previous: Optional[str] = None) -> None:
    """Rename the finished folder ``temporary`` to ``path``; what was at ``path`` goes to ``keep_previous`` (or away).

    A folder cannot replace another in one rename: between the two renames ``path`` is missing
    for a moment, never half-written (and with ``keep_previous``, the previous one is there)."""
    aside = None
    if os.path.lexists(path):
        if keep_previous:
            _remove(keep_previous)
            os.replace(path, keep_previous)
        else:
            aside = f"{temporary}.old"
            os.replace(path, aside)
    os.replace(temporary, path)
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(directory)  # the renames survive a power loss
    finally:
        os.close(directory)
    if aside:
        _remove(aside)


def read_rest(path: str, map_location: Any) -> Dict[str, Any]:
    """The main rank's ``state.pt`` of the folder ``path`` (read on every rank)."""
    if not os.path.isfile(os.path.join(path, METADATA)):
        raise UserError(
            f"checkpoint {path} is a folder without {METADATA}: not one written by job.save (or copied in part); "
            f"load another checkpoint"
        )
    return read_file(os.path.join(path, REST), map_location)


def load_sharded(path: str, rest: Mapping[str, Any], parts: Mapping[str, Part], is_main: bool) -> None:
    """Load the folder's tensors into ``parts`` (sharded or not, at any world size); collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    kinds = rest.get(SHARDED, {})
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    tensors: Dict[str, Any] = {}
    for key, (model, optimizer) in parts.items():
        if kinds.get(key) not in (("model",) if optimizer is None else ("optimizer", "fresh optimizer")):
            raise UserError(
                f"{path}'s {key!r} is {kinds.get(key, 'not a sharded entry')!r}, not the "
                f"{'model' if optimizer is None else 'optimizer'} it is loaded into; load it into the keys it was "
                f"saved with",
                quiet=not is_main,
            )
        if optimizer is None:
            tensors[key] = get_model_state_dict(model)
            shapes = {
                name[len(key) + 1 :]: torch.empty(tuple(entry.size), device="meta")
                for name, entry in saved.items()
                if name.startswith(f"{key}.") and hasattr(entry, "size")
            }
            mismatch = state_mismatch(model, shapes)
            if mismatch:
                raise UserError(
                    f"{path}'s {key!r} is for another model: {mismatch}; load it into the model it was saved from",
                    quiet=not is_main,
                )
        elif kinds[key] == "optimizer":
            tensors[key] = get_optimizer_state_dict(model, optimizer)
    with _one_process_quietly():
        dcp.load(tensors, checkpoint_id=path, no_dist=not _distributed())
    for key, (model, optimizer) in parts.items():
        if optimizer is None:
            set_model_state_dict(model, tensors[key])
        elif kinds[key] == "optimizer":
            set_optimizer_state_dict(model, optimizer, tensors[key])
        else:
            optimizer.load_state_dict(rest[key])


def export_folder(path: str, output: str, key: str = "model") -> int:
    """Write the ``key`` entry of the sharded checkpoint ``path`` as one plain ``state_dict`` file
    (``torch.load`` it into the unsharded model); one process, no job. Returns the number of tensors."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    rest = read_rest(path, "cpu")
    kinds = rest.get(SHARDED, {})
    if kinds.get(key) != "model":
        models = [k for k, kind in kinds.items() if kind == "model"]
        raise UserError(
            f"{path} holds no sharded model under {key!r}; its models are under {', '.join(map(repr, models))}: "
            f"pass that key"
        )
    loaded: Dict[str, Any] = {}
    _load_state_dict(
        loaded, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(keys={key}), no_dist=True
    )
    state = loaded[key]
    atomic_save(state, output)
    return len(state)


def model_stepped_by(
    parameters: Sequence[torch.nn.Parameter], models: Iterable[torch.nn.Module]
) -> Optional[torch.nn.Module]:
    """The one of ``models`` that holds every one of an optimizer's ``parameters``, or None."""
    stepped = {id(p) for p in parameters}
    return next((m for m in models if stepped <= {id(p) for p in m.parameters()}), None)


def holds_dtensors(value: Any) -> bool:
    """Whether ``value`` (a state, nested) holds a ``DTensor``: a sharded tensor that one file cannot hold whole."""
    tensor_module = sys.modules.get("torch.distributed.tensor")
    if tensor_module is None:
        return False
    if isinstance(value, tensor_module.DTensor):
        return True
    if isinstance(value, Mapping):
        return any(holds_dtensors(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(holds_dtensors(v) for v in value)
    return False
