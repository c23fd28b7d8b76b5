"""Synchronized BatchNorm: ``prepare(..., sync_batchnorm=True)`` and a user's own ``nn.SyncBatchNorm``.

A small conv net with BatchNorm2d (one with ``momentum=None``) and BatchNorm1d, prepared with
``sync_batchnorm=True``, and an MLP with torch's ``nn.SyncBatchNorm`` prepared without it: each
layer normalises with the statistics of the whole global batch, so the weights and the running
statistics (compared with the rest of the state_dict) are one process's at any world size, and
so is the evaluation that uses them.
"""
import torch
import torch.nn.functional as F
from program_tools import finish, per_rank_batch, plain_state
from torch import nn
from torch.utils.data import TensorDataset

NAME = "sync_bn"
GLOBAL_BATCH = 12
EPOCHS = 2  # of 24 samples: 4 steps


def models():
    with torch.random.fork_rng():
        torch.manual_seed(31)
        conv = nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=None), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 3))
        mlp = nn.Sequential(nn.Linear(5, 8), nn.SyncBatchNorm(8), nn.Tanh(), nn.Linear(8, 1))
    return conv, mlp


def run(job, out_dir: str) -> None:
    g = torch.Generator().manual_seed(31)
    images, labels = torch.randn(24, 3, 8, 8, generator=g), torch.randint(0, 3, (24,), generator=g)
    points = torch.randn(24, 5, generator=g)
    targets = points[:, :1] * points[:, 1:2] + 0.5
    conv, mlp = models()
    conv_opt = torch.optim.SGD(conv.parameters(), lr=0.1, momentum=0.9)
    mlp_opt = torch.optim.SGD(mlp.parameters(), lr=0.05)
    conv, conv_opt = job.prepare(conv, conv_opt, sync_batchnorm=True)
    mlp, mlp_opt = job.prepare(mlp, mlp_opt)  # its nn.SyncBatchNorm synchronized all the same
    initial = {**plain_state(conv, "conv."), **plain_state(mlp, "mlp.")}
    batch = per_rank_batch(job, GLOBAL_BATCH)
    loader = job.train_loader(TensorDataset(images, labels, points, targets), batch_size=batch, seed=31)
    for _epoch in range(EPOCHS):
        for xb, yb, pb, tb in loader:
            conv_opt.zero_grad()
            job.backward(F.cross_entropy(conv(xb), yb))
            job.step(conv_opt)
            mlp_opt.zero_grad()
            job.backward(F.mse_loss(mlp(pb), tb))
            job.step(mlp_opt)
    # Evaluation on each rank with the running statistics (eval mode waits for no other rank).
    with torch.no_grad():
        evaluated = [job.unwrap(conv).eval()(images).sum().item(), job.unwrap(mlp).eval()(points).sum().item()]
    synchronized = [type(m).__name__ for model in (conv, mlp) for m in job.unwrap(model).modules()
                    if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    finish(job, out_dir, NAME, initial, {**plain_state(conv, "conv."), **plain_state(mlp, "mlp.")},
           evaluated=evaluated, synchronized=synchronized)


def check(saved, ref) -> None:
    assert saved["synchronized"] == ref["synchronized"] == ["SyncBatchNorm"] * 4
    assert all(abs(a - b) <= 1e-9 for a, b in zip(saved["evaluated"], ref["evaluated"])), (saved["evaluated"],
                                                                                         ref["evaluated"])
    steps = EPOCHS * 24 // GLOBAL_BATCH
    assert [saved["final"][f"conv.{i}.num_batches_tracked"].item() for i in (1, 5, 10)] == [steps] * 3
    # The running statistics moved from their start (statistics left at 0 and 1 would also "agree").
    assert (saved["final"]["conv.10.running_var"] - 1).abs().max() > 1e-3
