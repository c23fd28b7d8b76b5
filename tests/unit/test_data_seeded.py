"""trainbridge.data.seeded: every sample loaded under its own seed, whatever batch it is loaded in.

Loaders with workers, resumes and world sizes over whole passes are tests/test_loaders.py's.
"""
import random

import numpy
import torch
from torch.utils.data import Dataset, TensorDataset

from trainbridge.api.loaders import TrainLoader
from trainbridge.data.sampler import SeededBatch
from trainbridge.data.seeded import SeededDataset


class Drawing(Dataset):
    """Each sample: its index and one draw from each of torch's, Python's and numpy's global generators."""

    def __len__(self):
        return 20

    def __getitem__(self, index):
        return torch.tensor([index, torch.rand(()).item(), random.random(), numpy.random.rand()], dtype=torch.float64)


class DrawingBatches(Drawing):
    """Gathers whole batches itself, drawing once for the batch."""

    def __getitems__(self, indices):
        return [self[i] for i in indices]


def loaded(dataset, indices, epoch=0):
    return {int(row[0]): row for row in SeededDataset(dataset).__getitems__(SeededBatch(indices, seed=3, epoch=epoch))}


def test_a_sample_draws_the_same_in_any_batch_at_any_place():
    one = loaded(Drawing(), [4, 11, 2])
    other = loaded(Drawing(), [2, 7, 4, 0])
    assert torch.equal(one[4], other[4]) and torch.equal(one[2], other[2])
    assert len({tuple(row[1:].tolist()) for row in (*one.values(), *other.values())}) == 5  # 5 samples, 5 draws
    assert not torch.equal(loaded(Drawing(), [4], epoch=1)[4], one[4])  # the next epoch draws anew


def test_the_training_streams_are_put_back_after_loading_in_the_main_process():
    torch.manual_seed(1)
    random.seed(1)
    numpy.random.seed(1)
    loaded(Drawing(), [1, 2, 3])
    drawn = torch.rand(()).item(), random.random(), numpy.random.rand()
    fresh = torch.Generator().manual_seed(1), random.Random(1), numpy.random.RandomState(1)
    assert drawn == (torch.rand((), generator=fresh[0]).item(), fresh[1].random(), fresh[2].rand())


def test_a_dataset_that_gathers_batches_draws_under_its_first_samples_seed():
    first = loaded(DrawingBatches(), [5, 6, 7])
    torch.manual_seed(99)
    assert all(torch.equal(a, b) for a, b in zip(first.values(), loaded(DrawingBatches(), [5, 6, 7]).values()))
    assert torch.equal(first[5], loaded(Drawing(), [5])[5])  # the first sample: its own seed


def random_collate(rows):
    return torch.stack([torch.stack(row) for row in rows]), torch.rand(len(rows), dtype=torch.float64)


def test_a_random_collate_fn_of_a_read_only_dataset_resumes_bitwise_in_workers():
    data = TensorDataset(torch.arange(40.0), torch.zeros(40))

    def loader():
        return TrainLoader(data, 4, rank=0, world_size=1, device=torch.device("cpu"), seed=2, num_workers=2,
                           collate_fn=random_collate)

    reference = [noise for _, noise in loader()]
    interrupted = loader()
    for step, _ in enumerate(interrupted):
        if step == 3:
            state = interrupted.state_dict()
            break
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [noise for _, noise in resumed]
    assert len(rest) == 6 and all(torch.equal(a, b) for a, b in zip(rest, reference[4:]))
