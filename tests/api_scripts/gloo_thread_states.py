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
    rank_1 = os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK")) == "1"
    late = sys.argv[1:] == ["job-late"] and rank_1
    if late:  # as tb-late, below, for the collective that reaches Horovod's background thread
        import horovod.torch

        queue_async = horovod.torch.allreduce_async_

        def allreduce_async_then_lose_the_cpu(*args, **kwargs):
            handle = queue_async(*args, **kwargs)
            time.sleep(0.05)
            return handle

        horovod.torch.allreduce_async_ = allreduce_async_then_lose_the_cpu
    job = tb.init()
    if late:
        horovod.torch.allreduce_async_ = queue_async
    before = next_thread_state_number()
    for step in range(100):
        job.allreduce(torch.tensor([float(step)]), op="sum")  # a check (an object gather), then the allreduce
    job.barrier()
    after = next_thread_state_number()
    rank = job.rank
    job.shutdown()
else:
    late = sys.argv[1:] == ["tb-late"] and os.environ["RANK"] == "1"
    if late:
        # Rank 1 as a loaded machine makes it: its main thread loses the CPU after each collective is queued,
        # and the collective has finished (the peer was there first) before rank 1 can act on it.
        queue = dist.all_reduce

        def all_reduce_then_lose_the_cpu(*args, **kwargs):
            work = queue(*args, **kwargs)
            if kwargs.get("async_op"):
                time.sleep(0.05)
            return work

        dist.all_reduce = all_reduce_then_lose_the_cpu
    job = tb.init()
    if late:
        dist.all_reduce = queue
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
