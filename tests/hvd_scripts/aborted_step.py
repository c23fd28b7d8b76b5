"""A step aborted by an exception, then retried at once under the same names (tests/test_hvd_no_hang.py).

Run with 2 or more processes (torchrun or mpirun). Each round, every rank starts the step's gradient
allreduces under the parameters' names (as DistributedOptimizer's hooks name them), raises before
it synchronizes them, and, in the ``except`` block, starts the same names again at once and waits for
them. A rank sleeps a random few milliseconds first, by turns, so that the retry meets the aborted
operations at every stage: not yet negotiated, running, finished. Then a DistributedOptimizer step
is aborted between backward and step(): the next ``zero_grad()`` raises Horovod's AssertionError on
every rank; ``synchronize()`` finishes the aborted step and the next step trains on. Last, a name the
response cache holds is submitted again with another shape on rank 0 only: both ranks get the mismatch
error, and the name then works again.

Lines: ``ABORTED <rank> ok <rounds>`` or ``ABORTED <rank> FAIL <why>``; ``OPTIMIZER <rank> <the error's
first line>``; ``TRAINED <rank> <digest of the weights>``; ``CACHED <rank> <the error's first line>``,
then ``CACHED <rank> ok``.
"""
import hashlib
import random
import sys
import time
import traceback

import torch

import trainbridge.hvd as hvd

ROUNDS = 30


class StepAborted(Exception):
    pass


def retried_rounds(model: torch.nn.Module) -> None:
    rank, size = hvd.rank(), hvd.size()
    names = [name for name, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    jitter = random.Random(rank)
    for round_ in range(ROUNDS):
        if round_ % size == rank:
            time.sleep(jitter.uniform(0, 0.004))
        try:
            for name, shape in zip(names, shapes):
                hvd.allreduce_async_(torch.full(shape, 100.0 * (rank + 1)), name=name)
            raise StepAborted(f"round {round_}")  # e.g. a NaN loss found after backward: the handles are dropped
        except StepAborted:
            retry = [torch.full(shape, float(rank + round_)) for shape in shapes]
            handles = [hvd.allreduce_async_(t, name=name) for name, t in zip(names, retry)]
            for handle in handles:
                hvd.synchronize(handle)
        expected = sum(r + round_ for r in range(size)) / size
        for name, tensor in zip(names, retry):
            assert torch.all(tensor == expected), (round_, name, tensor.flatten()[:3].tolist(), expected)


def aborted_optimizer_step(model: torch.nn.Module) -> None:
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data = torch.full((4, 3), float(hvd.rank() + 1))
    model(data).sum().backward()  # the hooks start the allreduces; then the step is abandoned
    try:
        optimizer.zero_grad()
    except AssertionError as exc:
        sys.stdout.write(f"OPTIMIZER {hvd.rank()} {str(exc).splitlines()[0]}\n")
        sys.stdout.flush()
    optimizer.synchronize()  # finishes the aborted step's allreduces
    optimizer.zero_grad()
    model(data).sum().backward()
    optimizer.step()
    sha = hashlib.sha256()
    for p in model.parameters():
        sha.update(p.detach().numpy().tobytes())
    sys.stdout.write(f"TRAINED {hvd.rank()} {sha.hexdigest()[:16]}\n")
    sys.stdout.flush()


def cached_name_changed_on_one_rank() -> None:
    for _ in range(3):  # agreed on, then decided from the cache
        hvd.allreduce(torch.ones(4), name="cached")
    try:
        hvd.allreduce(torch.ones(5 if hvd.rank() == 0 else 4), name="cached")
    except RuntimeError as exc:
        sys.stdout.write(f"CACHED {hvd.rank()} {str(exc).splitlines()[0]}\n")
    assert hvd.allreduce(torch.ones(4), name="cached", op=hvd.Sum).tolist() == [hvd.size()] * 4
    sys.stdout.write(f"CACHED {hvd.rank()} ok\n")
    sys.stdout.flush()


hvd.init()
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
try:
    retried_rounds(net)
    sys.stdout.write(f"ABORTED {hvd.rank()} ok {ROUNDS}\n")
except Exception as exc:  # noqa: BLE001 - reported as a line for the test
    sys.stdout.write(f"ABORTED {hvd.rank()} FAIL {type(exc).__name__}: {exc} | "
                     f"{traceback.format_exc().splitlines()[-3:]}\n")
sys.stdout.flush()
aborted_optimizer_step(net)
cached_name_changed_on_one_rank()
hvd.shutdown()
