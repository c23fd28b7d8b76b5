"""``trainbridge.hvd`` passes Horovod's own PyTorch tests under every launcher.

tests/hvd_scripts/horovod_suite.py holds the ported assertions. The same file runs under
torchrun and mpirun (our torch backend), under horovodrun (where trainbridge.hvd *is* the
real horovod.torch, which shows that the port expects exactly Horovod's behaviour), and as
plain python (size 1). Every rank must report every check: PASS, or NA only where
Horovod's own test does not apply and this file says so.
"""
import re
from pathlib import Path
from typing import Dict

from conftest import HOROVODRUN, MPIRUN, MPIRUN_FLAGS, PYTHON, TORCHRUN, check, run

SCRIPTS = Path(__file__).parent / "hvd_scripts"
SUITE = SCRIPTS / "horovod_suite.py"
SUITE_TESTS = set(re.findall(r"^def (test_\w+)\(", SUITE.read_text(), flags=re.M))
RESULT = re.compile(r"RESULT (\d+) (PASS|FAIL|NA) (\w+)")

# Checks that Horovod's own suite skips for one process (they need a peer to disagree with or
# to join), plus the gradient hooks that Horovod registers only when size() > 1.
SINGLE_PROCESS_NA = {
    "test_allreduce_error", "test_allreduce_type_error", "test_allreduce_duplicate_name_error",
    "test_allgather_error", "test_allgather_type_error", "test_allgather_duplicate_name_error",
    "test_broadcast", "test_broadcast_inplace", "test_broadcast_error", "test_broadcast_type_error",
    "test_broadcast_rank_error", "test_broadcast_duplicate_name_error", "test_broadcast_grad",
    "test_alltoall_type_error", "test_alltoall_equal_split_length_error", "test_alltoall_rank_error",
    "test_join_returns_last_rank", "test_join_allgather", "test_join_broadcast",
    "test_join_uneven_batches_with_optimizer", "test_hooks_start_allreduce_during_backward",
    "test_backward_passes_per_step", "test_force_allreduce", "test_gradient_clipping",
    "test_synchronize_step_warning", "test_sync_batch_norm",
}
TIMEOUT = 240
WATCHDOG = {"SUITE_WATCHDOG_S": str(TIMEOUT - 20)}  # stacks of a hang, before the timeout kills it


def results_by_rank(output: str) -> Dict[int, Dict[str, str]]:
    by_rank: Dict[int, Dict[str, str]] = {}
    for rank, status, name in RESULT.findall(output):
        by_rank.setdefault(int(rank), {})[name] = status
    return by_rank


def check_suite(result, size: int, not_applicable=frozenset()) -> None:
    check(result)
    by_rank = results_by_rank(result.stdout)
    assert sorted(by_rank) == list(range(size)), f"ranks that reported: {sorted(by_rank)}\n{result.stdout[-3000:]}"
    for rank, statuses in by_rank.items():
        assert set(statuses) == SUITE_TESTS, f"rank {rank} did not run {sorted(SUITE_TESTS - set(statuses))}"
        unexpected = {name: status for name, status in statuses.items()
                      if status != "PASS" and not (status == "NA" and name in not_applicable)}
        assert not unexpected, f"rank {rank}: {unexpected}\n" + "\n".join(
            line for line in result.stdout.splitlines() if "FAIL" in line or " NA " in line)


def test_suite_under_torchrun_2_processes():
    result = run([TORCHRUN, "--standalone", "--nproc-per-node=2", str(SUITE)], timeout=TIMEOUT,
                 env={**WATCHDOG, "EXPECT_REAL_HOROVOD": "0"})
    check_suite(result, size=2)


def test_suite_under_horovodrun_2_processes_is_the_real_horovod():
    result = run([HOROVODRUN, "-np", "2", "--gloo", PYTHON, str(SUITE)], timeout=TIMEOUT,
                 env={**WATCHDOG, "EXPECT_REAL_HOROVOD": "1"})
    check_suite(result, size=2, not_applicable={"test_adasum_outside_horovodrun"})


def test_suite_under_mpirun_uses_the_torch_backend():
    result = run([MPIRUN, *MPIRUN_FLAGS, "-np", "2", PYTHON, str(SUITE)], timeout=TIMEOUT,
                 env={**WATCHDOG, "EXPECT_REAL_HOROVOD": "0"})
    check_suite(result, size=2)


def test_suite_as_plain_python_is_size_1():
    result = run([PYTHON, str(SUITE)], timeout=TIMEOUT, env={**WATCHDOG, "EXPECT_REAL_HOROVOD": "0"})
    check_suite(result, size=1, not_applicable=SINGLE_PROCESS_NA)


def test_horovodrun_mpi_mode_delegates_to_horovod():
    result = check(run([HOROVODRUN, "-np", "2", "--mpi", PYTHON, str(SCRIPTS / "which_backend.py")], timeout=120))
    lines = sorted(re.findall(r"BACKEND rank=\d+ size=\d+ real_horovod=\w+ mpi_enabled=\w+ sum=\d+", result.stdout))
    assert lines == [f"BACKEND rank={r} size=2 real_horovod=True mpi_enabled=True sum=3" for r in range(2)], \
        result.stdout
