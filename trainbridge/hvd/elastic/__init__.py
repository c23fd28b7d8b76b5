"""``hvd.elastic`` on torchrun: ``run``, ``TorchState``, ``ObjectState``, ``ElasticSampler``.

Horovod's elastic mode recovers inside the surviving processes. torchrun instead
restarts every worker when one fails (``torchrun --max-restarts N``), so here:

* ``@hvd.elastic.run`` syncs the state from rank 0 before calling the training
  function. After a torchrun restart it first restores the last commit from the
  commit file (see :mod:`.commit_file`) and runs the reset callbacks, so the
  function resumes at the committed epoch and batch.
* A failed peer surfaces as HorovodInternalError; it propagates, the worker
  exits non-zero and torchrun restarts the job from the last commit.
* What survives a restart: exactly what the last ``state.commit()`` saved, in this
  torchrun invocation only (a first attempt, or a file another job wrote, starts
  from the initial state); when ``run`` returns on every rank the commit file is
  removed (see :mod:`.commit_file`).
"""

from __future__ import annotations

import functools
from typing import Callable

from ..collectives import barrier
from ..process import init, rank, shutdown
from . import commit_file
from .sampler import ElasticSampler
from .state import ObjectState, State, TorchState


def run(func: Callable) -> Callable:
    """Decorator for the training function ``func(state, *args, **kwargs)``."""

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        path = commit_file.commit_path()
        # rank 0 writes and reads the commit file: its path there, None on the other ranks
        own_path = path if path is not None and rank() == 0 else None
        if commit_file.is_restart():
            snapshot = commit_file.load(own_path, commit_file.job_identity()) if own_path is not None else None
            if snapshot is not None:
                state.load_snapshot(snapshot)
                print(f"hvd.elastic: rank 0 resumed from the last commit in {path}", flush=True)
            state.on_reset()
        elif own_path is not None:
            # A first attempt never resumes: a file here was left by an earlier job.
            commit_file.remove(own_path, "left by an earlier job (a first attempt starts from the initial state)")
        state.sync()
        result = func(state, *args, **kwargs)
        if path is not None:
            # Horovod: every rank finished; only then is the last commit of no more use to a restart.
            barrier()
            if own_path is not None and commit_file.is_default_location():
                commit_file.remove(own_path)
        return result

    return wrapper


__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "init", "run", "shutdown"]
