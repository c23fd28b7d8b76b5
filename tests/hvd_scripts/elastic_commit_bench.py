"""Time ``state.commit()`` of a ResNet-50 with SGD-momentum state: trainbridge.hvd under torchrun (commit
file written by rank 0) against the real Horovod's in-memory commit, in the same process.

Run: torchrun --standalone --nproc-per-node=1 tests/hvd_scripts/elastic_commit_bench.py [commits] [pause_s]
Between commits the process sleeps pause_s (default 2 s: training between commits). Prints one line
per implementation: the median, min and max seconds that commit() took to return, and for
trainbridge the time to finish the last write too.
"""
import os
import shutil
import statistics
import sys
import time

import torch
import torchvision

COMMITS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
PAUSE_S = float(sys.argv[2]) if len(sys.argv) > 2 else 2.0


def model_and_optimizer():
    torch.manual_seed(0)
    model = torchvision.models.resnet50()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 64, 64)).sum().backward()
    optimizer.step()  # momentum buffers exist: ~205 MB of state in all
    return model, optimizer


def timed_commits(state):
    seconds = []
    for _ in range(COMMITS):
        begin = time.perf_counter()
        state.commit()
        seconds.append(time.perf_counter() - begin)
        time.sleep(PAUSE_S)
    return seconds


def report(name, seconds, extra=""):
    print(f"BENCH {name}: commit() median {statistics.median(seconds):.3f} s, min {min(seconds):.3f}, "
          f"max {max(seconds):.3f} ({COMMITS} commits){extra}", flush=True)


import horovod.torch as horovod  # noqa: E402

horovod.init()
model, optimizer = model_and_optimizer()
report("horovod.torch (in memory)", timed_commits(horovod.elastic.TorchState(model, optimizer, epoch=0)))
horovod.shutdown()

import trainbridge.hvd as hvd  # noqa: E402
from trainbridge.hvd.elastic import commit_file  # noqa: E402

hvd.init()
assert not hvd.using_real_horovod and commit_file.commit_path() is not None
state = hvd.elastic.TorchState(model, optimizer, epoch=0)
seconds = timed_commits(state)
begin = time.perf_counter()
getattr(commit_file, "writer", None) and commit_file.writer.wait()
report("trainbridge.hvd (commit file)", seconds, f"; last write finished {time.perf_counter() - begin:.3f} s later")
# The commit file is removed when hvd.elastic.run returns; this bench commits outside it, so it removes
# the file's folder itself (each run would leave ~200 MB in the temporary folder).
shutil.rmtree(os.path.dirname(commit_file.commit_path()), ignore_errors=True)
hvd.shutdown()
