"""A process set's collectives involve only its members: rank 0 sleeps, the others meet without it.

Every rank but 0 is in one process set. Rank 0 sleeps SLEEP_S seconds before its
first operation; meanwhile the set's members time a barrier, an allreduce and a broadcast
on their set, then every rank meets at a global barrier. Lines for the test:

    SET rank=<r> barrier_s=<float> allreduce_s=<float> broadcast_s=<float> sum=<float>
    DONE rank=<r> waited_s=<float>
"""
import os
import sys
import time

import torch

import trainbridge.hvd as hvd

SLEEP_S = float(os.environ.get("SLEEP_S", "5"))

# Horovod: dynamic process sets, added by every rank in the same order.
hvd.init(process_sets="dynamic")
members = list(range(1, hvd.size()))
others = hvd.add_process_set(members)
rank = hvd.rank()
started = time.monotonic()
if rank == 0:
    time.sleep(SLEEP_S)  # busy elsewhere: no collective of the set may wait for this rank
else:
    timings = {}
    for kind, operation in [("barrier", lambda: hvd.barrier(process_set=others)),
                            ("allreduce", lambda: hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum,
                                                                name="set_sum", process_set=others)),
                            ("broadcast", lambda: hvd.broadcast(torch.tensor([float(rank)]), root_rank=members[0],
                                                                name="set_bcast", process_set=others))]:
        begin = time.monotonic()
        result = operation()
        timings[kind] = time.monotonic() - begin
        if kind == "allreduce":
            total = result.item()
    print(f"SET rank={rank} barrier_s={timings['barrier']:.3f} allreduce_s={timings['allreduce']:.3f} "
          f"broadcast_s={timings['broadcast']:.3f} sum={total}", flush=True)
hvd.barrier()
print(f"DONE rank={rank} waited_s={time.monotonic() - started:.3f}", flush=True)
hvd.shutdown()
sys.exit(0)
