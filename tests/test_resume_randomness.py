"""Bitwise resume when the training draws random numbers: dropout, random augmentation in DataLoader
workers, numpy and Python noise in the loop; in a user loop and in ``trainbridge train``.

The reference is an uninterrupted run with the same launcher and world size; a
killed or preempted run, resumed, must end with bitwise the same weights.
"""
import re
import shutil
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import TORCHRUN, Job, bitwise_equal, check, load_final, max_abs_diff, run, torchrun, train_here

SCRIPT = str(Path(__file__).resolve().parent / "api_scripts" / "random_loop.py")
STEPS = 120  # 6 epochs of 1230 // 60 = 20 steps (30 samples are left out of each epoch)


def loop(nproc, out, *args, restarts=None):
    extra = [] if restarts is None else [f"--max-restarts={restarts}"]
    return [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", *extra, SCRIPT, str(out), *args]


def rank_process(job: Job, script: str, rank: int) -> psutil.Process:
    """The worker of ``rank`` (not one of its DataLoader workers, which share its command line)."""
    for child in psutil.Process(job.proc.pid).children(recursive=True):
        try:
            if (script in " ".join(child.cmdline()) and child.environ().get("RANK") == str(rank)
                    and child.parent().environ().get("RANK") != str(rank)):
                return child
        except psutil.Error:
            continue
    pytest.fail(f"no rank {rank} worker running {script}:\n{job.output()[-3000:]}")


def wait_for(path: Path, job: Job, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if job.proc.poll() is not None or time.monotonic() > deadline:
            job.kill()
            pytest.fail(f"never wrote {path}:\n{job.output()[-3000:]}")
        time.sleep(0.01)


def samples_per_step(out: Path) -> dict:
    """step -> the step's sample ids over all ranks; a step trained twice (after a kill) must repeat its samples."""
    steps = {}
    for line in (out / "samples.txt").read_text().splitlines():
        step, *ids = line.split()
        assert steps.setdefault(int(step), ids) == ids, f"step {step} trained other samples the second time"
    return steps


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """2 ranks under torchrun, augmentation in 2 DataLoader workers, never interrupted."""
    out = tmp_path_factory.mktemp("random_loop_ref")
    check(run(loop(2, out, "--workers", "2"), timeout=240))
    final = load_final(out)
    assert final["step"] == STEPS
    return final["model"], samples_per_step(out)


def test_sigkill_of_a_rank_mid_epoch_resumes_bitwise(tmp_path, reference):
    job = Job(loop(2, tmp_path, "--workers", "2", "--checkpoint-every", "7", "--step-delay", "0.02", restarts=1),
              tmp_path / "log")
    wait_for(tmp_path / "last.pt", job)
    rank_process(job, SCRIPT, 1).send_signal(signal.SIGKILL)  # wherever it is: mid-step, mid-collective, mid-save
    assert job.wait(timeout=240) == 0, job.output()[-3000:]
    log = job.output()
    # torchrun saw a failure (rank 1's SIGKILL, or rank 0's broken collective if it noticed first) and
    # restarted both: two launches of the job, each announced once.
    assert re.search(r"failed \(exitcode: -?\d+\) local_rank: [01]", log), log[-3000:]
    assert log.count("[trainbridge] threads per rank") == 2, log[-3000:]
    resumed = [int(s) for s in re.findall(r"resumed at step (\d+)", job.output())]
    assert resumed and all(0 < s < STEPS and s % 7 == 0 and s % 20 for s in resumed), job.output()[-3000:]
    final = load_final(tmp_path)
    assert final["step"] == STEPS and bitwise_equal(final["model"], reference[0])
    assert samples_per_step(tmp_path) == reference[1]


@pytest.fixture(scope="module")
def stopped_by_sigterm(tmp_path_factory):
    """2 ranks, SIGTERM to rank 1 once training has started: (output dir, the step both stopped at)."""
    out = tmp_path_factory.mktemp("random_loop_sigterm")
    job = Job(loop(2, out, "--workers", "2", "--step-delay", "0.02"), out / "log")
    wait_for(out / "samples.txt", job)
    time.sleep(0.5)
    rank_process(job, SCRIPT, 1).send_signal(signal.SIGTERM)
    job.wait(timeout=120)
    stops = [int(s) for s in re.findall(r"stopped by SIGTERM after step (\d+)", job.output())]
    assert len(stops) == 1 and 0 < stops[0] < STEPS, job.output()[-3000:]
    return out, stops[0]


# Another program where one checks it under torchrun in make test: at 2 ranks, trainbridge train with dropout
# stopped by SIGTERM and relaunched (below); at 3, trainbridge train resumed by one process at the same sample
# (tests/test_fault_tolerance.py). This loop's random streams in DataLoader workers: the kill above.
@pytest.mark.matrix
@pytest.mark.parametrize("nproc", [2, 3])
def test_sigterm_then_relaunch_resumes_bitwise_or_at_another_world_size_with_the_same_samples(
        nproc, stopped_by_sigterm, reference, tmp_path):
    # 2 ranks: bitwise. 3 ranks with the same global batch (60 = 2 x 30 = 3 x 20): the steps
    # that follow are the same slices of each epoch's order, dealt among 3 ranks; dropout
    # masks are per rank, so there only the samples, not the weights, can be compared.
    out = tmp_path / "out"
    shutil.copytree(stopped_by_sigterm[0], out)
    stopped = stopped_by_sigterm[1]
    result = check(run(loop(nproc, out, "--workers", "2"), timeout=240))
    assert f"resumed at step {stopped}" in result.stdout
    final = load_final(out)
    assert final["step"] == STEPS
    assert samples_per_step(out) == reference[1]
    if nproc == 2:
        assert bitwise_equal(final["model"], reference[0])
    else:
        assert "written by 2 ranks, this job has 3" in result.stdout


# ----- trainbridge train with its default model, convnet-dropout --------------------------------
CLI = ["--model", "convnet-dropout", "--dataset", "mnist-sample", "--seed", "5", "--batch-size", "32",
       "--epochs", "2", "--threads", "1", "--no-progress"]
CLI_STEPS = 124  # 2 epochs of 4,000 // 64 = 62 steps


@pytest.fixture(scope="module")
def cli_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli_dropout_ref")
    check(run(torchrun(2, CLI + ["--output-dir", str(out)]), timeout=240))
    return load_final(out)["model"]


# Another program where one checks it under torchrun in make test: the random loop's rank killed mid-epoch and
# restarted by torchrun (above); trainbridge train's mid-epoch resume with dropout: the SIGTERM test below.
@pytest.mark.matrix
def test_train_convnet_dropout_killed_mid_epoch_resumes_bitwise(tmp_path, cli_reference):
    cmd = torchrun(2, CLI + ["--checkpoint-every", "10", "--fail-at-step", "87", "--output-dir", str(tmp_path)])
    result = check(run(cmd[:1] + ["--max-restarts=1"] + cmd[1:], timeout=300))
    assert "rank 1 exits abruptly before step 87" in result.stdout + result.stderr
    # Resumed mid-epoch 2, from the step-80 checkpoint: 18 steps of 64 samples into it; the restarted
    # rank 1 did not fail again (the marker file says it has failed once).
    assert "resuming from" in result.stdout and "epoch 2, sample 1152 of the epoch, step 80" in result.stdout
    assert (tmp_path / ".failed-at-step-87").exists()
    final = load_final(tmp_path)
    assert final["step"] == CLI_STEPS
    assert bitwise_equal(final["model"], cli_reference), max_abs_diff(final["model"], cli_reference)


def test_train_convnet_dropout_sigterm_then_relaunch_resumes_bitwise(tmp_path, cli_reference):
    args = CLI + ["--output-dir", str(tmp_path)]
    job = Job(torchrun(2, args), tmp_path / "log")
    job.wait_for_output("epoch 1 step 62", timeout=120)
    job.rank_process(1).send_signal(signal.SIGTERM)  # mid epoch 2; rank 0 learns it through the shared memory
    assert job.wait(timeout=120) != 0
    stops = re.findall(r"stopped by SIGTERM after step (\d+)", job.output())
    assert len(stops) == 1 and 62 < int(stops[0]) < CLI_STEPS, job.output()[-3000:]
    # Both ranks stopped at that step: rank 0's checkpoint holds it, with both ranks' random streams.
    checkpoint = torch.load(tmp_path / "last.pt", weights_only=True)
    assert checkpoint["step"] == int(stops[0]) and len(checkpoint["rng"]["torch"]) == 2
    result = check(run(torchrun(2, args), timeout=240))
    assert f"step {stops[0]}" in result.stdout and "resuming from" in result.stdout
    final = load_final(tmp_path)
    assert final["step"] == CLI_STEPS and bitwise_equal(final["model"], cli_reference)


def test_a_run_ended_by_max_steps_resumes_with_a_larger_one_bitwise(tmp_path):
    """The evaluation at the end of the shorter run draws nothing from dropout's stream before last.pt stores it."""
    args = ["--model", "convnet-dropout", "--dataset", "mnist-sample", "--seed", "5", "--batch-size", "16",
            "--threads", "1", "--no-progress"]
    check(train_here(args + ["--max-steps", "6", "--output-dir", str(tmp_path / "whole")]))
    check(train_here(args + ["--max-steps", "3", "--output-dir", str(tmp_path / "parts")]))
    resumed = check(train_here(args + ["--max-steps", "6", "--output-dir", str(tmp_path / "parts")]))
    assert "epoch 1, sample 48 of the epoch, step 3" in resumed.stdout, resumed.stdout
    whole, parts = load_final(tmp_path / "whole")["model"], load_final(tmp_path / "parts")["model"]
    assert bitwise_equal(parts, whole), max_abs_diff(parts, whole)
