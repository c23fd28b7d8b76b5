"""The watchdog bounds waits for the other ranks, never a rank's own work; signals reach DataLoader loops.

Real torchrun (and plain python) runs of tests/api_scripts/waits.py, whose job timeout
is 8 s, of examples/own_loop.py with DataLoader workers, and of trainbridge train's
DesignSafe task with its default workers.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import PLAIN_SGD, PYTHON, SAMPLE, TORCHRUN, TRAIN, Job, env_ranks, in_matrix, run, torchrun

from trainbridge.data.designsafe_sample import make_sample
from trainbridge.launch.rendezvous import free_port

ROOT = Path(__file__).resolve().parent.parent
WAITS = str(ROOT / "tests" / "api_scripts" / "waits.py")
OWN_LOOP = str(ROOT / "examples" / "own_loop.py")
OWN_LOOP_HELD = str(ROOT / "tests" / "api_scripts" / "own_loop_held.py")


def waits(mode: str, tmp_path: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return run([TORCHRUN, "--standalone", "--nproc-per-node=2", WAITS, mode, str(tmp_path)], timeout=timeout)


def error_lines(result: subprocess.CompletedProcess) -> dict:
    """rank -> its one error line (a rank may also have been stopped by the launcher before writing one)."""
    lines = re.findall(r"^trainbridge: error: rank (\d): (.*)$", result.stderr, re.MULTILINE)
    return {int(rank): text for rank, text in lines}


def survivors(tmp_path: Path) -> list:
    """Processes of this test's job still running (DataLoader workers that outlived their rank)."""
    return [p.pid for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]


def test_a_long_phase_without_collectives_is_not_cut_short(tmp_path):
    # Every rank computes 20 s (a long evaluation) with timeout 8 s. Before: the watchdog ended
    # every rank after 8 s with "another rank probably died or stalled", exit 124.
    result = waits("long_local_work", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "finished: 2" in result.stdout and "trainbridge: error" not in result.stderr


def test_a_stall_is_named_by_the_call_the_waiting_rank_is_in(tmp_path):
    # Rank 1 computes for 60 s while rank 0 waits in job.barrier. Before: both ranks' watchdogs
    # fired (rank 1 too, in its own work) and neither said where it waited.
    started = time.monotonic()
    result = waits("stall", tmp_path)
    # Under 60 s from launch: rank 1's 60 s of work was cut short, however long start-up took.
    assert result.returncode != 0 and time.monotonic() - started < 60, result.stderr[-3000:]
    lines = error_lines(result)
    assert set(lines) == {0}, result.stderr[-3000:]  # rank 1 was working, not waiting: no line of its own
    assert "in job.barrier at this process's step 2" in lines[0], lines[0]
    # Rank 0's barrier gave up at the job's timeout (gloo's own 8 s), not after rank 1's work.
    assert "Timed out waiting 8000ms" in lines[0] and "(timeout 8s)" in lines[0], lines[0]


def test_ranks_in_different_calls_read_as_a_mismatch(tmp_path):
    # A rank-0-only job.save (its collectives) against rank 1's job.barrier: each rank's line
    # names its own call, so the two lines side by side show the mismatch.
    result = waits("mismatch", tmp_path)
    assert result.returncode != 0, result.stderr[-3000:]
    lines = error_lines(result)
    assert lines, result.stderr[-3000:]
    expected = {0: "in job.save(", 1: "in job.barrier at this process's step 2"}
    for rank, line in lines.items():
        assert expected[rank] in line, line
    assert not (tmp_path / "rank0.pt").exists()  # the file is written only once every rank has its state


def test_a_rank_a_step_short_reads_as_a_mismatch(tmp_path):
    # Rank 0 trains a third step while rank 1 goes to job.barrier. Before: both lines read
    # "another rank probably died or stalled", though no rank had died.
    result = waits("step_short", tmp_path)
    assert result.returncode != 0, result.stderr[-3000:]
    lines = error_lines(result)
    assert lines, result.stderr[-3000:]
    expected = {0: "in job.backward (the gradient average) at this process's step 2",
                1: "in job.barrier at this process's step 2"}
    for rank, line in lines.items():
        assert expected[rank] in line and "probably died" not in line, line


def waits_without_a_launcher(mode: str, tmp_path: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """waits.py's two ranks started by the env:// variables alone: no launcher ends one rank when the
    other exits, so each rank's own wait ends in its own line. Their outputs and the first failure's exit."""
    procs = env_ranks([WAITS, mode, str(tmp_path)], free_port(), one_host=True)
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"waits.py {mode}: a rank still running after {timeout}s (a hang)")
    code = next((p.returncode for p in procs if p.returncode != 0), 0)
    return subprocess.CompletedProcess(mode, code, "".join(o for o, _ in outputs), "".join(e for _, e in outputs))


def test_a_stop_agreement_on_one_rank_only_reads_as_a_mismatch(tmp_path):
    # Rank 0 calls job.should_stop, rank 1 never does and goes on to its second forward, where DDP
    # takes rank 0's bucket order. Before: rank 1's line named no call (DDP's forward was not a
    # named wait), so it could not be told from a rank that had died. Under torchrun, rank 0's
    # timeout could end first, and torchrun then stopped rank 1 before its own line (CI, once).
    result = waits_without_a_launcher("stop_one_rank", tmp_path)
    assert result.returncode != 0, result.stderr[-3000:]
    lines = error_lines(result)
    assert set(lines) == {0, 1}, result.stderr[-3000:]
    expected = {0: "job.should_stop (the stop agreement) at this process's step 1",
                1: "the prepared model's forward (DDP's bucket sync) at this process's step 1"}
    for rank, line in lines.items():
        assert expected[rank] in line, line


def test_a_rank_ended_by_a_failure_leaves_no_dataloader_worker_behind(tmp_path):
    # Workers stuck in __getitem__ (prefetching) while their rank fails. Before: they survived
    # their rank, kept the launcher's output pipe open, and the job never ended (a CI hang).
    result = waits("stuck_worker", tmp_path, timeout=90)
    assert result.returncode != 0 and "worker" in result.stdout, result.stdout[-2000:] + result.stderr[-3000:]
    assert "in job.barrier" in error_lines(result).get(0, ""), result.stderr[-3000:]
    assert not survivors(tmp_path)


def test_sigterm_to_the_process_group_stops_a_loop_with_dataloader_workers(tmp_path):
    # SLURM and Kubernetes signal every process, DataLoader workers included. Before: the
    # workers died and the loop raised "DataLoader worker (pid N) is killed by signal:
    # Terminated": no stop checkpoint, exit 1.
    job = Job([PYTHON, OWN_LOOP, "--epochs", "12", "--workers", "2", "--output-dir", str(tmp_path)],
              tmp_path / "log")
    job.wait_for_output("epoch 1 step 25", timeout=120)
    workers = psutil.Process(job.proc.pid).children()
    assert len(workers) == 2, job.output()[-3000:]
    os.killpg(job.proc.pid, signal.SIGTERM)
    code = job.wait(timeout=60)
    log = job.output()
    assert code == 143 and "killed by signal" not in log, log[-3000:]
    assert re.search(r"stopped by SIGTERM after step \d+", log), log[-3000:]
    assert (tmp_path / "last.pt").exists() and not (tmp_path / "final.pt").exists()
    # The rank SIGKILLs its workers as it leaves; on a busy machine they may take a moment to be scheduled and
    # die. 2 s is well under the 5 s after which a DataLoader worker would notice its parent gone by itself.
    deadline = time.monotonic() + 2
    while alive(workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(workers)


# torchrun's agents meet before any worker starts, where --timeout cannot reach: the launchers guide gives the
# bound of each rendezvous. c10d's join_timeout is the matrix's: make test keeps the static rendezvous's.
@pytest.mark.parametrize("option", in_matrix(["timeout", "join_timeout"], ["join_timeout"]))
def test_a_torchrun_host_that_never_arrives_is_bounded_as_the_launchers_guide_says(option):
    assert f"--rdzv-conf {option}=" in (ROOT / "docs" / "guides" / "launchers.md").read_text()
    port = free_port()
    rendezvous = (["--master-addr", "127.0.0.1", "--master-port", str(port), "--node-rank", "0"] if option == "timeout"
                  else ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "alone"])
    started = time.monotonic()
    # Node 0 of 2, alone: before, it waited torchrun's default 600 s.
    result = run([TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", *rendezvous, "--rdzv-conf", f"{option}=5",
                  *TRAIN, *SAMPLE, "--max-steps", "1"], timeout=120)
    assert result.returncode != 0 and "[trainbridge]" not in result.stdout, result  # no worker started
    assert time.monotonic() - started < 60, result.stderr[-2000:]
    assert "clients joined" in result.stderr or "RendezvousTimeoutError" in result.stderr, result.stderr[-2000:]


def test_ctrl_c_to_a_torchrun_job_stops_every_rank_at_one_step_with_its_checkpoint(tmp_path):
    # Ctrl-C: SIGINT to the terminal's whole process group, torchrun's agent and every worker. Before: a
    # KeyboardInterrupt traceback from each worker, and no stop checkpoint.
    args = SAMPLE + PLAIN_SGD + ["--epochs", "30", "--threads", "1", "--output-dir", str(tmp_path)]
    job = Job(torchrun(2, args), tmp_path / "log")
    job.wait_for_output("epoch 1 step", timeout=120)
    os.killpg(job.proc.pid, signal.SIGINT)
    assert job.wait(timeout=90) != 0
    log = job.output()
    assert "KeyboardInterrupt" not in log, log[-3000:]
    stops = re.findall(r"stopped by SIGINT after step (\d+)", log)
    assert len(stops) == 1, log[-3000:]
    assert torch.load(tmp_path / "last.pt", weights_only=True)["step"] == int(stops[0])
    assert not (tmp_path / "final.pt").exists()


# Another program where others check it under torchrun in make test: a loop with DataLoader workers (above, and
# the own loop in tests/test_api.py), each stopped by SIGTERM to the process group.
@pytest.mark.matrix
def test_sigterm_to_the_process_group_stops_designsafe_with_its_default_workers(tmp_path):
    # trainbridge train's DesignSafe task starts DataLoader workers by default (the cores shared by the
    # ranks). Before: SIGTERM to the group killed them and every rank died with "DataLoader worker
    # (pid N) is killed by signal: Terminated", without a stop checkpoint.
    sample, out = tmp_path / "sample", tmp_path / "out"
    make_sample(str(sample), seed=0)
    job = Job(torchrun(2, ["--task", "designsafe", "--no-pretrained", "--image-size", "64", "--batch-size", "8",
                           "--epochs", "50", "--no-progress", "--data-root", str(sample), "--output-dir", str(out)]),
              tmp_path / "log")
    job.wait_for_output("[trainbridge] epoch 1 step", timeout=300)
    workers = re.search(r"; (\d+) loader workers per rank", job.output())
    assert workers and int(workers.group(1)) >= 1, job.output()[-3000:]
    os.killpg(job.proc.pid, signal.SIGTERM)
    code = job.wait(timeout=120)
    log = job.output()
    assert code != 0 and "killed by signal" not in log and "trainbridge: error" not in log, log[-3000:]
    assert len(re.findall(r"stopped by SIGTERM after step \d+", log)) == 1, log[-3000:]
    assert (out / "last.pt").exists() and not (out / "final.pt").exists()


def alive(processes):
    """The processes still running (a zombie has ended: only its exit status is left)."""
    running = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                running.append(process)
        except psutil.NoSuchProcess:
            pass
    return running


def test_a_stop_agreed_at_an_epoch_end_is_not_lost():
    # The loop drains the agreement before evaluating (job.drain_stop) and ignores the answer,
    # as examples/own_loop.py did. Before: the next should_stop() started a new agreement and
    # said False, so the stop came an epoch late, or never after the last epoch.
    from trainbridge.api.stop import StopSignal

    stop = StopSignal(lambda tensor, op, name: (lambda: tensor))  # one rank: the agreement is its own flag
    stop.asked = True
    assert stop.agreed() is False
    stop.received = True  # SIGTERM during the epoch's last step
    assert stop.agreed() is False  # read one step late
    assert stop.drain() is True  # the epoch end drains it
    assert stop.agreed() is True and stop.drain() is True


def test_ctrl_c_under_tb_spawn_stops_the_workers_in_order(tmp_path):
    # Ctrl-C: SIGINT to the terminal's whole process group. Before: a KeyboardInterrupt traceback
    # from the parent and from every worker, interleaved, and no stop checkpoint.
    # The workers hold after step 30 until their SIGTERM (the parent's answer to Ctrl-C) arrives: the example's
    # 300 steps take seconds, and a signal sent later on a busy machine found training over (seen: exit 0).
    job = Job([PYTHON, OWN_LOOP_HELD, "--nproc", "2", "--epochs", "12", "--output-dir", str(tmp_path)],
              tmp_path / "log", env={"HOLD_RANKS": "0,1"})
    job.wait_for_output("rank 1 holds after step 30", timeout=120)
    job.wait_for_output("rank 0 holds after step 30", timeout=60)
    os.killpg(job.proc.pid, signal.SIGINT)
    code = job.wait(timeout=90)
    log = job.output()
    assert code == 130, log[-3000:]
    assert log.count("trainbridge: interrupted: stopping the 2 workers") == 1, log[-3000:]
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]
    assert re.search(r"stopped by SIGTERM after step \d+", log) and (tmp_path / "last.pt").exists(), log[-3000:]


@pytest.mark.matrix  # the spawner, another launcher: make test keeps a bug's traceback under torchrun (below)
def test_a_bug_under_tb_spawn_keeps_its_traceback(tmp_path):
    # Before: "trainbridge: error: a spawned worker failed: KeyError: 'missing'" and no frame.
    script = tmp_path / "bug.py"
    script.write_text("import trainbridge as tb\n\n\ndef lookup(table):\n    return table['missing']\n\n\n"
                      "def main():\n    tb.init()\n    lookup({})\n\n\n"
                      "if __name__ == '__main__':\n    raise SystemExit(tb.spawn(main, 2))\n")
    result = run([PYTHON, str(script)], timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    assert re.search(r"trainbridge: error: spawned worker \d failed: KeyError: 'missing'; its traceback:",
                     result.stderr), result.stderr[-3000:]
    assert re.search(r'File ".*bug\.py", line 5, in lookup', result.stderr), result.stderr[-3000:]


def test_a_bug_under_torchrun_keeps_its_traceback_and_exits_1_with_the_group_alive(tmp_path):
    # A bug after a DDP step, with DataLoader workers live: its traceback, exit status 1
    # (not SIGABRT from a gloo group alive at the interpreter's teardown), no worker left behind.
    script = tmp_path / "bug.py"
    script.write_text(
        "import torch\nimport trainbridge as tb\n\n\ndef lookup(table):\n    return table['missing']\n\n\n"
        "job = tb.init()\nmodel = torch.nn.Linear(4, 2)\n"
        "model, opt = job.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))\n"
        "data = torch.utils.data.TensorDataset(torch.randn(32, 4))\n"
        "for (x,) in job.train_loader(data, batch_size=4, num_workers=1):\n"
        "    job.backward(model(x).sum())\n    job.step(opt)\n    lookup({})\n")
    result = run([TORCHRUN, "--standalone", "--nproc-per-node=2", str(script)], timeout=120)
    log = result.stdout + result.stderr
    assert result.returncode == 1, log[-3000:]
    # torchrun stops the other rank once the first has exited: it may be gone before its traceback.
    assert re.search(r'File ".*bug\.py", line 6, in lookup', log), log[-3000:]
    assert "exitcode  : 1" in log and "exitcode  : -6" not in log and "Signal 6" not in log, log[-3000:]
    assert not survivors(tmp_path)


def test_a_worker_that_never_delivers_a_batch_ends_its_rank_with_one_line(tmp_path):
    # Each rank's DataLoader workers deliver 4 batches, then hang in a read. Waiting for one's own
    # workers is bounded like a wait for a peer: one line, the workers killed, the job ended.
    result = waits("stuck_read", tmp_path, timeout=90)
    assert result.returncode != 0, result.stderr[-3000:]
    lines = error_lines(result)
    assert lines, result.stderr[-3000:]
    for line in lines.values():
        assert re.match(r"waited \d+s in train_loader's next batch at this process's step 4 for this rank's "
                        r"DataLoader workers", line), line
    # Each stuck worker's stacks follow the line (py-spy is in the test extra): the read it is stuck in.
    assert "py-spy dump" in result.stderr and "__getitem__ (waits.py" in result.stderr, result.stderr[-3000:]
    assert not survivors(tmp_path)
