"""No ``trainbridge.hvd`` operation can hang: rejected inputs, stalls and a failing engine.

tests/hvd_scripts/no_hang.py runs each situation under torchrun with 2 processes and short stall
limits; every rank must report every phase as ok, each within the seconds the script allows.
"""
import re
from pathlib import Path

from conftest import TORCHRUN, check, run

SCRIPT = Path(__file__).parent / "hvd_scripts" / "no_hang.py"
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
