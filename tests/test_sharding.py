"""Training order and evaluation shards: pure functions of (rank, world size, batch, seed, epoch, position).

The train side is :class:`trainbridge.data.sampler.TrainBatches` (one rank's batches
of one pass) and :class:`trainbridge.api.loaders.TrainLoader` on top of it; no
process group is needed.
"""
import pytest
import torch
from torch.utils.data import DistributedSampler

from trainbridge.api.loaders import EvalLoader, TrainLoader
from trainbridge.data.sampler import TrainBatches

CPU = torch.device("cpu")


class Shards:
    """The sharding of the public API's loaders for one (rank, world size); no process group needed."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def eval_shard(self, size: int):
        loader = EvalLoader(list(range(size)), 3, rank=self.rank, world_size=self.world, device=CPU)
        return [int(i) for batch in loader for i in batch]

    def train_batches(self, size: int, batch_size: int, seed: int) -> TrainBatches:
        return TrainBatches(size, batch_size, rank=self.rank, world_size=self.world, seed=seed)


def backend(rank: int, world: int) -> Shards:
    return Shards(rank, world)


def batches_of(sampler: TrainBatches, epoch: int, position: int = 0):
    sampler.set_pass(epoch, position)
    return [list(batch) for batch in sampler]


def flat(batches):
    return [i for batch in batches for i in batch]


# ----- evaluation: every sample on exactly one rank ------------------------------------------------
@pytest.mark.parametrize("world,size", [(1, 10), (2, 1000), (3, 1000), (4, 7), (5, 3)])
def test_eval_shards_cover_every_sample_exactly_once(world, size):
    shards = [list(backend(r, world).eval_shard(size)) for r in range(world)]
    everything = sorted(i for shard in shards for i in shard)
    assert everything == list(range(size))  # no padding, no duplicates
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


# ----- training order ------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [100, 107])
def test_train_batches_reshuffle_every_epoch_identically_on_all_ranks(size):
    samplers = [backend(r, 2).train_batches(size, 5, seed=7) for r in range(2)]
    trained = (size // 10) * 10
    orders = {}
    for epoch in (0, 1):
        orders[epoch] = [batches_of(s, epoch) for s in samplers]
        # The ranks draw one permutation: their shards are disjoint and together one slice of each step.
        both = flat(orders[epoch][0]) + flat(orders[epoch][1])
        assert len(both) == len(set(both)) == trained and set(both) <= set(range(size))
        # Drawn again, the same epoch gives the same batches (a pure function of the epoch).
        assert [batches_of(s, epoch) for s in samplers] == orders[epoch]
    assert orders[0] != orders[1]
    assert flat(orders[0][0]) + flat(orders[0][1]) != flat(orders[1][0]) + flat(orders[1][1])


@pytest.mark.parametrize("size", [96, 100])
def test_step_k_sees_the_same_samples_for_2_ranks_of_b_and_1_rank_of_2b(size):
    # The parity contract: each optimizer step covers one contiguous slice of the
    # epoch's permutation, whatever the world size.
    b = 8
    per_rank = [batches_of(backend(r, 2).train_batches(size, b, seed=3), epoch=4) for r in range(2)]
    whole = batches_of(backend(0, 1).train_batches(size, 2 * b, seed=3), epoch=4)
    assert len(whole) == len(per_rank[0]) == len(per_rank[1]) == size // (2 * b)
    for k, step in enumerate(whole):
        assert len(per_rank[0][k]) == len(per_rank[1][k]) == b and len(step) == 2 * b
        assert set(per_rank[0][k]) | set(per_rank[1][k]) == set(step)


@pytest.mark.parametrize("world,size,batch", [
    # sizes that are a multiple of the global batch: exactly DistributedSampler's per-rank order
    (1, 100, 10), (2, 100, 5), (3, 99, 3), (4, 100, 5),
    # other sizes: that order truncated to whole global batches (no padding)
    (1, 105, 10), (3, 100, 4), (4, 101, 5), (2, 1001, 15),
])
def test_same_order_as_torch_distributed_sampler(world, size, batch):
    global_batch = batch * world
    steps = size // global_batch
    for rank in range(world):
        ours = backend(rank, world).train_batches(size, batch, seed=11)
        theirs = DistributedSampler(range(size), num_replicas=world, rank=rank, shuffle=True, seed=11)
        theirs.set_epoch(3)
        ours_batches = batches_of(ours, epoch=3)
        assert len(ours) == len(ours_batches) == steps
        assert all(len(b) == batch for b in ours_batches)
        if size % global_batch == 0:
            assert flat(ours_batches) == list(theirs) and steps * batch == len(theirs)
        else:
            assert flat(ours_batches) == list(theirs)[:steps * batch]


def test_resume_position_continues_with_the_unseen_indices():
    b, world, steps_done = 5, 2, 3
    for size in (60, 67):
        for rank in range(world):
            full = backend(rank, world).train_batches(size, b, seed=2)
            resumed = backend(rank, world).train_batches(size, b, seed=2)
            full.set_pass(1)
            resumed.set_pass(1, position=steps_done * world * b)
            full_batches, resumed_batches = list(full), list(resumed)
            assert [list(x) for x in resumed_batches] == [list(x) for x in full_batches[steps_done:]]
            assert len(resumed) == len(resumed_batches) == len(full_batches) - steps_done
            # The per-batch seeds (random augmentation) continue too.
            assert [x.seed for x in resumed_batches] == [x.seed for x in full_batches[steps_done:]]


@pytest.mark.parametrize("size", [60, 63])
def test_resume_at_another_world_size_sees_each_remaining_sample_once(size):
    # Global batch 12: 1 rank of 12 before the checkpoint, 3 ranks of 4 after it, at position 24 (2 steps).
    old = batches_of(backend(0, 1).train_batches(size, 12, seed=2), epoch=0)
    order = flat(old)
    new = [batches_of(backend(r, 3).train_batches(size, 4, seed=2), epoch=0, position=24) for r in range(3)]
    remaining = [i for shard in new for i in flat(shard)]
    assert sorted(remaining) == sorted(order[24:]) and len(remaining) == len(set(remaining))
    # And step by step: the new ranks together train the old run's steps 2, 3, ...
    assert all(len(shard) == len(old) - 2 for shard in new)
    for k in range(len(old) - 2):
        assert set().union(*(shard[k] for shard in new)) == set(old[2 + k])


def test_train_loader_reshuffles_each_pass_and_resumes_mid_epoch():
    def loader():
        return TrainLoader(list(range(40)), 4, rank=0, world_size=1, device=CPU, seed=5)

    full = loader()
    passes = [[b.tolist() for b in full] for _ in range(2)]
    assert passes[0] != passes[1] and sorted(sum(passes[0], [])) == list(range(40)) and full.epoch == 2
    interrupted = loader()
    batches = iter(interrupted)
    first = [next(batches).tolist() for _ in range(3)]
    state = interrupted.state_dict()  # after 3 batches were handed out
    assert state["epoch"] == 0 and state["position"] == 12
    resumed = loader()
    resumed.load_state_dict(state)
    assert first + [b.tolist() for b in resumed] == passes[0]
    assert [b.tolist() for b in resumed] == passes[1]  # and the next pass is the next epoch's order
