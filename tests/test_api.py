"""The public API (``tb.init`` -> Job) in a user's own loop, examples/own_loop.py, under real launchers.

Reference: one plain-python process with the whole global batch of 60 (3 epochs
of 25 steps on the 1,500 digits). In float64 every launcher and world size must
end within 1e-5 of it; killed, preempted and resumed runs must end bitwise equal
to an uninterrupted run with the same launcher and world size.
"""
import json
import os
import re
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
import torch
from conftest import (
    HOROVODRUN,
    MPIRUN,
    MPIRUN_FLAGS,
    PYTHON,
    TORCHRUN,
    Job,
    bitwise_equal,
    check,
    in_matrix,
    load_final,
    max_abs_diff,
    run,
)
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
OWN_LOOP = str(ROOT / "examples" / "own_loop.py")
OWN_LOOP_HELD = str(ROOT / "tests" / "api_scripts" / "own_loop_held.py")
SCRIPTS = Path(__file__).resolve().parent / "api_scripts"
STEPS = 75  # 3 epochs x 25 steps of 60 samples


def torchrun(nproc, script, args, restarts=None):
    extra = [] if restarts is None else [f"--max-restarts={restarts}"]
    return [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", *extra, script, *args]


def horovodrun(nproc, mode, script, args):
    return [HOROVODRUN, "-np", str(nproc), f"--{mode}", PYTHON, script, *args]


def mpirun(nproc, script, args):
    return [MPIRUN, *MPIRUN_FLAGS, "-np", str(nproc), PYTHON, script, *args]


def python(script, args):
    return [PYTHON, script, *args]


def worker(job: Job, rank: int, script: str = OWN_LOOP) -> psutil.Process:
    """The ``script`` worker of ``rank`` under a torchrun ``job``
    (conftest's rank_process looks for trainbridge.train)."""
    for child in psutil.Process(job.proc.pid).children(recursive=True):
        try:
            environ, cmdline = child.environ(), child.cmdline()
        except psutil.Error:
            continue
        if script in cmdline and environ.get("RANK") == str(rank):
            return child
    pytest.fail(f"no own_loop.py worker with rank {rank} under {job.cmd[0]}:\n{job.output()[-3000:]}")


def initial_weights():
    """own_loop.py's model before training (seed 0, float64)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(torch.float64).state_dict()


# ----- 1. the same weights under every launcher -------------------------------------------------
F64 = ["--float64", "--global-batch", "60"]

# horovodrun --mpi, and mpirun with Horovod (auto) and with --backend torch: tests/test_real_programs.py
# launches four programs on this API under each, with the same and stronger checks (1e-9). It is also make
# test's check of this guarantee under torchrun and horovodrun --gloo: here those launches are the matrix.
RUNS = {
    "torchrun": lambda a: torchrun(2, OWN_LOOP, a),
    "horovodrun-gloo": lambda a: horovodrun(2, "gloo", OWN_LOOP, a),
    "spawn": lambda a: python(OWN_LOOP, a + ["--nproc", "2"]),
    # One process through the torch backend (a 1-rank gloo group), against the local backend's reference.
    "python-torch-1": lambda a: python(OWN_LOOP, a + ["--backend", "torch"]),
    "torchrun-3": lambda a: torchrun(3, OWN_LOOP, a),
}
WORLD_SIZE = {"python-torch-1": 1, "torchrun-3": 3}


@pytest.fixture(scope="module")
def float64_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("own_loop_local")
    check(run(python(OWN_LOOP, F64 + ["--backend", "local", "--output-dir", str(out)]), timeout=120))
    final = load_final(out)
    assert (final["step"], final["world_size"]) == (STEPS, 1)
    return final["model"]


@pytest.mark.parametrize("name", in_matrix(list(RUNS), {"torchrun", "horovodrun-gloo", "spawn", "torchrun-3"}))
def test_own_loop_matches_one_process_under_every_launcher(name, float64_reference, tmp_path):
    result = check(run(RUNS[name](F64 + ["--output-dir", str(tmp_path)]), timeout=240))
    assert "done: wrote" in result.stdout
    final = load_final(tmp_path)
    # The world size the job saw: two processes that each trained alone would also "match".
    assert (final["step"], final["world_size"]) == (STEPS, WORLD_SIZE.get(name, 2))
    assert final["model"].keys() == float64_reference.keys()
    assert all(value.dtype == torch.float64 for value in final["model"].values())
    diff = max_abs_diff(final["model"], float64_reference)
    assert diff <= 1e-5, f"{name}: max abs weight difference {diff:.3g} vs one process"
    # The weights moved: a run that silently did nothing would also "match" a reference that did nothing.
    assert max_abs_diff(final["model"], initial_weights()) > 1e-2


def test_checkpoints_during_training_change_nothing(tmp_path, float64_reference):
    # Every 5 steps includes the last step of each epoch (25, 50, 75): saving the loader
    # there must neither skip nor repeat an epoch.
    check(run(python(OWN_LOOP, F64 + ["--backend", "local", "--checkpoint-every", "5",
                                      "--output-dir", str(tmp_path)]), timeout=120))
    final = load_final(tmp_path)
    assert final["step"] == STEPS and bitwise_equal(final["model"], float64_reference)


# ----- 2. exact evaluation: every sample once, no padding -------------------------------------
def test_eval_loader_counts_every_sample_once_on_three_ranks(tmp_path):
    # 100 items over 3 ranks: a padded sampler would hand out 102 and count two of them twice.
    check(run(torchrun(3, str(SCRIPTS / "eval_count.py"), [str(tmp_path)]), timeout=120))
    shards = [json.loads((tmp_path / f"shard-{rank}.json").read_text()) for rank in range(3)]
    assert [shard["world_size"] for shard in shards] == [3, 3, 3]
    assert [len(shard["items"]) for shard in shards] == [34, 33, 33]
    for rank, shard in enumerate(shards):
        assert shard["items"] == list(range(rank, 100, 3))
    totals = json.loads((tmp_path / "totals.json").read_text())
    assert (totals["count"], totals["sum"]) == (100, sum(range(100)))
    assert sorted(totals["seen"]) == list(range(100))


# ----- 3./4. preempted ranks resume bitwise (killed ones: tests/test_resume_randomness.py) ----------
# 75 steps take about a second: 12 epochs leave a signal sent after the first epoch time to land mid-training.
LONG = ["--epochs", "12"]
LONG_STEPS = 12 * 25


@pytest.fixture(scope="module")
def torchrun_reference(tmp_path_factory):
    """An uninterrupted float32 run under torchrun with 2 processes."""
    out = tmp_path_factory.mktemp("own_loop_torchrun")
    check(run(torchrun(2, OWN_LOOP, LONG + ["--output-dir", str(out)]), timeout=240))
    final = load_final(out)
    assert (final["step"], final["world_size"]) == (LONG_STEPS, 2)
    return final["model"]


# To rank 1 only, another program where others check it under torchrun in make test: trainbridge train with dropout
# (tests/test_resume_randomness.py, through the shared memory) and through gloo (tests/test_fault_tolerance.py).
@pytest.mark.parametrize("target", [pytest.param("rank 1", marks=pytest.mark.matrix), "the process group"])
def test_sigterm_stops_every_rank_at_one_step_and_the_next_launch_resumes(target, tmp_path, torchrun_reference):
    # To rank 1 only: a node-local eviction notice. To torchrun's process group, as SLURM and
    # Kubernetes send it, with DataLoader workers that get it too: torchrun forwards it to each
    # worker's group. Before, with workers: "DataLoader worker (pid N) is killed by signal".
    # The signalled ranks wait after step 30 until they have it: the 300 steps take about 1.5 s,
    # and a signal sent after that (a slow test on a loaded machine) found training over.
    workers = ["--workers", "2"] if target == "the process group" else []
    held = {"HOLD_RANKS": "1" if target == "rank 1" else "0,1"}
    job = Job(torchrun(2, OWN_LOOP_HELD, LONG + workers + ["--output-dir", str(tmp_path)]), tmp_path / "log",
              env=held)
    job.wait_for_output("rank 1 holds after step 30", timeout=120)
    if target == "rank 1":
        worker(job, 1, OWN_LOOP_HELD).send_signal(signal.SIGTERM)
    else:
        os.killpg(job.proc.pid, signal.SIGTERM)
    code = job.wait(timeout=90)
    log = job.output()
    assert code != 0, log[-3000:]  # torchrun reports the workers' 143 as its own failure
    assert "done: wrote" not in log and not (tmp_path / "final.pt").exists(), log[-3000:]
    assert "killed by signal" not in log, log[-3000:]
    stops = re.findall(r"stopped by SIGTERM after step (\d+)", log)
    assert len(stops) == 1, log[-3000:]  # printed by the main rank
    # Both workers left through the SIGTERM path (143), none through a timeout or a crash.
    if target == "rank 1":  # (a signalled torchrun prints no summary)
        exit_codes = re.findall(r"^\s+exitcode\s*:\s*(-?\d+)", log, re.MULTILINE)  # torchrun's summary
        assert sorted(exit_codes) == ["143", "143"], log[-3000:]
    assert "trainbridge: error" not in log, log[-3000:]
    stopped_at = int(stops[0])
    assert 30 <= stopped_at <= 32  # the step the ranks were held at, and at most the next two (the agreement)
    checkpoint = torch.load(tmp_path / "last.pt", weights_only=True)
    # job.save gathered both ranks' RNG states at that step: both ranks were there.
    assert checkpoint["step"] == stopped_at and checkpoint["rng"]["world_size"] == 2
    assert len(checkpoint["rng"]["torch"]) == 2
    result = check(run(torchrun(2, OWN_LOOP, LONG + workers + ["--output-dir", str(tmp_path)]), timeout=240))
    assert re.search(rf"^resumed from .*last\.pt: epoch \d+, step {stopped_at}$", result.stdout, re.MULTILINE), \
        result.stdout
    final = load_final(tmp_path)
    assert final["step"] == LONG_STEPS and bitwise_equal(final["model"], torchrun_reference)


# ----- 5. wrong combinations: one line, a non-zero exit, no traceback -----------------------------
def assert_one_clear_line(result: subprocess.CompletedProcess, pattern: str) -> None:
    output = f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    assert result.returncode != 0, output
    lines = [line for line in result.stderr.splitlines() if line.startswith("trainbridge: error:")]
    assert len(lines) == 1, output
    assert re.search(pattern, lines[0]), lines[0]
    # torchrun prints a traceback of its own (ChildFailedError); none may come from the worker's code.
    frames = re.findall(r'^\s*File "([^"]+)"', result.stderr, re.MULTILINE)
    assert all(re.search(r"/bin/torchrun$|/torch/distributed/", frame) for frame in frames), output
    if result.args[0] != TORCHRUN:
        assert "Traceback" not in result.stdout + result.stderr, output


INIT_WITH = str(SCRIPTS / "init_with.py")


@pytest.mark.matrix  # another program where one checks it under torchrun: trainbridge train (tests/test_bad_input.py)
def test_horovod_backend_under_torchrun_is_one_line():
    result = run(torchrun(2, INIT_WITH, ["backend=horovod"]), timeout=120)
    assert_one_clear_line(result, r"horovod.*torchrun")
    assert "initialized" not in result.stdout


@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_nccl_without_cuda_is_one_line(launcher):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: nccl is a valid choice here")
    cmd = python(INIT_WITH, ["backend=torch", "dist_backend=nccl"]) if launcher == "python" else \
        torchrun(2, INIT_WITH, ["dist_backend=nccl"])
    result = run(cmd, timeout=120)
    assert_one_clear_line(result, r"nccl.*CUDA")
    assert "initialized" not in result.stdout
    if launcher == "python":
        assert result.returncode == 2


@pytest.mark.parametrize("launcher", in_matrix(["torchrun", "mpirun", "spawn"], {"spawn"}))
def test_global_batch_not_divisible_by_the_ranks_is_one_line(launcher, tmp_path):
    # Raised by the user's own code after tb.init(), on every rank: still one line in all.
    args = ["--global-batch", "61", "--output-dir", str(tmp_path)]
    cmd = {"torchrun": torchrun(2, OWN_LOOP, args), "mpirun": mpirun(2, OWN_LOOP, args),
           "spawn": python(OWN_LOOP, args + ["--nproc", "2"])}[launcher]
    result = run(cmd, timeout=120)
    assert_one_clear_line(result, r"--global-batch 61 is not divisible by the 2 ranks.*multiple of 2")
    if launcher != "torchrun":  # torchrun exits 1 whatever its workers' status
        assert result.returncode == 2, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    assert not (tmp_path / "last.pt").exists()


MISSPELLED_FREEZE = """
import torch, trainbridge as tb
job = tb.init()
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
for p in model[0].parameters():
    p.require_grad = False  # the typo: a new attribute, nothing is frozen
job.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
print("prepared")
"""


def test_a_head_frozen_with_require_grad_is_refused_in_one_line():
    result = run([PYTHON, "-c", MISSPELLED_FREEZE], timeout=60)
    assert_one_clear_line(result, r"parameter '0\.weight' has an attribute require_grad.*requires_grad = False")
    assert result.returncode == 2
    assert "prepared" not in result.stdout
