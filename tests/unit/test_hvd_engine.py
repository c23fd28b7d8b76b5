"""trainbridge.hvd's engine in a one-rank job in the test process: operations under a name already in flight."""
import pytest
import torch
import torch.distributed as dist
from one_rank_job import one_rank_env

import trainbridge.hvd as hvd
from trainbridge.hvd import process
from trainbridge.hvd.running_job import runtime


@pytest.fixture(scope="module")
def engine():
    with one_rank_env():
        hvd.init()
        try:
            yield runtime().engine
        finally:
            hvd.shutdown()
            if process._owns_default_group and dist.is_initialized():
                dist.destroy_process_group()
            process._owns_default_group = False


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
