"""No ``trainbridge.hvd`` operation can hang: rejected inputs, stalls and a failing engine.

tests/hvd_scripts/no_hang.py runs each situation under torchrun with 2 processes and short stall
limits; every rank must report every phase as ok, each within the seconds the script allows.
"""
import re
from pathlib import Path

import pytest
from conftest import MPIRUN, MPIRUN_FLAGS, PYTHON, TORCHRUN, check, in_matrix, run

SCRIPT = Path(__file__).parent / "hvd_scripts" / "no_hang.py"
ABORTED_STEP = Path(__file__).parent / "hvd_scripts" / "aborted_step.py"
MISMATCH = "ranks disagree on the shape of allreduce 'cached': rank 0 has [5], rank 1 has [4]"
PHASES = ["rejected", "stall_warning", "stall_shutdown", "silent_peer", "engine_failure"]


def test_rejected_inputs_stalls_and_engine_failures_raise_on_every_rank():
    result = check(run([TORCHRUN, "--standalone", "--nproc-per-node=2", str(SCRIPT)], timeout=150,
                       env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "2", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "6"}))
    # Both ranks write to one pipe, so two reports may share a line: each ends where the next begins.
    reports = re.findall(r"NOHANG (\d) (\w+) (ok|FAIL)((?:(?!NOHANG ).)*)", result.stdout)
    assert sorted((int(r), p) for r, p, _, _ in reports) == sorted((r, p) for r in range(2) for p in PHASES), \
        result.stdout[-3000:]
    failures = [line for line in reports if line[2] != "ok"]
    assert not failures, failures
    # The stall warning names the operation and the rank that has not submitted it.
    warning = re.search(r"trainbridge\.hvd: warning: rank 1 is waiting for allreduce 'late_on_rank_0' "
                        r"\(waited \d+s; ranks \[0\] have not submitted it\)", result.stderr)
    assert warning, result.stderr[-3000:]


@pytest.mark.parametrize("launcher", in_matrix(["torchrun", "mpirun"], ["mpirun"]))
def test_names_of_an_aborted_step_are_reused_at_once_on_every_rank(launcher):
    """30 rounds of a step whose allreduces are dropped by an exception and started again at once under the same
    names, each rank late by turns. (Before: ValueError '0.weight' is already in progress on one rank or both, and
    where one rank only lost the race, the other waited for the stall shutdown.)"""
    command = {"torchrun": [TORCHRUN, "--standalone", "--nproc-per-node=2", str(ABORTED_STEP)],
               "mpirun": [MPIRUN, *MPIRUN_FLAGS, "-np", "2", PYTHON, str(ABORTED_STEP)]}[launcher]
    # A short stall shutdown: an operation left waiting fails the run in seconds, not at the timeout.
    result = check(run(command, timeout=120, env={"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "20"}))
    out = result.stdout
    assert sorted(re.findall(r"ABORTED (\d) (ok 30|FAIL.*)", out)) == [("0", "ok 30"), ("1", "ok 30")], out[-3000:]
    # An optimizer step aborted between backward and step(): every rank gets Horovod's one line at zero_grad().
    lines = dict(re.findall(r"OPTIMIZER (\d) (.*)", out))
    assert sorted(lines) == ["0", "1"] and lines["0"] == lines["1"], out[-3000:]
    assert lines["0"].startswith("optimizer.zero_grad() was called after loss.backward() but before"), lines
    trained = dict(re.findall(r"TRAINED (\d) (\w+)", out))
    assert sorted(trained) == ["0", "1"] and trained["0"] == trained["1"], out[-3000:]
    # A name the response cache holds, submitted with another shape on one rank: the mismatch on both ranks.
    cached = re.findall(r"CACHED (\d) (.*)", out)
    assert sorted(cached) == [("0", "ok"), ("0", MISMATCH), ("1", "ok"), ("1", MISMATCH)], out[-3000:]
