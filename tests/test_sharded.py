"""Sharded models (``job.prepare(..., shard=True)``, FSDP2 on the torch backend) under real launchers.

The float64 program of tests/api_scripts/same_model_programs/sharded.py runs with every launcher
in tests/test_same_model.py (within 1e-9 of one process; refused in one line under Horovod), which
also resumes its sharded checkpoint at other world sizes. Here: bf16 against DDP, CPU offload,
named blocks, export (the API and the command), a model sharded by the user, and the faults:
SIGTERM and SIGKILL of examples/own_loop.py --shard resume bitwise.
"""
import os
import re
import signal
from pathlib import Path

import pytest
import torch
from conftest import HOROVODRUN, PYTHON, TORCHRUN, Job, bitwise_equal, check, load_final, run

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "api_scripts"
CHECKS = str(SCRIPTS / "sharded_checks.py")
OWN_LOOP = str(ROOT / "examples" / "own_loop.py")
OWN_LOOP_HELD = str(SCRIPTS / "own_loop_held.py")
LONG = ["--epochs", "12", "--shard"]  # 300 steps: a signal sent at step 30 lands mid-training
LONG_STEPS = 300


def torchrun(nproc, script, args, restarts=None):
    extra = [] if restarts is None else [f"--max-restarts={restarts}"]
    return [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", *extra, script, *args]


def test_sharded_checks_under_torchrun(tmp_path):
    result = check(run(torchrun(2, CHECKS, [str(tmp_path)]), timeout=240))
    numbers = torch.load(tmp_path / "checks.pt", weights_only=True)
    assert numbers["cpu_offload"] < 1e-12 and numbers["named_blocks"] < 1e-12, numbers
    assert numbers["export"] == 0.0 and numbers["user_sharded"] == 0.0, numbers
    assert "holds sharded tensors (DTensor)" in numbers["dtensor_dict"] and "\n" not in numbers["dtensor_dict"]
    assert "Traceback" not in result.stderr
    # The command writes the user-sharded checkpoint's model as the file the job gathered.
    exported = tmp_path / "exported_by_command.pt"
    command = check(run([PYTHON, "-m", "trainbridge", "export", str(tmp_path / "user_sharded"), str(exported)],
                        timeout=120))
    assert "22 tensors" in command.stdout, command.stdout
    assert bitwise_equal(torch.load(exported, weights_only=True), torch.load(tmp_path / "user_whole.pt",
                                                                             weights_only=True))
    refused = run([PYTHON, "-m", "trainbridge", "export", str(tmp_path / "user_sharded"), str(exported), "--key",
                   "optimizer"], timeout=120)
    assert refused.returncode == 2 and refused.stderr.startswith("trainbridge: error: ") and \
        refused.stderr.count("\n") == 1, refused.stderr


def test_bf16_sharded_against_ddp_bf16(tmp_path):
    check(run(torchrun(2, CHECKS, [str(tmp_path), "--bf16"]), timeout=240))
    numbers = torch.load(tmp_path / "bf16.pt", weights_only=True)
    # Stated tolerance 1e-3 after 8 SGD steps (checked in the script); DDP bf16 itself is as far from float32.
    assert numbers["bf16"] < 1e-3 and numbers["ddp_bf16_vs_fp32"] > 0, numbers


def test_horovod_refuses_sharding_in_one_line(tmp_path):
    result = run([HOROVODRUN, "-np", "2", "--gloo", PYTHON, OWN_LOOP, "--shard", "--output-dir", str(tmp_path)],
                 timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert re.search(r"trainbridge: error: job\.prepare\(shard=\.\.\.\): sharded models need the torch backend "
                     r"\(FSDP2\), not horovod; launch with torchrun", output), output[-3000:]
    assert "Exit code: 2" in output, output[-3000:]  # horovodrun's report of the first worker's exit
    workers = "\n".join(line for line in output.splitlines() if re.match(r"\[\d\]<std", line))
    assert "Traceback" not in workers, workers[-3000:]  # (horovodrun prints one of its own on a failed worker)


@pytest.fixture(scope="module")
def sharded_reference(tmp_path_factory):
    """An uninterrupted float32 run of examples/own_loop.py --shard under torchrun with 2 processes."""
    out = tmp_path_factory.mktemp("own_loop_sharded")
    check(run(torchrun(2, OWN_LOOP, LONG + ["--output-dir", str(out)]), timeout=240))
    final = load_final(out)
    assert (final["step"], final["world_size"]) == (LONG_STEPS, 2)
    return final["model"]


def test_sigterm_writes_a_sharded_checkpoint_and_the_next_launch_resumes_bitwise(tmp_path, sharded_reference):
    job = Job(torchrun(2, OWN_LOOP_HELD, LONG + ["--output-dir", str(tmp_path)]), tmp_path / "log",
              env={"HOLD_RANKS": "0,1"})
    job.wait_for_output("rank 1 holds after step 30", timeout=120)
    os.killpg(job.proc.pid, signal.SIGTERM)  # as SLURM and Kubernetes send it; torchrun forwards it
    assert job.wait(timeout=90) != 0
    log = job.output()
    stops = re.findall(r"stopped by SIGTERM after step (\d+)", log)
    assert len(stops) == 1 and 30 <= int(stops[0]) <= 32, log[-3000:]
    assert "trainbridge: error" not in log, log[-3000:]  # (a signalled torchrun prints a traceback of its own)
    assert (tmp_path / "last.pt" / ".metadata").is_file()  # a folder of both ranks' shards
    assert sorted(p.name for p in (tmp_path / "last.pt").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    result = check(run(torchrun(2, OWN_LOOP, LONG + ["--output-dir", str(tmp_path)]), timeout=240))
    assert f"step {stops[0]}" in result.stdout, result.stdout[-3000:]
    final = load_final(tmp_path)
    assert final["step"] == LONG_STEPS and bitwise_equal(final["model"], sharded_reference)


def test_sigkill_of_a_rank_under_max_restarts_resumes_bitwise(tmp_path, sharded_reference):
    # Rank 1 is held in its 30th step, after last.pt of step 28 (mid-epoch 2), and killed there; torchrun restarts
    # both workers, which resume from that sharded checkpoint.
    job = Job(torchrun(2, OWN_LOOP_HELD, LONG + ["--checkpoint-every", "7", "--output-dir", str(tmp_path)],
                       restarts=1), tmp_path / "log", env={"HOLD_RANKS": "1"})
    job.wait_for_output("rank 1 holds after step 30", timeout=120)
    _worker(job, 1).kill()  # SIGKILL
    assert job.wait(timeout=180) == 0, job.output()[-3000:]
    log = job.output()
    assert re.search(r"resumed from .*last\.pt: epoch 2, step 28$", log, re.MULTILINE), log[-3000:]
    final = load_final(tmp_path)
    assert final["step"] == LONG_STEPS and bitwise_equal(final["model"], sharded_reference)


def _worker(job: Job, rank: int):
    import psutil

    for child in psutil.Process(job.proc.pid).children(recursive=True):
        try:
            environ, cmdline = child.environ(), child.cmdline()
        except psutil.Error:
            continue
        if OWN_LOOP_HELD in cmdline and environ.get("RANK") == str(rank):
            return child
    pytest.fail(f"no worker with rank {rank}:\n{job.output()[-3000:]}")
