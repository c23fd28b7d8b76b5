"""``hvd.elastic`` on torchrun: ``run``, ``TorchState``, ``ObjectState``, ``ElasticSampler``.

Horovod's elastic mode recovers inside the surviving processes. torchrun instead
restarts every worker when one fails (``torchrun --max-restarts N``), so here:

* ``@hvd.elastic.run`` syncs the state from rank 0 before calling the training
  function. After a torchrun restart it first restores the last commit from the
  commit file (see :mod:`.commit_file`) and runs the reset callbacks, so the
  function resumes at the committed epoch and batch.
* A failed peer surfaces as HorovodInternalError; it propagates, the worker
  exits non-zero and torchrun restarts the job from the last commit.
* What survives a restart: exactly what the last ``state.commit()`` saved.
"""
from __future__ import annotations

import functools
from typing import Callable

from ..process import init, rank, shutdown
from . import commit_file
from .sampler import ElasticSampler
from .state import ObjectState, State, TorchState


def run(func: Callable) -> Callable:
    """Decorator for the training function ``func(state, *args, **kwargs)``."""

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        if commit_file.is_restart():
            path = commit_file.commit_path()
            snapshot = commit_file.load(path) if path is not None and rank() == 0 else None
            if snapshot is not None:
                state.load_snapshot(snapshot)
                print(f"hvd.elastic: rank 0 resumed from the last commit in {path}", flush=True)
            state.on_reset()
        state.sync()
        return func(state, *args, **kwargs)

    return wrapper


__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "init", "run", "shutdown"]
