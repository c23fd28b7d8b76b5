"""trainbridge.api.stop: the watchdog on waits for the other ranks, and the SIGTERM agreement.

What ends the process (the watchdog's ``os._exit(124)``, death by SIGTERM) runs in a child
``python -c``; the rest runs here, with a watchdog whose timeout never fires.
"""
import os
import signal

import pytest
import torch
from python_child import run_python

from trainbridge.api.stop import FOR_PEERS, STOP_SIGNALS, WATCHDOG_EXIT_CODE, StopSignal, Watchdog

NEVER = 3600.0  # a timeout no test here reaches: the watchdog thread must not end pytest


# ----- Watchdog ---------------------------------------------------------------------------------
def test_a_wait_longer_than_the_timeout_ends_the_process_with_one_line_and_124():
    result = run_python("""
        import time
        from trainbridge.api.stop import Watchdog
        watchdog = Watchdog(0.5, rank=3)
        with watchdog.waiting("job.allreduce at this process's step 7"):
            time.sleep(30)
        print("the wait was never cut short")
    """)
    assert result.returncode == WATCHDOG_EXIT_CODE == 124, result
    assert "never cut short" not in result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("trainbridge: error: rank 3: waited "), lines[0]
    assert "in job.allreduce at this process's step 7 for the other ranks (timeout 0.5s)" in lines[0]
    assert FOR_PEERS[1] in lines[0]


def test_time_between_waits_is_never_cut_short_and_each_wait_is_timed_from_its_own_start():
    # Two waits of no time, 1.5 s of this rank's own work between them (three timeouts),
    # then an armed-and-disarmed joining; the process must end by itself.
    result = run_python("""
        import time
        from trainbridge.api.stop import Watchdog
        watchdog = Watchdog(0.5, rank=0)
        with watchdog.waiting("first"):
            pass
        time.sleep(1.5)
        with watchdog.waiting("second"):
            time.sleep(0.1)
        watchdog.expect("start of the job", 0.3)
        watchdog.disarm()
        time.sleep(1.0)
        print("done")
    """)
    assert result.returncode == 0, result
    assert result.stdout.strip() == "done" and result.stderr == ""


def test_an_expected_wait_that_is_not_disarmed_ends_the_process_naming_it():
    result = run_python("""
        import time
        from trainbridge.api.stop import Watchdog
        watchdog = Watchdog(60.0, rank=1)
        watchdog.expect("start of the job under env", 0.3)
        time.sleep(30)
    """)
    assert result.returncode == WATCHDOG_EXIT_CODE, result
    assert "rank 1: waited" in result.stderr and "in start of the job under env" in result.stderr
    assert "(timeout 60s)" in result.stderr  # the job's timeout, not the one-off limit, is named


def test_a_wait_inside_another_keeps_the_outer_name_and_the_outer_wait_stays_armed():
    watchdog = Watchdog(NEVER, rank=0)
    with watchdog.waiting("job.save('ckpt.pt')"):
        started = watchdog.since
        with watchdog.waiting("job.barrier"):
            assert watchdog.what == "job.save('ckpt.pt')"
            assert watchdog.since == started  # the outer wait's clock runs on
        assert watchdog.what == "job.save('ckpt.pt')"  # the inner block did not disarm it
    assert watchdog.what is None


def test_a_wait_ended_by_an_exception_is_remembered_and_disarmed():
    watchdog = Watchdog(NEVER, rank=0)
    with pytest.raises(RuntimeError), watchdog.waiting("job.allreduce"):
        raise RuntimeError("gloo: connection closed by peer")
    assert watchdog.failed_in == "job.allreduce" and watchdog.what is None


def test_expect_arms_with_its_own_limit_and_disarm_ends_it():
    watchdog = Watchdog(NEVER, rank=0)
    watchdog.expect("start of the job", 12.0)
    assert (watchdog.what, watchdog.limit) == ("start of the job", 12.0)
    watchdog.disarm()
    assert watchdog.what is None
    with watchdog.waiting("job.barrier"):  # a later wait is bounded by the job's timeout again
        assert watchdog.limit == NEVER


# ----- StopSignal -------------------------------------------------------------------------------
@pytest.fixture
def sigterm_handler_restored(monkeypatch):
    """Puts pytest's SIGTERM, SIGINT and SIGHUP handlers back; a handler that would kill pytest (os.kill of
    itself) raises instead."""
    def refuse(pid, signum):
        raise AssertionError(f"the handler sent signal {signum} to pid {pid}")
    monkeypatch.setattr(os, "kill", refuse)
    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)


class PeersFlags:
    """A max-allreduce of the stop flag over this rank and peers whose flags the test sets; started now, read later."""

    def __init__(self):
        self.peer = 0.0
        self.calls = []

    def __call__(self, tensor, op, name):
        self.calls.append((tensor.clone(), op, name))
        result = torch.maximum(tensor, torch.tensor([self.peer]))  # the value at the start, as a collective has
        return lambda: result


def test_the_flag_is_read_one_step_late_and_then_every_step(sigterm_handler_restored):
    allreduce = PeersFlags()
    stop = StopSignal(allreduce)
    assert stop.agreed() is False  # step 0: asks; nothing received
    signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # the handler, as SIGTERM runs it
    assert stop.received
    assert stop.agreed() is False  # step 1: reads step 0's "no", starts its own "yes"
    assert stop.agreed() is True  # step 2: reads the "yes"
    assert stop.agreed() is True and stop.drain() is True  # and stays stopped
    assert [(t.tolist(), op, name) for t, op, name in allreduce.calls] == [([0.0], "max", "stop_signal"),
                                                                           ([15.0], "max", "stop_signal")]
    assert stop.name == "SIGTERM"


def test_a_peers_sigterm_stops_this_rank_at_the_same_step(sigterm_handler_restored):
    allreduce = PeersFlags()
    stop = StopSignal(allreduce)
    assert stop.agreed() is False
    allreduce.peer = 1.0  # another rank got SIGTERM; this one did not
    assert stop.agreed() is False
    assert stop.agreed() is True and not stop.received


def test_drain_finishes_the_agreement_in_flight(sigterm_handler_restored):
    allreduce = PeersFlags()
    stop = StopSignal(allreduce)
    assert stop.drain() is False  # nothing in flight
    stop.agreed()
    allreduce.peer = 1.0  # too late for the allreduce already started
    assert stop.drain() is False and stop.pending is None
    stop.agreed()
    assert stop.drain() is True


def test_ctrl_c_and_a_hang_up_stop_like_sigterm_once_the_loop_asks_and_the_agreed_one_is_named(
        sigterm_handler_restored):
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, as in a script
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    allreduce = PeersFlags()
    stop = StopSignal(allreduce)
    with pytest.raises(KeyboardInterrupt):  # before the loop asks: Ctrl-C as without trainbridge
        signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
    with pytest.raises(AssertionError, match=f"sent signal {signal.SIGHUP}"):  # death by SIGHUP
        signal.getsignal(signal.SIGHUP)(signal.SIGHUP, None)
    signal.signal(signal.SIGHUP, stop._on_sigterm)
    assert stop.agreed() is False
    signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
    signal.getsignal(signal.SIGHUP)(signal.SIGHUP, None)  # the first one received is the one sent
    assert stop.agreed() is False and stop.agreed() is True and stop.name == "SIGINT"
    allreduce.peer = float(signal.SIGTERM)  # a peer's SIGTERM: every rank names the largest number
    other = StopSignal(allreduce)
    other.agreed()
    assert other.agreed() is True and other.name == "SIGTERM"


def test_an_ignored_or_own_sigint_and_sighup_are_left_alone(sigterm_handler_restored):
    def own(signum, frame):
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # tb.spawn's workers, nohup
    signal.signal(signal.SIGHUP, own)
    StopSignal(PeersFlags())
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and signal.getsignal(signal.SIGHUP) is own


def test_a_sigterm_before_the_loop_ever_asked_kills_the_process_as_without_trainbridge():
    result = run_python("""
        import os, signal, time, torch
        from trainbridge.api.stop import StopSignal
        stop = StopSignal(lambda tensor, op, name: (lambda: tensor))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
        print("survived")
    """)
    assert result.returncode == -signal.SIGTERM, result
    assert "survived" not in result.stdout


def test_a_sigterm_after_the_loop_asked_only_sets_the_flag():
    result = run_python("""
        import os, signal, time, torch
        from trainbridge.api.stop import StopSignal
        stop = StopSignal(lambda tensor, op, name: (lambda: tensor))
        stop.agreed()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        print("survived", stop.received, stop.agreed(), stop.agreed())
    """)
    assert result.returncode == 0, result
    assert result.stdout.split() == ["survived", "True", "False", "True"]
