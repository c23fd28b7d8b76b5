"""Mistakes in a user's loop end in one line that names the problem and the fix (tests/api_scripts/misuse.py).

Rank-divergent inputs are checked once, where they are given (loaders, prepare,
allreduce), so they read as a mismatch of values, not as a rank that died; misuse in
one process is refused where it happens; a checkpoint that could never be loaded is
never written, and a readable one that weights_only refuses is never called corrupt.
"""
import argparse
import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import HOROVODRUN, PYTHON, TORCHRUN, Job, check, run, train_here

SCRIPT = str(Path(__file__).resolve().parent / "api_scripts" / "misuse.py")


def error_lines(result) -> list:
    """The distinct ``trainbridge: error:`` messages (torchrun repeats a worker's in its summary)."""
    output = result.stdout + result.stderr
    return sorted({line[line.index("trainbridge: error:"):] for line in output.splitlines()
                   if "trainbridge: error:" in line})


def assert_one_line(result, pattern: str) -> None:
    output = f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert result.returncode != 0 and "no error" not in result.stdout, output
    lines = error_lines(result)
    assert len(lines) == 1 and re.search(pattern, lines[0]), output
    assert "misuse.py\", line" not in result.stdout + result.stderr, output  # no traceback through the script


ONE_PROCESS = {
    "init-twice": r"tb\.init\(\) was already called in this process",
    "prepare-twice": r"this model was already prepared",
    "save-not-a-dict": r"job\.save takes a dict of what to save, got a Sequential",
    "save-rng-key": r"the key 'rng' is where every rank's random streams are saved",
    "save-numpy": r"\['extra'\] holds a numpy\.float64 .*could never be loaded; save a plain value",
    "save-namespace": r"\['extra'\] holds a argparse\.Namespace .*vars\(args\)",
    "save-namedtuple": r"\['extra'\] holds a __main__\.Point .*tuple\(named_tuple\)",
    "save-path": r"\['extra'\] holds a pathlib\.PosixPath .*str\(path\)",
    "save-lambda": r"\['extra'\] holds a builtins\.function",
    "batch-size-float": r"batch_size must be a whole number of at least 1 \(got 2\.5\)",
    "load-other-model": r"ckpt\.pt's 'model' is for another model: .*shape mismatches: 0\.weight",
    "frozen-after-prepare": r"job\.backward: 0\.weight, 0\.bias of the prepared model stopped requiring gradients "
                            r"after job\.prepare.*find_unused_parameters=True to job\.prepare \[after 1 step",
}


def said_in_turn(result, mode: str, pattern: str) -> None:
    """``mode``'s message in the output of misuse.py's ``each`` job: one line, matching ``pattern``."""
    said = [line for line in result.stdout.splitlines() if line.startswith(f"{mode}: ")]
    assert len(said) == 1 and re.search(pattern, said[0]), (mode, result.stdout[-3000:])


@pytest.fixture(scope="module")
def one_process_in_turn(tmp_path_factory):
    """One plain-python job meets each one-process mistake in turn, in a folder of its own: (folder, result)."""
    out = tmp_path_factory.mktemp("misuse_in_turn")
    return out, check(run([PYTHON, SCRIPT, "each", str(out), *ONE_PROCESS], timeout=120))


@pytest.mark.parametrize("mode", list(ONE_PROCESS))
def test_misuse_in_one_process_is_one_line(mode, one_process_in_turn):
    # Each mistake raises tb.UserError with its message (anything else would end the job with a traceback);
    # the next test follows one of them out of the script, through tb.init's one line and exit status 2.
    out, result = one_process_in_turn
    said_in_turn(result, mode, ONE_PROCESS[mode])
    if mode.startswith("save-"):  # nothing written, nothing left behind
        assert list((out / mode).iterdir()) == []


def test_a_mistake_left_uncaught_ends_the_process_in_one_line_with_status_2(tmp_path):
    result = run([PYTHON, SCRIPT, "save-numpy", str(tmp_path)], timeout=60)
    assert_one_line(result, ONE_PROCESS["save-numpy"])
    assert result.returncode == 2 and list(tmp_path.iterdir()) == []


RANK_DIVERGENT = {
    "dataset-size": r"train_loader: the ranks disagree at \['dataset size'\] \(rank 0: 1000; rank 1: 1001\); "
                    r".*random_split",
    "seed": r"train_loader: the ranks disagree at \['seed'\] \(rank 0: 0; rank 1: 1\)",
    "batch-size": r"train_loader: the ranks disagree at \['batch_size'\] \(rank 0: 10; rank 1: 11\)",
    "lr": r"the optimizer: the ranks disagree at \['param_groups'\]\[0\]\['lr'\] \(rank 0: 0\.1; rank 1: 0\.2\)",
    "optimizer": r"the optimizer: the ranks disagree at \['type'\] \(rank 0: 'SGD'; rank 1: 'Adam'\)",
    "second-optimizer": r"optimizer 2: the ranks disagree at \['param_groups'\]\[0\]\['lr'\] "
                        r"\(rank 0: 0\.1; rank 1: 0\.2\)",
    "shm-on-sparse": r'shm_allreduce="on" is not possible: the model has sparse gradients \(nn\.Embedding or '
                     r'nn\.EmbeddingBag with sparse=True\); use shm_allreduce="auto" or shm_allreduce="off"',
    "compression": (r"job\.prepare's options: the ranks disagree at \['compression'\] "
                    r"\(rank 0: 'none'; rank 1: 'fp16'\)"),
    "shapes": r"the model's parameters: the ranks disagree at \['0\.weight'\] \(rank 0: \(8, 4\); rank 1: \(9, 4\)\)",
    "allreduce-dtype": r"job\.allreduce's tensor: the ranks disagree at \['dtype'\] "
                       r"\(rank 0: 'torch\.float32'; rank 1: 'torch\.int32'\)",
    "allreduce-shape": r"the ranks disagree at \['shape'\] \(rank 0: \(3,\); rank 1: \(4,\)\)",
    "global-batch-uneven": r"train_loader: a global batch of 13 cannot be dealt evenly among 2 ranks; use a "
                           r"multiple of 2 \(12 or 14\)$",
    # Refused before anything is written (test_rank_divergent_inputs_name_the_ranks_and_values checks the folder).
    "copy-before-prepare": r"the ranks hold different models at job\.save\(.*ckpt\.pt'\), step \d+: '0\.weight' of "
                           r"job\.save's 'ema' differs \(rank 0 vs rank 1\); .*copy it after prepare",
    # Last: the job goes on to the next mode with this diverged model among its prepared ones.
    # Named within one check period (misuse.CHECK_EVERY = 4 steps), whatever the job's step count was.
    "diverged-weight": r"the ranks hold different models after step \d+: '2\.weight' of prepared model \d+ "
                       r"\(Sequential\) differs \(rank 0 vs rank 1\).* \[after [1-4] step\(s\) of this mode\]$",
}


def test_rank_divergent_inputs_name_the_ranks_and_values(tmp_path):
    # One job meets each divergence in turn (a launch costs seconds of start-up, a check milliseconds):
    # each is the same UserError on every rank, which the script catches and rank 0 prints, so the
    # ranks go on together to the next; the next test follows one of them to the job's end.
    started = time.monotonic()
    result = check(run([TORCHRUN, "--standalone", "--nproc-per-node=2", SCRIPT, "each", str(tmp_path),
                        *RANK_DIVERGENT], timeout=180))
    for mode, pattern in RANK_DIVERGENT.items():
        said_in_turn(result, mode, pattern)
    assert list((tmp_path / "copy-before-prepare").iterdir()) == []
    # Said at once, not by the watchdog after the script's 60 s timeout, and not as a dead rank.
    assert time.monotonic() - started < 60
    assert "another rank" not in result.stdout + result.stderr


@pytest.mark.matrix
def test_models_that_differ_between_ranks_are_named_under_horovod(tmp_path):
    # The check's allreduce and its naming of the tensor on the Horovod backend (make test: under torchrun above).
    modes = ["copy-before-prepare", "diverged-weight"]
    result = check(run([HOROVODRUN, "-np", "2", "--gloo", PYTHON, SCRIPT, "each", str(tmp_path), *modes],
                       timeout=120))
    result.stdout = re.sub(r"(?m)^\[\d+\]<stdout>:", "", result.stdout)  # horovodrun's prefix
    for mode in modes:
        said_in_turn(result, mode, RANK_DIVERGENT[mode])


def test_a_rank_divergent_input_under_torchrun_ends_the_job_in_one_line(tmp_path):
    started = time.monotonic()
    result = run([TORCHRUN, "--standalone", "--nproc-per-node=2", SCRIPT, "shapes", str(tmp_path)], timeout=120)
    assert_one_line(result, RANK_DIVERGENT["shapes"])
    # Said at once: the watchdog would end the job only 65 s after start-up (timeout 60 s + 5 s).
    assert time.monotonic() - started < 60
    assert "another rank" not in result.stdout + result.stderr


def test_rank_divergent_dataset_under_horovod_is_one_line(tmp_path):
    result = run([HOROVODRUN, "-np", "2", "--gloo", PYTHON, SCRIPT, "dataset-size", str(tmp_path)], timeout=120)
    assert_one_line(result, RANK_DIVERGENT["dataset-size"])


def test_a_readable_checkpoint_that_weights_only_refuses_is_not_called_corrupt(tmp_path):
    # A checkpoint written by an older release, or by hand, holding a type outside the allow-list.
    last = tmp_path / "last.pt"
    torch.save({"format": "trainbridge-checkpoint-1", "config": argparse.Namespace(lr=0.1)}, last)
    before = last.read_bytes()
    result = train_here(["--dataset", "mnist-sample", "--epochs", "1", "--no-progress", "--output-dir", str(tmp_path)])
    assert result.returncode == 2, result.stderr[-3000:]
    lines = error_lines(result)
    assert len(lines) == 1 and "is intact but holds a value torch.load(weights_only=True) refuses" in lines[0], lines
    assert "argparse.Namespace" in lines[0] and "corrupt" not in lines[0]
    assert last.read_bytes() == before and not (tmp_path / "last.pt.corrupt").exists()


def test_world_size_without_rank_is_one_line():
    # Before: every process ran alone as world size 1 and trained its own model.
    result = run([PYTHON, "-c", "import trainbridge as tb; tb.init(); print('no error')"], timeout=60,
                 env={"WORLD_SIZE": "2"})
    assert_one_line(result, r"WORLD_SIZE=2 is set but RANK, MASTER_ADDR, MASTER_PORT are not")
    assert result.returncode == 2


def test_a_launcher_variable_that_is_not_a_number_is_one_line():
    # Before: a raw ValueError traceback from int('abc').
    result = run([PYTHON, "-c", "import trainbridge as tb; tb.init(); print('no error')"], timeout=60,
                 env={"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "abc"})
    assert_one_line(result, r"the environment variable MASTER_PORT='abc' is not a whole number; set it to one")
    assert result.returncode == 2 and "Traceback" not in result.stderr


NO_STOP_CHECK = str(Path(__file__).resolve().parent / "api_scripts" / "no_stop_check.py")


def rank_process(job: Job, rank: int) -> psutil.Process:
    """The no_stop_check.py worker of ``rank`` under a torchrun ``job``."""
    for child in psutil.Process(job.proc.pid).children(recursive=True):
        try:
            if NO_STOP_CHECK in child.cmdline() and child.environ().get("RANK") == str(rank):
                return child
        except psutil.Error:
            continue
    pytest.fail(f"no worker with rank {rank}:\n{job.output()[-3000:]}")


@pytest.mark.parametrize("launcher", ["python", "torchrun", "torchrun, rank 1 only"])
def test_sigterm_ends_a_loop_that_never_calls_should_stop(launcher, tmp_path):
    # Sent to the whole process group, as SLURM and Kubernetes do, or to one rank (a node-local
    # eviction). Before: the loop ran to its end, exit 0.
    cmd = [PYTHON, NO_STOP_CHECK] if launcher == "python" else \
        [TORCHRUN, "--standalone", "--nproc-per-node=2", NO_STOP_CHECK]
    job = Job(cmd, tmp_path / "log")
    job.wait_for_output("training", timeout=60)
    signalled = time.monotonic()
    if launcher == "torchrun, rank 1 only":
        time.sleep(1)  # rank 1 is past tb.init too (rank 0 printed after joining it), handler and all
        rank_process(job, 1).send_signal(signal.SIGTERM)
    else:
        os.killpg(job.proc.pid, signal.SIGTERM)
    code = job.wait(timeout=60)
    assert time.monotonic() - signalled < 20, job.output()[-3000:]
    assert code != 0 and "finished" not in job.output(), job.output()[-3000:]
    if launcher == "python":
        assert code == -signal.SIGTERM  # the signal's own default action, as without trainbridge
    if launcher == "torchrun, rank 1 only":  # torchrun's summary: rank 1 died of the signal first
        assert re.search(r"Root Cause.*\n.*\n.*\n.*\n\s*rank\s*: 1 .*\n\s*exitcode\s*: -15 ", job.output()), \
            job.output()[-3000:]
