"""How many Python thread states appear while a loop's collectives run (on gloo's threads, or Horovod's).

gloo's worker thread releases a collective's tensors when it is done, under the GIL (here
tensors that Python drops at once, ``dist.all_reduce(torch.tensor(x))`` as users write it in
an evaluation). A worker thread without a thread state of its own makes one for that, under
the lock that a child forked at that instant inherits held on Python 3.10 < 3.10.15 and
3.11 < 3.11.10.
Thread states are numbered in order of creation, so the numbers of two threads started
before and after the loop say how many were made in between.
"""
import ctypes
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

import trainbridge as tb

ctypes.pythonapi.PyThreadState_Get.restype = ctypes.c_void_p
ctypes.pythonapi.PyThreadState_GetID.argtypes = [ctypes.c_void_p]
ctypes.pythonapi.PyThreadState_GetID.restype = ctypes.c_uint64


def next_thread_state_number() -> int:
    seen = []
    thread = threading.Thread(target=lambda: seen.append(ctypes.pythonapi.PyThreadState_GetID(
        ctypes.pythonapi.PyThreadState_Get())))
    thread.start()
    thread.join()
    return seen[0]


LATE = sys.argv[1].endswith("-late") and "1" in (os.environ.get("RANK"), os.environ.get("HOROVOD_RANK"),
                                                 os.environ.get("OMPI_COMM_WORLD_RANK"))


def made_late(module, name):
    """Rank 1 as a loaded machine makes it: its main thread loses the CPU after each collective that
    ``module.name`` queues, and the collective has finished (the peer was there first) before rank 1 can
    act on it. Returns what puts ``module.name`` back; the collectives themselves are real."""
    queue = getattr(module, name)

    def queue_then_lose_the_cpu(*args, **kwargs):
        queued = queue(*args, **kwargs)
        time.sleep(0.05)
        return queued

    setattr(module, name, queue_then_lose_the_cpu)
    return lambda: setattr(module, name, queue)


if sys.argv[1:] == ["hvd"]:  # trainbridge.hvd, whose engine adds gloo groups of its own
    import trainbridge.hvd as hvd

    hvd.init()
    before = next_thread_state_number()
    for step in range(100):
        hvd.allreduce(torch.tensor([float(step)]), name=f"a{step}")
        hvd.synchronize(hvd.allreduce_async(torch.ones(2), name=f"b{step}"))
    hvd.barrier()
    after = next_thread_state_number()
    rank = hvd.rank()
    hvd.shutdown()
elif sys.argv[1:] in (["job"], ["job-late"]):  # the API on any backend (horovodrun: Horovod's background thread)
    if LATE:  # the collective that reaches Horovod's background thread
        import horovod.torch

        put_back = made_late(horovod.torch, "allreduce_async_")
    job = tb.init()
    if LATE:
        put_back()
    before = next_thread_state_number()
    for step in range(100):
        job.allreduce(torch.tensor([float(step)]), op="sum")  # a check (an object gather), then the allreduce
    job.barrier()
    after = next_thread_state_number()
    rank = job.rank
    job.shutdown()
else:
    if LATE:  # the collectives that reach gloo's worker threads
        put_back = made_late(dist, "all_reduce")
    job = tb.init()
    if LATE:
        put_back()
    before = next_thread_state_number()
    for step in range(100):
        dist.all_reduce(torch.tensor([float(step)]))  # the tensor is Python's only until the call returns
        dist.all_reduce(torch.ones(2), async_op=True)  # not even waited for
    job.barrier()
    after = next_thread_state_number()
    rank = job.rank
    job.shutdown()
print(f"rank {rank}: {after - before - 1} thread states made during {'300' if 'job' in sys.argv[1] else '200'} "
      f"collectives", flush=True)
