"""``trainbridge.hvd`` passes Horovod's own PyTorch tests under every launcher.

tests/hvd_scripts/horovod_suite.py runs the ported assertions (tests/hvd_scripts/horovod_tests/, one
module per Horovod API area; process sets, sparse tensors and every input Horovod rejects included).
The same file runs under torchrun with 2 and 3
processes (3: a process set of 2 out of 3) and mpirun (our torch backend), under horovodrun
(where trainbridge.hvd *is* the real horovod.torch, which shows that the port expects exactly
Horovod's behaviour), and as plain python (size 1). Every rank must report every check: PASS,
or NA only where Horovod's own test does not apply and this file says so.
"""
import re
from pathlib import Path
from typing import Dict

import pytest
import torch
from conftest import HOROVODRUN, MPIRUN, MPIRUN_FLAGS, PYTHON, TORCHRUN, check, max_abs_diff, run

SCRIPTS = Path(__file__).parent / "hvd_scripts"
SUITE = SCRIPTS / "horovod_suite.py"
# Every check the suite must report: the test_* functions of its modules.
SUITE_TESTS = {name for module in (SCRIPTS / "horovod_tests").glob("*.py")
               for name in re.findall(r"^def (test_\w+)\(", module.read_text(), flags=re.M)}
RESULT = re.compile(r"RESULT (\d+) (PASS|FAIL|NA) (\w+)")
GLOO_THREADS = re.compile(r"GLOO_THREADS rank=(\d+) running=(-?\d+) at_exit=(\d+)")

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
    # Process sets of the even and the odd ranks need two ranks, as in Horovod's own suite.
    "test_allreduce_process_sets", "test_allreduce_grad_process_sets", "test_grouped_allreduce_process_sets",
    "test_allgather_process_sets", "test_broadcast_process_sets", "test_alltoall_process_sets",
    "test_reducescatter_process_sets", "test_broadcast_object_process_sets", "test_process_set_barrier_op",
    "test_optimizer_process_sets", "test_process_set_queries_and_errors", "test_static_process_sets",
    "test_async_sparse_allreduce_process_sets", "test_rejected_input_on_one_rank_fails_every_rank",
    "test_reducescatter_error", "test_reducescatter_type_error", "test_reducescatter_duplicate_name_error",
    "test_global_barrier_op", "test_dynamic_requires_grad",
}
# Under horovodrun: Adasum is the real Horovod's own op, and an input rejected on one rank only
# leaves the real Horovod's other ranks waiting for ever (the torch backend fails them all).
# Two checks re-initialize, which the real Horovod does not reliably survive under horovodrun --gloo
# (an upstream bug in its rendezvous server: horovod_tests/common.py's REAL_HOROVOD_REINIT).
REAL_HOROVOD_NA = {"test_adasum_outside_horovodrun", "test_rejected_input_on_one_rank_fails_every_rank",
                   "test_static_process_sets", "test_is_initialized_and_reinit"}
TIMEOUT = 240
WATCHDOG = {"SUITE_WATCHDOG_S": str(TIMEOUT - 20)}  # stacks of a hang, before the timeout kills it


def results_by_rank(output: str) -> Dict[int, Dict[str, str]]:
    by_rank: Dict[int, Dict[str, str]] = {}
    for rank, status, name in RESULT.findall(output):
        by_rank.setdefault(int(rank), {})[name] = status
    return by_rank


def check_suite(result, size: int, not_applicable=frozenset(), real_horovod: bool = False) -> None:
    # A failed check's own line first: check's output tail may hold only the later passes. Then the
    # tails: a hang's stacks (the suite's watchdog) are on stderr.
    failed = [line for line in result.stdout.splitlines() if RESULT.search(line) and " FAIL " in line]
    assert not failed, "\n".join([*failed, f"exit {result.returncode}; stdout's tail:", result.stdout[-3000:],
                                   "stderr's tail:", result.stderr[-8000:]])
    check(result)
    # No gloo group outlives trainbridge.hvd's exit handler: a worker thread still giving back a
    # tensor in the interpreter's teardown aborted a rank (SIGABRT) after every check had passed.
    threads = {int(rank): (int(running), int(at_exit))
               for rank, running, at_exit in GLOO_THREADS.findall(result.stdout)}
    assert sorted(threads) == list(range(size)), f"ranks that reported their gloo threads: {sorted(threads)}"
    for rank, (running, at_exit) in threads.items():
        assert at_exit == 0, f"rank {rank}: {at_exit} gloo worker threads left for the interpreter's teardown"
        # The count can see them: the torch backend runs its groups on them (the real Horovod does not).
        assert real_horovod or running >= 2, f"rank {rank}: {running} gloo worker threads seen while running"
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


@pytest.mark.matrix  # a third rank
def test_suite_under_torchrun_3_processes_with_a_process_set_of_2():
    result = run([TORCHRUN, "--standalone", "--nproc-per-node=3", str(SUITE)], timeout=TIMEOUT,
                 env={**WATCHDOG, "EXPECT_REAL_HOROVOD": "0"})
    check_suite(result, size=3)


@pytest.mark.matrix  # against the real Horovod
def test_suite_under_horovodrun_2_processes_is_the_real_horovod():
    result = run([HOROVODRUN, "-np", "2", "--gloo", PYTHON, str(SUITE)], timeout=TIMEOUT,
                 env={**WATCHDOG, "EXPECT_REAL_HOROVOD": "1"})
    check_suite(result, size=2, not_applicable=REAL_HOROVOD_NA, real_horovod=True)


@pytest.mark.matrix  # a further launcher of the torch backend
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


@pytest.mark.matrix  # against the real Horovod
def test_sparse_embedding_training_matches_the_real_horovod(tmp_path):
    """nn.Embedding(sparse=True) through DistributedOptimizer: trainbridge.hvd under torchrun gives the
    weights the real Horovod gives under horovodrun (sparse allgather, and sparse_as_dense)."""
    script = SCRIPTS / "sparse_embedding.py"
    ours, theirs = tmp_path / "torchrun.pt", tmp_path / "horovodrun.pt"
    check(run([TORCHRUN, "--standalone", "--nproc-per-node=2", str(script), str(ours)], timeout=120))
    check(run([HOROVODRUN, "-np", "2", "--gloo", PYTHON, str(script), str(theirs)], timeout=120))
    ours, theirs = torch.load(ours, weights_only=True), torch.load(theirs, weights_only=True)
    assert sorted(ours) == sorted(theirs) == ["sparse", "sparse_as_dense"]
    for variant in ours:
        difference = max_abs_diff(ours[variant], theirs[variant])
        print(f"{variant}: max |trainbridge.hvd - horovod.torch| = {difference:.2e}")
        assert difference <= 1e-5, (variant, difference)
    # Training moved the embedding: identical weights are not an accident of an untouched model.
    torch.manual_seed(0)
    untouched = torch.nn.Embedding(40, 6, sparse=True).weight.detach()
    assert (ours["sparse"]["0.weight"] - untouched).abs().max() > 1e-3


# Another program where one checks it under torchrun in make test: trainbridge train --backend horovod (the same
# refuse_horovod_under, tests/test_bad_input.py).
@pytest.mark.matrix
def test_real_horovod_requested_under_torchrun_is_refused_with_one_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import trainbridge.hvd as hvd\nhvd.init()\nprint('TRAINED ALONE', hvd.size())\n")
    result = run([TORCHRUN, "--standalone", "--nproc-per-node=2", str(script)], timeout=120,
                 env={"TRAINBRIDGE_HVD_BACKEND": "horovod"})
    assert result.returncode != 0 and "TRAINED ALONE" not in result.stdout, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("trainbridge: error:")]
    assert lines == ["trainbridge: error: TRAINBRIDGE_HVD_BACKEND=horovod cannot run under torchrun: Horovod "
                     "would see size 1 in each of the 2 processes; launch with horovodrun -np 2 (or mpirun), or "
                     "unset TRAINBRIDGE_HVD_BACKEND under torchrun (trainbridge.hvd then runs on "
                     "torch.distributed)"], result.stderr[-3000:]
    assert not re.search(r'File ".*trainbridge/', result.stderr), result.stderr[-3000:]  # no traceback of ours
