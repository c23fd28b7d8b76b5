"""An hvd.elastic job whose state holds Horovod users' everyday values, for the commit-file tests.

Each epoch adds 1 to a weight (an allreduce, so no rank runs ahead of the others) and
commits. With ``--typed-values`` the state also holds a numpy mean, a named tuple, a
defaultdict and an IntEnum, which a restart must give back equal and of the same type. With ``--fail-at-epoch E``,
rank 1 of the first attempt exits with status 3 when E epochs are done, before the next
allreduce; ``--foreign-commit`` makes rank 0 first put a commit file there as another job
with the same run id would. Lines for the test:

    START attempt=<n> rank=<r> epoch=<e> weight=<w> values=<repr of the typed values>
    COMMIT attempt=<n> epoch=<e>         rank 0
    DONE rank=<r> epoch=<e> weight=<w>
"""
import argparse
import collections
import enum
import os
import sys

import numpy as np
import torch

import trainbridge.hvd as hvd
from trainbridge.hvd.elastic import commit_file

Best = collections.namedtuple("Best", "epoch loss")


class Phase(enum.IntEnum):
    WARMUP = 0
    TRAIN = 1


parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--fail-at-epoch", type=int, default=-1)
parser.add_argument("--foreign-commit", action="store_true")
parser.add_argument("--typed-values", action="store_true")
args = parser.parse_args()
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

hvd.init()
model = torch.nn.Linear(1, 1, bias=False)
torch.nn.init.zeros_(model.weight)


def typed(state):
    if not args.typed_values:
        return "none"
    return (f"{state.mean_loss!r}/{type(state.mean_loss).__name__} {state.best!r} "
            f"{dict(state.seen)!r}/{type(state.seen).__name__}:{state.seen.default_factory.__name__} {state.phase!r}")


@hvd.elastic.run
def train(state):
    # One write per line: both ranks print this at once, and print() writes the text and its newline apart.
    sys.stdout.write(f"START attempt={ATTEMPT} rank={hvd.rank()} epoch={state.epoch} "
                     f"weight={state.model.weight.item():g} values={typed(state)}\n")
    sys.stdout.flush()
    if args.foreign_commit and ATTEMPT == 0 and hvd.rank() == 0:
        # Another job with the same run id and commit file, writing while this one runs.
        foreign = {"handlers": {"model": {"weight": torch.full((1, 1), 42.0)}}, "objects": {"epoch": 42}}
        commit_file.save(foreign, commit_file.commit_path(), job="none@another-torchrun")
    if args.foreign_commit and ATTEMPT == 0:
        # Rank 1 fails only once the foreign file is there: failing first, it had torchrun stop rank 0
        # before the write, and the restart found no file to ignore (CI, once).
        hvd.barrier()
    while state.epoch < args.epochs:
        if ATTEMPT == 0 and hvd.rank() == 1 and state.epoch == args.fail_at_epoch:
            print(f"FAIL rank=1 epoch={state.epoch}", flush=True)
            os._exit(3)
        with torch.no_grad():
            # Horovod: both ranks meet here every epoch, so the commits follow the failure's epoch.
            state.model.weight.copy_(hvd.allreduce(state.model.weight + 1, op=hvd.Average, name="step"))
        state.epoch += 1
        if args.typed_values:
            record_typed_values(state)
        state.commit()
        if hvd.rank() == 0:
            print(f"COMMIT attempt={ATTEMPT} epoch={state.epoch}", flush=True)


def record_typed_values(state):
    state.mean_loss = np.mean([1.0 / state.epoch, 0.5])
    state.best = Best(state.epoch, np.float32(0.25 * state.epoch))
    state.seen[f"epoch{state.epoch}"] += 1
    state.phase = Phase.TRAIN


typed_values = dict(mean_loss=np.float64(0.0), best=Best(0, np.float32(1.0)), seen=collections.defaultdict(int),
                    phase=Phase.WARMUP) if args.typed_values else {}
state = hvd.elastic.TorchState(model, epoch=0, **typed_values)
train(state)
sys.stdout.write(f"DONE rank={hvd.rank()} epoch={state.epoch} weight={model.weight.item():g} values={typed(state)}\n")
sys.stdout.flush()
hvd.shutdown()
