"""No trainbridge.hvd operation can hang: run under torchrun with 2 processes (tests/test_hvd_no_hang.py).

Expects HOROVOD_STALL_CHECK_TIME_SECONDS=2 and HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=6. Each phase
prints ``NOHANG <rank> <phase> ok <seconds>`` or ``NOHANG <rank> <phase> FAIL <why>``:

* rejected: every input Horovod rejects (horovod_tests.rejected_inputs.REJECTED_INPUTS), given by every rank and
  by rank 0 alone (the others give a valid input of the same operation), raises Horovod's
  exception type on every rank within seconds;
* stall_warning: rank 0 submits an allreduce 3.5 s after rank 1, whose watchdog warns on stderr
  (the pytest checks the name and the missing rank); the operation then completes;
* stall_shutdown: each rank waits for an operation the other never submits, both cycling; past
  the shutdown limit both raise HorovodInternalError naming it, and so does any later operation;
* silent_peer: after a re-init, rank 1 waits for an operation while rank 0 submits nothing at all
  (its engine idle); rank 1 raises after the limit, and rank 0's next operation does too;
* engine_failure: after a re-init, rank 0's engine thread fails inside a collective (injected);
  the pending operation raises HorovodInternalError with the cause, later ones at once, and rank 1,
  left inside the collective, raises after the limit.
"""
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from horovod_tests.rejected_inputs import REJECTED_INPUTS  # noqa: E402  (sets HOROVOD_DYNAMIC_PROCESS_SETS too)

import trainbridge.hvd as hvd  # noqa: E402
from trainbridge.hvd import engine as hvd_engine  # noqa: E402

FAST = 5.0  # seconds within which a rejected input must raise on every rank
LIMIT = float(os.environ["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"])


def raises(fn, errors, within):
    started = time.monotonic()
    try:
        fn()
    except errors as exc:
        elapsed = time.monotonic() - started
        assert elapsed < within, f"raised after {elapsed:.1f}s, more than {within}s"
        return exc
    raise AssertionError(f"did not raise {errors}")


def phase_rejected():
    rank = hvd.rank()
    for label, (bad, valid, errors, _) in REJECTED_INPUTS.items():
        raises(lambda bad=bad, label=label: bad(f"all.{label}"), errors, FAST)
        call = bad if rank == 0 else valid
        raises(lambda call=call, label=label: call(f"one.{label}"), errors, FAST)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after_rejected").item() == hvd.size()


def phase_stall_warning():
    if hvd.rank() == 0:
        time.sleep(3.5)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="late_on_rank_0").item() == hvd.size()


def phase_stall_shutdown():
    mine = hvd.allreduce_async(torch.ones(1), name=f"only_on_rank_{hvd.rank()}")
    exc = raises(lambda: hvd.synchronize(mine), hvd.HorovodInternalError, LIMIT + 5)
    assert "only_on_rank_" in str(exc) and "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS" in str(exc), str(exc)
    raises(lambda: hvd.allreduce(torch.ones(1), name="after_shutdown"), hvd.HorovodInternalError, 1)


def phase_silent_peer():
    if hvd.rank() == 1:
        exc = raises(lambda: hvd.allreduce(torch.ones(1), name="nobody_else"), hvd.HorovodInternalError, LIMIT + 5)
        assert "nobody_else" in str(exc) and "[0]" in str(exc), str(exc)
    else:
        time.sleep(LIMIT + 2)  # busy elsewhere: this rank's engine has nothing to do
        raises(lambda: hvd.allreduce(torch.ones(1), name="too_late"), hvd.HorovodInternalError, LIMIT + 5)


def phase_engine_failure():
    if hvd.rank() == 0:
        def broken(self, decision, request):
            raise RuntimeError("injected failure inside the engine thread")
        hvd_engine.Engine._allgather = broken
        exc = raises(lambda: hvd.allgather(torch.ones(2), name="gather"), hvd.HorovodInternalError, FAST)
        assert "injected failure" in str(exc) and isinstance(exc.__cause__, RuntimeError), (str(exc), exc.__cause__)
        later = raises(lambda: hvd.allreduce(torch.ones(1), name="later"), hvd.HorovodInternalError, 1)
        assert "injected failure" in str(later), str(later)
    else:
        raises(lambda: hvd.allgather(torch.ones(2), name="gather"), hvd.HorovodInternalError, LIMIT + 5)


def main() -> int:
    hvd.init()
    rank, failed = hvd.rank(), 0
    phases = [("rejected", phase_rejected, False), ("stall_warning", phase_stall_warning, False),
              ("stall_shutdown", phase_stall_shutdown, True), ("silent_peer", phase_silent_peer, True),
              ("engine_failure", phase_engine_failure, False)]
    for name, phase, reinit_after in phases:
        started = time.monotonic()
        try:
            phase()
            print(f"NOHANG {rank} {name} ok {time.monotonic() - started:.1f}", flush=True)
        except Exception as exc:  # noqa: BLE001 - report every phase
            failed += 1
            detail = " / ".join(traceback.format_exc().strip().splitlines()[-4:])
            print(f"NOHANG {rank} {name} FAIL {type(exc).__name__}: {exc} | {detail}", flush=True)
        if reinit_after:  # the job was shut down: join it again, as a restarted script would
            hvd.shutdown()
            hvd.init()
    hvd.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
