"""trainbridge.data.sampler: the seed of each sample's random draws, a pure function of (seed, epoch, index).

The order and the sharding of the steps are tests/test_sharding.py's; here, that a
sample's seed follows the sample, not the rank, the world size or its place in a batch.
"""
import pickle

import pytest

from trainbridge.data.sampler import SeededBatch, TrainBatches, sample_seed


def seeds_by_sample(world: int, epoch: int, position: int = 0) -> dict:
    """{sample index: its seed} over every rank's batches of one pass, a global batch of 12 dealt among ``world``."""
    seeds = {}
    for rank in range(world):
        batches = TrainBatches(100, 12 // world, rank=rank, world_size=world, seed=5)
        batches.set_pass(epoch, position)
        for batch in batches:
            for index in batch:
                assert index not in seeds
                seeds[index] = batch.seed_of(index)
    return seeds


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_samples_seed_is_the_same_at_any_world_size_rank_and_place_in_its_batch(world):
    for epoch in (0, 1):
        alone = seeds_by_sample(1, epoch)
        assert seeds_by_sample(world, epoch) == alone
        assert alone == {index: sample_seed(5, epoch, index) for index in alone}


def test_a_pass_resumed_at_another_world_size_gives_the_same_seeds():
    alone = seeds_by_sample(1, epoch=2)
    resumed = seeds_by_sample(3, epoch=2, position=24)  # 2 steps trained before
    assert resumed.keys() <= alone.keys() and len(resumed) == len(alone) - 24
    assert all(resumed[i] == alone[i] for i in resumed)


def test_each_sample_and_each_epoch_has_a_seed_of_its_own():
    seeds = {sample_seed(5, epoch, index) for epoch in range(3) for index in range(1000)}
    assert len(seeds) == 3000
    assert sample_seed(5, 0, 1) != sample_seed(6, 0, 1)
    assert all(0 <= s < 2**63 for s in seeds)


def test_a_batch_reaches_a_dataloader_worker_with_its_seeds():
    batch = SeededBatch([7, 3, 9], seed=5, epoch=4)
    copy = pickle.loads(pickle.dumps(batch))
    assert list(copy) == [7, 3, 9] and [copy.seed_of(i) for i in copy] == [sample_seed(5, 4, i) for i in batch]
