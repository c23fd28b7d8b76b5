"""Training sampler and evaluation shards: pure functions of (rank, world size, seed, epoch)."""
import pytest

import torch

from trainbridge.api.loaders import EvalLoader, TrainLoader
from trainbridge.data.sampler import ResumableDistributedSampler


class Shards:
    """The sharding of the public API's loaders for one (rank, world size); no process group needed."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def eval_shard(self, size: int):
        loader = EvalLoader(list(range(size)), 3, rank=self.rank, world_size=self.world, device=torch.device("cpu"))
        return [int(i) for batch in loader for i in batch]

    def train_sampler(self, size: int, seed: int) -> ResumableDistributedSampler:
        return ResumableDistributedSampler(size, num_replicas=self.world, rank=self.rank, seed=seed)


def backend(rank: int, world: int) -> Shards:
    return Shards(rank, world)


@pytest.mark.parametrize("world,size", [(1, 10), (2, 1000), (3, 1000), (4, 7), (5, 3)])
def test_eval_shards_cover_every_sample_exactly_once(world, size):
    shards = [list(backend(r, world).eval_shard(size)) for r in range(world)]
    flat = sorted(i for shard in shards for i in shard)
    assert flat == list(range(size))  # no padding, no duplicates
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_train_sampler_reshuffles_every_epoch_identically_on_all_ranks():
    samplers = [backend(r, 2).train_sampler(100, seed=7) for r in range(2)]
    orders = {}
    for epoch in (0, 1):
        for s in samplers:
            s.set_epoch(epoch)
        orders[epoch] = [list(s) for s in samplers]
        assert sorted(orders[epoch][0] + orders[epoch][1]) == list(range(100))
    assert orders[0] != orders[1]


def test_step_k_sees_the_same_samples_for_2_ranks_of_b_and_1_rank_of_2b():
    # The parity contract: each optimizer step covers one contiguous slice of the
    # epoch's permutation, whatever the world size.
    b = 8
    ranks = [backend(r, 2).train_sampler(96, seed=3) for r in range(2)]
    single = backend(0, 1).train_sampler(96, seed=3)
    for s in (*ranks, single):
        s.set_epoch(4)
    per_rank = [list(s) for s in ranks]
    whole = list(single)
    for k in range(96 // (2 * b)):
        two = set(per_rank[0][k * b:(k + 1) * b]) | set(per_rank[1][k * b:(k + 1) * b])
        assert two == set(whole[k * 2 * b:(k + 1) * 2 * b])


@pytest.mark.parametrize("world,size", [(1, 100), (2, 100), (3, 100), (4, 101)])
def test_same_order_as_torch_distributed_sampler(world, size):
    from torch.utils.data import DistributedSampler

    for rank in range(world):
        ours = backend(rank, world).train_sampler(size, seed=11)
        theirs = DistributedSampler(range(size), num_replicas=world, rank=rank, shuffle=True, seed=11)
        ours.set_epoch(3)
        theirs.set_epoch(3)
        assert list(ours) == list(theirs) and len(ours) == len(theirs)


def test_resume_position_continues_with_the_unseen_indices():
    b, world, steps_done = 5, 2, 3
    full = [backend(r, world).train_sampler(60, seed=2) for r in range(world)]
    resumed = [backend(r, world).train_sampler(60, seed=2) for r in range(world)]
    for s in full:
        s.set_epoch(1)
    for s in resumed:
        s.set_epoch(1, position=steps_done * world * b)
    for f, r in zip(full, resumed):
        assert list(r) == list(f)[steps_done * b:] and len(r) == len(list(r))


def test_resume_at_another_world_size_sees_each_remaining_sample_once():
    old = backend(0, 1).train_sampler(60, seed=2)
    old.set_epoch(0)
    order = list(old)
    new = [backend(r, 3).train_sampler(60, seed=2) for r in range(3)]
    for s in new:
        s.set_epoch(0, position=20)
    assert sorted(i for s in new for i in s) == sorted(order[20:])


def test_train_loader_reshuffles_each_pass_and_resumes_mid_epoch():
    def loader():
        return TrainLoader(list(range(40)), 4, rank=0, world_size=1, device=torch.device("cpu"), seed=5)

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
