"""Bad input: one clear line naming the problem and the fix, a non-zero exit, no traceback from our code."""
import re
import subprocess

import pytest
from conftest import PYTHON, SAMPLE, TRAIN, check, plain, run, torchrun, train_here

QUICK = [*SAMPLE, "--max-steps", "2"]
def assert_one_clear_line(result: subprocess.CompletedProcess, pattern: str) -> None:
    assert result.returncode != 0, result.stdout + result.stderr
    # horovodrun prefixes each worker line with "[rank]<stderr>:"; that prefix is the launcher's.
    lines = [re.sub(r"^\[\d+\]<stderr>:", "", line) for line in result.stderr.splitlines()]
    lines = [line for line in lines if line.startswith("trainbridge: error:")]
    assert len(lines) == 1, result.stderr
    assert re.search(pattern, lines[0]), lines[0]
    # No Python traceback out of trainbridge itself (torchrun prints its own summary).
    assert not re.search(r'File ".*trainbridge/', result.stderr), result.stderr


def test_horovod_backend_under_torchrun_is_refused(tmp_path):
    result = run(torchrun(2, QUICK + ["--backend", "horovod", "--output-dir", str(tmp_path)]), timeout=120)
    assert_one_clear_line(result, r"cannot run under torchrun.*size 1.*horovodrun -np 2")
    assert not (tmp_path / "final.pt").exists()


def test_local_backend_under_a_multi_process_launcher_is_refused(tmp_path):
    result = run(torchrun(2, QUICK + ["--backend", "local", "--output-dir", str(tmp_path)]), timeout=120)
    assert_one_clear_line(result, r"--backend local runs one process.*torchrun started 2")


def test_an_output_dir_that_is_not_utf8_is_printed_not_a_traceback(tmp_path):
    # Its name reaches Python as a lone surrogate; train_here's stdout is a strict UTF-8 file, as a terminal's
    # is under an ordinary UTF-8 locale. Before: the run trained, wrote final.pt, then died at its "done:" line.
    out = str(tmp_path / "runs\udcff")
    result = check(train_here(QUICK + ["--model", "plaincnn", "--output-dir", out]))
    assert f"wrote {str(tmp_path)}/runs\\udcff/final.pt" in result.stdout, result.stdout[-2000:]


def test_nccl_without_cuda(tmp_path):
    result = train_here(QUICK + ["--backend", "torch", "--dist-backend", "nccl", "--output-dir", str(tmp_path)])
    assert_one_clear_line(result, r"nccl was requested but CUDA is not available.*gloo")


def test_horovod_missing(tmp_path):
    # A horovod package without its PyTorch extension, first on the path.
    fake = tmp_path / "fake" / "horovod"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    result = run(plain(QUICK + ["--backend", "horovod", "--output-dir", str(tmp_path / "out")]), timeout=60,
                 env={"PYTHONPATH": str(tmp_path / "fake")})
    assert_one_clear_line(result, r"Horovod cannot run this job: horovod.torch does not import \(.*\); "
                                  r"trainbridge build-horovod builds and installs one against this torch")


def test_missing_data_root(tmp_path):
    result = train_here(QUICK + ["--data-root", str(tmp_path / "nope"), "--output-dir", str(tmp_path)])
    assert_one_clear_line(result, r"--data-root .*nope does not exist")


@pytest.mark.parametrize("flag,value", [("--batch-size", "0"), ("--epochs", "0"), ("--max-steps", "-1")])
def test_bad_numbers(flag, value, tmp_path):
    result = train_here(QUICK + [flag, value, "--output-dir", str(tmp_path)])
    assert_one_clear_line(result, rf"{flag} must be at least 1 \(got {value}\)")


def test_ranks_that_disagree_on_the_world_size(tmp_path):
    # Two real processes whose (misconfigured) launcher told them different sizes.
    from trainbridge.launch.rendezvous import free_port

    port = str(free_port())
    procs = []
    for rank, world in ((0, 2), (1, 3)):
        env = {"TRAINBRIDGE_SPAWNED": "1", "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        from conftest import launcher_env
        procs.append(subprocess.Popen([PYTHON, *TRAIN, *QUICK, "--backend", "torch", "--timeout", "60",
                                       "--output-dir", str(tmp_path)], env=launcher_env(env),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=60))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("ranks that disagree on the world size hung")
    assert all(p.returncode != 0 for p in procs)
    assert "ranks disagree on the world size: rank 0 was launched with 2 processes, rank 1 with 3" in outputs[0][1]
    assert "rank 1 was launched with 3 processes, rank 0 with 2" in outputs[1][1]
