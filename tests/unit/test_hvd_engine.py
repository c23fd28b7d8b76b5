"""trainbridge.hvd's engine in a one-rank job in the test process: operations under a name already in flight,
the cycle time, fusion."""
import time

import pytest
import torch
from one_rank_hvd import hvd_job

import trainbridge.hvd as hvd


@pytest.fixture
def engine():
    with hvd_job() as engine:
        yield engine


def test_a_name_submitted_again_while_in_flight_runs_after_the_first(engine):
    # Holding the engine's lock keeps its thread from taking the first announcement: the second call meets
    # the first one in flight every time, as a step retried at once after an exception can.
    with engine._cv:
        first = hvd.allreduce_async(torch.tensor([1.0, 2.0]), name="grad.fc", op=hvd.Sum)
        second = hvd.allreduce_async(torch.tensor([3.0, 4.0]), name="grad.fc", op=hvd.Sum)
        third = hvd.allreduce_async(torch.tensor([5.0, 6.0]), name="grad.fc", op=hvd.Sum)
    assert hvd.synchronize(third).tolist() == [5.0, 6.0]
    assert hvd.synchronize(first).tolist() == [1.0, 2.0]
    assert hvd.synchronize(second).tolist() == [3.0, 4.0]
    assert not engine._local and not engine._waiting


def test_an_input_rejected_while_its_name_is_in_flight_leaves_the_operation_in_flight_alone(engine):
    with engine._cv:
        valid = hvd.allgather_async(torch.ones(2, 3), name="gathered")
        with pytest.raises(IndexError):
            hvd.allgather(torch.tensor(1.0), name="gathered")  # a scalar: rejected on this rank
        again = hvd.allgather_async(torch.zeros(1, 3), name="gathered")
    assert hvd.synchronize(valid).shape == (2, 3)
    # One rank: the rejection decided alone, then the operation behind it.
    assert hvd.synchronize(again).shape == (1, 3)
    assert not engine._local and not engine._waiting


def test_cycles_start_a_cycle_time_apart_and_what_comes_meanwhile_is_negotiated_together():
    with hvd_job(HOROVOD_CYCLE_TIME="200") as engine:
        hvd.allreduce(torch.ones(1), name="first")  # a cycle starts now
        cycles, started = engine.cycles, time.monotonic()
        a = hvd.allreduce_async(torch.ones(1), name="a")
        time.sleep(0.02)
        b = hvd.allreduce_async(torch.ones(1), name="b")
        hvd.synchronize(a), hvd.synchronize(b)
        # Horovod's meaning: the next cycle starts 200 ms after the last one started, with both in it.
        assert engine.cycles == cycles + 1
        assert time.monotonic() - started > 0.15


def test_the_default_cycle_time_and_fusion_threshold_are_horovods():
    with hvd_job() as engine:
        assert engine._settings.cycle_time_s == 0.001
        assert engine._settings.fusion_bytes == 128 * 1024 * 1024


def test_a_name_repeated_unchanged_is_decided_from_the_cache_and_a_changed_one_is_announced_again(engine):
    for _ in range(2):
        assert hvd.allreduce(torch.ones(2), name="cached", op=hvd.Sum).tolist() == [1.0, 1.0]
    key = (0, "cached")
    assert engine._cache.key(0) == key and engine._cache.size == 1
    assert hvd.allreduce(torch.ones(3), name="cached", op=hvd.Sum).tolist() == [1.0] * 3  # a new shape
    assert engine._cache.decision(engine._cache._ids[key]).by_rank[0].shapes == ((3,),)


def test_cache_capacity_0_turns_the_cache_off():
    with hvd_job(HOROVOD_CACHE_CAPACITY="0") as engine:
        for _ in range(2):
            hvd.allreduce(torch.ones(2), name="uncached")
        assert engine._cache.size == 0
