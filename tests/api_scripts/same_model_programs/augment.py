"""Random augmentation in ``__getitem__``, loaded by 2 DataLoader workers: a random crop of a padded image
and a flip (torch's generator), brightness noise (numpy) and a random erase (``random``).

Each sample draws from its own stream (seed, epoch, sample index), so every world size crops each
sample alike and trains the same model. The global batch is given as such (``global_batch_size``).

Every run writes OUT/augment-step7.pt mid-epoch (``job.save``); a run whose OUT already holds it
resumes from it, at whatever world size (tests/test_same_model.py resumes 2 ranks' in one process).
"""
import os
import random

import numpy as np
import torch
import torch.nn.functional as F
from program_tools import finish, plain_state
from torch import nn
from torch.utils.data import Dataset

NAME = "augment"
GLOBAL_BATCH = 12
EPOCHS = 2
SAVE_AT = 7  # of 10 steps: mid-epoch 1


class AugmentedImages(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(23)
        self.images = torch.randn(n, 1, 8, 8, generator=g)
        self.labels = (self.images[:, 0, :4].mean((1, 2)) > self.images[:, 0, 4:].mean((1, 2))).long()

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        image = F.pad(self.images[i], (2, 2, 2, 2))
        top, left = torch.randint(0, 5, (2,)).tolist()
        image = image[:, top:top + 8, left:left + 8]
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        image = image + float(np.random.normal(0.0, 0.1))
        row = random.randrange(8)
        image = image.clone()
        image[:, row] = 0.0
        return image, self.labels[i]


class GroupNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.head = nn.Linear(4 * 4 * 4, 2)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.norm(self.conv(x))), 2)
        return self.head(h.flatten(1))


def run(job, out_dir: str) -> None:
    dataset = AugmentedImages(60)  # 5 global batches of 12 per epoch
    job.set_seed(700)
    model = GroupNormNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = job.prepare(model, optimizer)
    initial = plain_state(model)
    loader = job.train_loader(dataset, global_batch_size=GLOBAL_BATCH, seed=8, num_workers=2)
    state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0}
    checkpoint = os.path.join(out_dir, f"{NAME}-step{SAVE_AT}.pt")
    resumed = os.path.exists(checkpoint)
    if resumed:
        job.load(checkpoint, into=state)
        job.print(f"{NAME}: resumed at step {state['step']}, epoch {loader.epoch}, sample {loader.position}")
    pixels = torch.zeros((), dtype=torch.float64)  # every augmented pixel this rank loaded, summed
    while loader.epoch < EPOCHS:
        for x, y in loader:
            optimizer.zero_grad()
            job.backward(F.cross_entropy(model(x), y))
            job.step(optimizer)
            pixels += x.sum()
            state["step"] += 1
            if state["step"] == SAVE_AT and not resumed:
                job.save(state, checkpoint)
    finish(job, out_dir, NAME, initial, plain_state(model), pixel_sum=job.allreduce(pixels, "sum").item(),
           steps=state["step"], resumed=resumed)


def check(saved, ref) -> None:
    # The augmented pixels summed over every sample of every step: the same draws at any world size.
    assert (saved["steps"], saved["resumed"]) == (ref["steps"], False) == (10, False)
    assert abs(saved["pixel_sum"] - ref["pixel_sum"]) < 1e-9, (saved["pixel_sum"], ref["pixel_sum"])
