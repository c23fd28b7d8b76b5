"""The response cache's bookkeeping, without processes: ids, lookups, drops, the bit arrays."""
import torch

from trainbridge.hvd.negotiation import Announcement, Decision
from trainbridge.hvd.response_cache import ResponseCache, pack, unpack

FLOAT_2 = Announcement("allreduce", ((2,),), ("torch.float32",))
FLOAT_3 = Announcement("allreduce", ((3,),), ("torch.float32",))


def decided(name, announcement=FLOAT_2, ranks=(0, 1), error=None):
    return Decision(name, {r: announcement for r in ranks}, error=error)


def test_ids_follow_the_decisions_and_a_lookup_needs_the_very_same_announcement():
    cache = ResponseCache()
    for name in ("a", "b"):
        cache.add(decided(name), (0, 1))
    assert (cache.lookup((0, "a"), 0, FLOAT_2), cache.lookup((0, "b"), 1, FLOAT_2)) == (0, 1)
    assert cache.lookup((0, "a"), 0, FLOAT_3) is None  # another shape: announced in full
    assert cache.lookup((0, "c"), 0, FLOAT_2) is None
    assert cache.decision(1).name == "b" and cache.decision(1).by_rank == {0: FLOAT_2, 1: FLOAT_2}
    assert cache.size == 2


def test_errors_joined_ranks_and_other_kinds_are_not_cached_and_capacity_bounds_it():
    cache = ResponseCache(capacity=1)
    cache.add(decided("failed", error="ranks disagree"), (0, 1))
    cache.add(decided("joined", ranks=(0,)), (0, 1))  # rank 1 joined: its zeros are not in the cache
    cache.add(decided("barrier.noname.1", Announcement("barrier")), (0, 1))
    assert cache.size == 0
    cache.add(decided("a"), (0, 1))
    cache.add(decided("b"), (0, 1))  # full
    assert cache.lookup((0, "a"), 0, FLOAT_2) == 0 and cache.lookup((0, "b"), 0, FLOAT_2) is None


def test_a_dropped_name_gives_its_id_again_lowest_first():
    cache = ResponseCache()
    for name in "abc":
        cache.add(decided(name), (0, 1))
    assert cache.drop((0, "b")) == 1 and cache.drop((0, "a")) == 0 and cache.drop((0, "zzz")) is None
    cache.add(decided("d"), (0, 1))
    assert cache.lookup((0, "d"), 0, FLOAT_2) == 0 and cache.size == 3


def test_bit_arrays_round_trip():
    parts = [pack({0, 9}, 11, False), pack({9, 10}, 11, True)]
    assert parts[0].dtype == torch.uint8 and parts[0].numel() == 1 + 2
    assert unpack(parts, 11) == (True, [{0, 9}, {9, 10}])
    assert unpack([pack(set(), 0, False)], 0) == (False, [set()])
