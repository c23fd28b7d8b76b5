"""Give gloo's worker threads a Python thread state they keep, so that forking a DataLoader worker cannot deadlock.

Why: a gloo process group runs each collective on one of its worker threads (2 by
default), and that thread drops its references to the collective's tensors when it is
done. For a tensor Python knows, torch then gives back the reference its C++ side held to
the tensor's Python object, under the GIL (even while Python still holds the tensor), and
a thread without a Python thread state makes one for that, taking the interpreter's lock
on its thread list (``HEAD_LOCK``) while it does so. Python 3.10 before 3.10.15 and 3.11
before 3.11.10 take that lock again in a forked child before they reset it
(CPython gh-112275): a DataLoader worker forked in that instant waits for it forever,
inside ``os.fork``. It was seen in CI, one evaluation loader in some hundreds.

The fix for those Pythons: each worker thread makes its thread state once, here, and keeps
it (``PyGILState_Ensure`` without a release), so it never takes that lock again. Each
thread is reached through a callback on a collective's future, which gloo runs on the
worker thread that completed it, but only if the callback was there before the collective
finished: one that finished first runs it at once on the main thread. The rank that queues
its collectives last finds them finished (its peers were waiting), and on a loaded machine
the same rank kept coming last (CI: 72 thread states made afterwards on one rank, none on
the other). So the ranks take turns at coming last, through the group's store: in each round
the others attach their callbacks before the last one queues anything.

At exit, the same release is why no gloo group may still be alive at the interpreter's
teardown: once that has started, Python makes a thread that asks for the GIL exit, and for
a gloo worker (a C++ thread) that aborts the process ("terminate called without an active
exception", SIGABRT instead of the exit status). A rank that failed therefore leaves without
the teardown (``api/process_end.py``), ``trainbridge.hvd`` frees its groups in its exit
handler, and ``join_process_group`` keeps torch from holding the default group for good.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any, Set

# CPython gh-112275: fixed in 3.10.15, 3.11.10 and every 3.12.
AFFECTED = (3, 10) <= sys.version_info[:3] < (3, 10, 15) or (3, 11) <= sys.version_info[:3] < (3, 11, 10)
MAX_ROUNDS = 50


def keep_this_thread_state() -> None:
    """Called on a thread that runs no Python of its own: it makes its Python thread state now and never
    gives it up (``PyGILState_Ensure`` without a release), so later GIL acquisitions there reuse it."""
    ctypes.pythonapi.PyGILState_Ensure()


def keep_thread_states(group: Any = None) -> None:
    """Collective over ``group`` (a gloo process group; None: the default one): on an affected Python,
    every worker thread of this rank's gloo backend gets a Python thread state it keeps."""
    import torch
    import torch.distributed as dist

    if not AFFECTED:
        return
    process_group: Any = group if group is not None else dist.group.WORLD
    threads = process_group._get_backend(torch.device("cpu")).options._threads
    store = dist.distributed_c10d._get_process_group_store(process_group)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    kept: Set[int] = set()
    main = threading.get_ident()

    def keep(future: Any) -> Any:
        ident = threading.get_ident()
        if ident != main and ident not in kept:
            keep_this_thread_state()
            kept.add(ident)
        return future.value()

    for attempt in range(MAX_ROUNDS):
        last = attempt % size  # the rank that queues its collectives after every other rank's callbacks
        attached = {r: f"trainbridge/thread_states/{attempt}/{r}" for r in range(size) if r != last}
        if rank == last:
            store.wait(list(attached.values()))
            for key in attached.values():
                store.delete_key(key)  # a later group on the same store starts clean
        # As many collectives at once as there are worker threads: on the other ranks each holds its thread
        # until the last rank queues its own, so every thread takes one.
        works = [dist.all_reduce(torch.zeros(1), group=group, async_op=True) for _ in range(threads)]
        futures = [work.get_future().then(keep) for work in works]
        if rank != last:
            store.set(attached[rank], "attached")
        for future in futures:
            future.wait()
        # Every rank goes on until every rank has reached all of its threads: the same rounds everywhere.
        missing = torch.tensor([threads - len(kept)], dtype=torch.int32)
        dist.all_reduce(missing, op=dist.ReduceOp.MAX, group=group)
        if missing.item() <= 0:
            return
