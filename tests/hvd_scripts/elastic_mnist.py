"""Horovod's elastic MNIST pattern (examples/elastic/pytorch/pytorch_mnist_elastic.py) under torchrun restarts.

Run with ``torchrun --max-restarts 1``. With ``--crash-at-batch B`` rank 1 is SIGKILLed at
batch B of epoch 1 in the first attempt; torchrun restarts both workers, which must resume
from the last ``state.commit()``. The optimizer has momentum and weight decay, so the
restarted ranks hold equal weights only if ``state.sync()`` leaves both the weights and the
optimizer state as rank 0's. Lines for the test:

    COMMIT attempt=<n> epoch=<e> batch=<b>     rank 0, after each commit
    START attempt=<n> rank=<r> epoch=<e> batch=<b> state=<digest>
                                               every rank, when the training function starts (after the sync)
    DONE rank=<r> checksum=<float> accuracy=<float> state=<digest>

``<digest>`` is a SHA-256 of the bytes of every parameter and every optimizer state value.
"""
import argparse
import hashlib
import os
import signal
import sys

import torch
import torch.nn.functional as F

import trainbridge.hvd as hvd
from trainbridge.data.mnist import load_mnist
from trainbridge.models.mnist import mlp

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=50)
parser.add_argument("--batches-per-commit", type=int, default=3)
parser.add_argument("--crash-at-batch", type=int, default=-1)
parser.add_argument("--wd", type=float, default=0.01)
args = parser.parse_args()

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

hvd.init()
torch.manual_seed(1)
torch.set_num_threads(1)

mnist = load_mnist("mnist-sample", "", note=lambda line: None)
train_dataset = torch.utils.data.TensorDataset(mnist.train.images[:1200], mnist.train.labels[:1200])

# Horovod: the elastic sampler records processed samples, so a resumed epoch skips them.
train_sampler = hvd.elastic.ElasticSampler(train_dataset, shuffle=True, seed=1)
train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)

model = mlp()
# Horovod: scale the learning rate by the number of workers.
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.5, weight_decay=args.wd)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())


def digest() -> str:
    """The weights and the optimizer state, bit for bit."""
    sha = hashlib.sha256()
    for p in model.parameters():
        sha.update(p.detach().numpy().tobytes())
    for _, values in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(values.items()):
            sha.update(key.encode() + (value.numpy().tobytes() if torch.is_tensor(value) else repr(value).encode()))
    return sha.hexdigest()[:16]


@hvd.elastic.run
def train(state):
    # One write per line: both ranks print this at once, and print() writes the text and its newline apart.
    sys.stdout.write(f"START attempt={ATTEMPT} rank={hvd.rank()} epoch={state.epoch} batch={state.batch} "
                     f"state={digest()}\n")
    sys.stdout.flush()
    for state.epoch in range(state.epoch, args.epochs + 1):  # noqa: B020 - Horovod's elastic example, as written
        state.model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            if ATTEMPT == 0 and hvd.rank() == 1 and state.epoch == 1 and state.batch == args.crash_at_batch:
                print(f"CRASH rank=1 epoch={state.epoch} batch={state.batch}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)  # a hard failure: no exception handling, no clean shutdown
            state.optimizer.zero_grad()
            F.cross_entropy(state.model(data), target).backward()
            state.optimizer.step()
            state.batch += 1
            state.train_sampler.record_batch(batch_idx, args.batch_size)
            if state.batch % args.batches_per_commit == 0:
                state.commit()
                if hvd.rank() == 0:
                    print(f"COMMIT attempt={ATTEMPT} epoch={state.epoch} batch={state.batch}", flush=True)
        state.batch = 0
        state.train_sampler.set_epoch(state.epoch + 1)
        state.commit()


def on_state_reset():
    # Horovod: the number of workers may have changed; rescale the learning rate.
    for param_group in optimizer.param_groups:
        param_group["lr"] = 0.05 * hvd.size()


state = hvd.elastic.TorchState(model, optimizer, train_sampler=train_sampler, epoch=1, batch=0)
state.register_reset_callbacks([on_state_reset])
train(state)

model.eval()
with torch.no_grad():
    accuracy = (model(mnist.val.images).argmax(1) == mnist.val.labels).float().mean().item()
checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
sys.stdout.write(f"DONE rank={hvd.rank()} checksum={checksum:.10f} accuracy={accuracy:.4f} state={digest()}\n")
sys.stdout.flush()
hvd.shutdown()
