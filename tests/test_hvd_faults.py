"""``trainbridge.hvd`` where jobs meet trouble: busy ranks outside a process set, stale commit files, and
elastic state of Horovod users' everyday values, under real torchrun launches (each with a timeout)."""
import os
import re
import signal
import socket
from pathlib import Path

import torch
from conftest import PYTHON, TORCHRUN, check, run

from trainbridge.hvd.elastic import commit_file

SCRIPTS = Path(__file__).parent / "hvd_scripts"
TIMEOUT = 120


def test_process_set_collectives_do_not_wait_for_a_sleeping_rank_outside_the_set():
    """Rank 0 sleeps 5 s; ranks 1 and 2 run a barrier, an allreduce and a broadcast on their own set.
    (Before: the barrier took 5.00 s, and the global barrier after it hung. The real Horovod: 0.01 s.)"""
    result = check(run([TORCHRUN, "--standalone", "--nproc-per-node=3", str(SCRIPTS / "process_set_barrier.py")],
                       timeout=TIMEOUT, env={"SLEEP_S": "5"}))
    # The ranks share torchrun's stdout, so one rank's line can run into another's: numbers only.
    timings = re.findall(r"SET rank=(\d) barrier_s=([\d.]+) allreduce_s=([\d.]+) broadcast_s=([\d.]+) sum=([\d.]+)",
                         result.stdout)
    assert sorted(rank for rank, *_ in timings) == ["1", "2"], result.stdout[-3000:]
    for _rank, barrier_s, allreduce_s, broadcast_s, total in timings:
        assert max(float(barrier_s), float(allreduce_s), float(broadcast_s)) < 2.5, result.stdout[-3000:]
        assert float(total) == 1 + 2
    # The global barrier still waits for the sleeper.
    done = dict(re.findall(r"DONE rank=(\d) waited_s=([\d.]+)", result.stdout))
    assert sorted(done) == ["0", "1", "2"] and min(map(float, done.values())) >= 4.5, result.stdout[-3000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_run_id_none(max_restarts: int, *args: str, tmp: Path):
    """Plain torchrun with a static rendezvous (``--master-port``): its run id is torchrun's default "none",
    as every such job's is; TMPDIR keeps the default commit directory inside the test's own folder."""
    command = [TORCHRUN, f"--master-port={_free_port()}", "--nproc-per-node=2", f"--max-restarts={max_restarts}",
               "--monitor-interval=0.1", str(SCRIPTS / "elastic_job_identity.py"), *args]
    return run(command, timeout=TIMEOUT, env={"TMPDIR": str(tmp)})


def _starts(output: str, attempt: int):
    return re.findall(rf"START attempt={attempt} rank=\d epoch=(\d+) weight=(\S+)", output)


def test_a_new_job_never_resumes_from_an_earlier_jobs_commit_file(tmp_path):
    commit_dir = tmp_path / f"trainbridge-elastic-{os.geteuid()}-none"
    # An earlier job with the same run id commits 2 epochs, then fails for good (no restart left).
    earlier = _torchrun_run_id_none(0, "--fail-at-epoch", "2", tmp=tmp_path)
    assert earlier.returncode != 0 and "COMMIT attempt=0 epoch=2" in earlier.stdout, earlier.stdout[-3000:]
    assert (commit_dir / "state.pt").exists()
    # A new job fails before its first commit; its restart must begin at the initial state, not at epoch 2.
    result = check(_torchrun_run_id_none(1, "--fail-at-epoch", "0", tmp=tmp_path))
    out = result.stdout
    assert "FAIL rank=1 epoch=0" in out and _starts(out, 1) == [("0", "0")] * 2, out[-3000:]
    assert "left by an earlier job" in out, out[-3000:]
    assert "resumed from the last commit" not in out
    assert sorted(re.findall(r"DONE rank=(\d) epoch=3 weight=3 ", out)) == ["0", "1"], out[-3000:]
    # It ended well: no commit file (nor directory) is left for the next job to find.
    assert not commit_dir.exists(), sorted(p.name for p in commit_dir.iterdir())


def test_a_restart_ignores_a_commit_file_written_by_another_job(tmp_path):
    result = check(_torchrun_run_id_none(1, "--fail-at-epoch", "0", "--foreign-commit", tmp=tmp_path))
    out = result.stdout
    ignored = [line for line in out.splitlines() if line.startswith("hvd.elastic: ignoring")]
    assert len(ignored) == 1 and "written by another torchrun job (none@another-torchrun" in ignored[0], out[-3000:]
    assert _starts(out, 1) == [("0", "0")] * 2, out[-3000:]
    assert not (tmp_path / f"trainbridge-elastic-{os.geteuid()}-none").exists()


def test_a_restart_restores_numpy_named_tuple_defaultdict_and_enum_values(tmp_path):
    """Values that torch.load(weights_only=True) refuses as such come back equal and of their own type.
    (Before: the commit file could not be loaded, every restart failed and the job died.)"""
    result = check(_torchrun_run_id_none(1, "--fail-at-epoch", "2", "--typed-values", tmp=tmp_path))
    out = result.stdout
    assert "resumed from the last commit" in out, out[-3000:]
    expected = ("np.float64(0.5)/float64 Best(epoch=2, loss=np.float32(0.5)) {'epoch1': 1, 'epoch2': 1}"
                "/defaultdict:int <Phase.TRAIN: 1>")
    restarted = re.findall(r"START attempt=1 rank=\d epoch=2 weight=2 values=(.*)", out)
    assert restarted == [expected] * 2, out[-3000:]
    assert sorted(re.findall(r"DONE rank=(\d) epoch=3 weight=3 ", out)) == ["0", "1"], out[-3000:]


def test_a_commit_that_returned_survives_a_sigterm_during_its_write(tmp_path):
    """The commit file is written on a thread; the SIGTERM torchrun sends after a peer's crash waits for it."""
    result = run([PYTHON, str(SCRIPTS / "elastic_commit_sigterm.py")], timeout=TIMEOUT,
                 env={"TRAINBRIDGE_ELASTIC_DIR": str(tmp_path)})
    assert result.returncode == -signal.SIGTERM, (result.returncode, result.stdout[-2000:], result.stderr[-3000:])
    assert "COMMITTED epoch=3" in result.stdout and "NOT STOPPED" not in result.stdout, result.stdout
    snapshot = commit_file.load(str(tmp_path / "state.pt"))
    assert snapshot["objects"]["epoch"] == 3
    assert torch.equal(snapshot["handlers"]["model"]["weight"], torch.full((8192, 4096), 3.0))
