"""Give Horovod's background thread a Python thread state it keeps, so that forking a DataLoader worker cannot deadlock.

Why: the same as for gloo's threads (:mod:`trainbridge.runtime.gloo_threads`): Horovod's
background thread releases each collective's tensors, under the GIL, and on Python 3.10 <
3.10.15 and 3.11 < 3.11.10 the thread state it makes for that each time can leave a forked
child waiting for good. Horovod runs no Python on that thread, except what the release of a
tensor's last reference runs: a weakref callback of that tensor. So one collective whose
tensor only Horovod still holds makes its background thread call ``PyGILState_Ensure``,
without a release, and keep its thread state.

The collective must still be running when the rank lets go of its tensor, or the main thread
drops the last reference and runs the callback itself; a rank whose main thread loses the CPU
there for a cycle (5 ms) misses every round (302 thread states made afterwards, with 50 ms).
So, as for gloo, the ranks take turns at coming last: in each round one rank queues its
collective only after every other rank has let go of its own (an allreduce of their own,
which completes first), so theirs cannot finish before.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from ..runtime.gloo_threads import AFFECTED, MAX_ROUNDS, keep_this_thread_state


def keep_background_thread_state(hvd: Any) -> None:
    """Collective (every rank of Horovod's global set): on an affected Python, Horovod's background
    thread gets a Python thread state it keeps."""
    if not AFFECTED:
        return
    from horovod.torch import mpi_ops

    main = threading.get_ident()
    kept = threading.Event()

    def keep() -> None:
        if threading.get_ident() != main and not kept.is_set():
            keep_this_thread_state()
            kept.set()

    for attempt in range(MAX_ROUNDS):
        last = attempt % hvd.size()  # the rank that queues its collective after the others have let go
        turn = f"trainbridge.thread_state.turn.{attempt}"
        if hvd.rank() == last:
            hvd.allreduce(torch.zeros(1), name=turn)
        tensor = torch.zeros(1)
        weakref.finalize(tensor, keep)
        handle = hvd.allreduce_async_(tensor, name=f"trainbridge.thread_state.{attempt}", op=hvd.Sum)
        mpi_ops._handle_map[handle] = (None, None)  # Horovod's own map let go: its thread has the last reference
        del tensor
        if hvd.rank() != last:
            hvd.allreduce(torch.zeros(1), name=turn)
        hvd.synchronize(handle)
        # Every rank goes on until every rank's thread keeps its state: the same rounds everywhere.
        missing = hvd.allreduce(torch.tensor([0 if kept.is_set() else 1]), op=hvd.Max, name="trainbridge.thread_state")
        if missing.item() == 0:
            return
