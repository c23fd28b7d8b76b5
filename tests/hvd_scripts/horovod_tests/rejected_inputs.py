"""Every input Horovod rejects raises Horovod's exception type on every rank, and the engine keeps working.

``REJECTED_INPUTS`` is shared: tests/hvd_scripts/no_hang.py gives each input on one rank and on both.
"""

import time

import torch

import trainbridge.hvd as hvd

from .common import NotApplicable, expect_error, multi_rank_only


def _complex(name):
    return hvd.allreduce(torch.zeros(3, dtype=torch.complex64), name=name)


# label: (the rejected call, a valid call of the same operation, the types Horovod 0.28.1 raises,
#         whether the real Horovod gets through it: it segfaults on a scalar given to alltoall)
REJECTED_INPUTS = {
    "allgather_scalar": (lambda n: hvd.allgather(torch.tensor(1.0), name=n),
                         lambda n: hvd.allgather(torch.ones(2), name=n), (IndexError,), True),
    "grouped_allgather_scalar": (lambda n: hvd.grouped_allgather([torch.zeros(3, 1), torch.tensor(1.0)], name=n),
                                 lambda n: hvd.grouped_allgather([torch.zeros(3, 1), torch.ones(1)], name=n),
                                 (IndexError,), True),
    "reducescatter_scalar": (lambda n: hvd.reducescatter(torch.tensor(1.0), name=n),
                             lambda n: hvd.reducescatter(torch.ones(4), name=n), (ValueError,), True),
    "grouped_reducescatter_scalar": (
        lambda n: hvd.grouped_reducescatter([torch.zeros(3, 1), torch.tensor(1.0)], name=n),
        lambda n: hvd.grouped_reducescatter([torch.zeros(3, 1), torch.ones(2)], name=n), (ValueError,), True),
    "alltoall_scalar": (lambda n: hvd.alltoall(torch.tensor(1.0), name=n),
                        lambda n: hvd.alltoall(torch.ones(hvd.size()), name=n), (ValueError,), False),
    "complex_dtype": (_complex, lambda n: hvd.allreduce(torch.zeros(3), name=n), (ValueError,), True),
    "not_contiguous": (lambda n: hvd.allreduce(torch.zeros(3, 4).t(), name=n),
                       lambda n: hvd.allreduce(torch.zeros(4, 3), name=n), (ValueError,), True),
    "sparse_to_allreduce": (lambda n: hvd.allreduce(torch.zeros(3, 4).to_sparse(), name=n),
                            lambda n: hvd.allreduce(torch.zeros(3, 4), name=n), (ValueError,), True),
    "unknown_op": (lambda n: hvd.allreduce(torch.zeros(3), op=42, name=n),
                   lambda n: hvd.allreduce(torch.zeros(3), name=n), (hvd.HorovodInternalError,), True),
    "broadcast_root_out_of_range": (lambda n: hvd.broadcast(torch.zeros(3), hvd.size(), name=n),
                                    lambda n: hvd.broadcast(torch.zeros(3), 0, name=n), (ValueError,), True),
    "broadcast_negative_root": (lambda n: hvd.broadcast(torch.zeros(3), -1, name=n),
                                lambda n: hvd.broadcast(torch.zeros(3), 0, name=n), (ValueError,), True),
    "reducescatter_min": (lambda n: hvd.reducescatter(torch.zeros(4), op=hvd.Min, name=n),
                          lambda n: hvd.reducescatter(torch.zeros(4), name=n), (hvd.HorovodInternalError,), True),
    "alltoall_splits_length": (lambda n: hvd.alltoall(torch.zeros(4), splits=[1] * (hvd.size() + 1), name=n),
                               lambda n: hvd.alltoall(torch.zeros(hvd.size()), name=n), (ValueError,), True),
    "alltoall_splits_sum": (lambda n: hvd.alltoall(torch.zeros(4), splits=[5] * hvd.size(), name=n),
                            lambda n: hvd.alltoall(torch.zeros(hvd.size()), name=n), (ValueError,), True),
    "unregistered_process_set": (lambda n: hvd.allreduce(torch.zeros(3), name=n, process_set=hvd.ProcessSet([0])),
                                 lambda n: hvd.allreduce(torch.zeros(3), name=n), (TypeError,), True),
}


def test_rejected_inputs_raise_horovods_types():
    for label, (bad, _, errors, horovod_too) in REJECTED_INPUTS.items():
        if horovod_too or not hvd.using_real_horovod:
            expect_error(lambda bad=bad: bad(None), *errors)  # unnamed: the numbering must stay aligned
            expect_error(lambda bad=bad, label=label: bad(f"rejected.{label}"), *errors)
    # Nothing is left pending: unnamed operations keep their numbering, the engine keeps working.
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [hvd.size()] * 2
    assert hvd.allgather(torch.ones(1)).tolist() == [1.0] * hvd.size()
    hvd.barrier()


def test_rejected_input_on_one_rank_fails_every_rank():
    """Horovod leaves the ranks with a valid input waiting for ever; here every rank raises the same type."""
    multi_rank_only()
    if hvd.using_real_horovod:
        raise NotApplicable("the real Horovod waits for ever when only one rank's input is rejected")
    for label, (bad, valid, errors, _) in REJECTED_INPUTS.items():
        call = bad if hvd.rank() == 0 else valid
        started = time.monotonic()
        expect_error(lambda call=call, label=label: call(f"one_rank.{label}"), *errors)
        assert time.monotonic() - started < 10, (label, time.monotonic() - started)
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [hvd.size()] * 2
