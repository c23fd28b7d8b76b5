"""A recommender with sparse embeddings and two optimizers: ``job.prepare(model, sparse_opt, dense_opt)``.

A user table (``nn.Embedding(sparse=True)``), bags of items and of tags (``nn.EmbeddingBag(sparse=True)``,
sum and mean) and a dense MLP head. ``SparseAdam`` steps the tables, ``Adam`` the head, each
micro-batch pair accumulated with ``no_sync``. The tables' gradients must be averaged as sparse
tensors on every backend (``SparseAdam`` refuses dense ones): checked after every ``job.backward``.
Under torchrun the shared-memory exchange (auto) cannot carry them and falls back to gloo by itself.
"""
import torch
import torch.nn.functional as F
from program_tools import finish, per_rank_batch, plain_state
from torch import nn
from torch.utils.data import TensorDataset

NAME = "sparse"
GLOBAL_BATCH = 12
SAMPLES, EPOCHS = 72, 4  # 24 steps
USERS, ITEMS, TAGS, DIM = 20, 30, 10, 4


class Recommender(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.users = nn.Embedding(USERS, DIM, sparse=True)
        self.items = nn.EmbeddingBag(ITEMS, DIM, mode="sum", sparse=True)
        self.tags = nn.EmbeddingBag(TAGS, DIM, mode="mean", sparse=True)
        self.head = nn.Sequential(nn.Linear(3 * DIM, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, user, items, tags):
        features = torch.cat([self.users(user), self.items(items), self.tags(tags)], dim=1)
        return self.head(features).squeeze(1)


def run(job, out_dir: str) -> None:
    g = torch.Generator().manual_seed(41)
    user = torch.randint(USERS, (SAMPLES,), generator=g)
    items = torch.randint(ITEMS, (SAMPLES, 3), generator=g)  # three items per sample: a bag
    tags = torch.randint(TAGS, (SAMPLES, 2), generator=g)
    clicked = (torch.rand(SAMPLES, generator=g) < 0.4).double()
    with torch.random.fork_rng():
        torch.manual_seed(43)
        model = Recommender()
    tables = [model.users.weight, model.items.weight, model.tags.weight]
    sparse_opt = torch.optim.SparseAdam(tables, lr=0.02)
    dense_opt = torch.optim.Adam(model.head.parameters(), lr=0.01)
    prepared = job.prepare(model, sparse_opt, dense_opt)
    assert len(prepared) == 3 and prepared[1] is sparse_opt and prepared[2] is dense_opt  # in order
    model = prepared[0]
    initial = plain_state(model)
    loader = job.train_loader(TensorDataset(user, items, tags, clicked), batch_size=per_rank_batch(job, GLOBAL_BATCH),
                              seed=7)
    backwards = 0
    for _epoch in range(EPOCHS):
        for ub, ib, tb_, yb in loader:
            sparse_opt.zero_grad()
            dense_opt.zero_grad()
            halves = list(zip(ub.chunk(2), ib.chunk(2), tb_.chunk(2), yb.chunk(2)))
            for n, (u, i, t, y) in enumerate(halves):
                with job.no_sync(model, enabled=n < len(halves) - 1):
                    job.backward(F.binary_cross_entropy_with_logits(model(u, i, t), y) * len(y) / len(yb))
                layouts = [p.grad.layout for p in tables]
                assert layouts == [torch.sparse_coo] * 3, f"after job.backward the tables' gradients are {layouts}"
                backwards += 1
            job.step(sparse_opt)
            job.step(dense_opt)
    finish(job, out_dir, NAME, initial, plain_state(model), sparse_backwards=backwards)


def check(saved, ref) -> None:
    # Every rank checked the layout after each backward pass (an assertion), micro-batches and all.
    assert [r["sparse_backwards"] for r in saved["per_rank"]] == [ref["sparse_backwards"]] * saved["world_size"]
    assert ref["sparse_backwards"] == 2 * EPOCHS * SAMPLES // GLOBAL_BATCH
