"""Background checkpoint writes: a kill, a full disk and SIGTERM during a write lose nothing."""
import signal
import subprocess
import time
from pathlib import Path

import torch
from conftest import PYTHON, launcher_env, run
from test_bad_input import assert_one_clear_line

SCRIPT = str(Path(__file__).parent / "api_scripts" / "background_save.py")
MIB = 256  # a write takes a while: there is a moment to hit


def consistent(path: Path) -> int:
    """The step a checkpoint file holds, after checking that its tensor is the snapshot of that step."""
    state = torch.load(path, weights_only=True)
    assert bool((state["big"] == state["step"]).all()), f"{path} holds a torn state"
    return state["step"]


def start(out: Path, steps: int) -> subprocess.Popen:
    return subprocess.Popen([PYTHON, SCRIPT, str(out), str(steps), str(MIB)], env=launcher_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_write(out: Path, proc: subprocess.Popen, after: int = 0, timeout: float = 120) -> None:
    """Until a background write is in flight (its temporary file exists) after ``after`` files were done."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if list(out.glob(".last.pt.*.tmp")) and (after == 0 or (out / "previous.pt").exists()):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.005)
    raise AssertionError("no background write was seen")


def test_kill_during_a_background_write_leaves_the_last_complete_checkpoint(tmp_path):
    proc = start(tmp_path, 1000)
    try:
        wait_for_write(tmp_path, proc, after=1)  # last.pt exists; the next write is in flight
        proc.kill()
        proc.wait(timeout=30)
    finally:
        proc.kill()
    step = consistent(tmp_path / "last.pt")
    assert step >= 1 and consistent(tmp_path / "previous.pt") == step - 1


def test_full_disk_during_a_background_write_is_one_line_and_keeps_nothing_torn(tmp_path):
    limited = ["bash", "-c", f'ulimit -f {64 * 1024}; trap "" XFSZ; exec "$@"', "bash",
               PYTHON, SCRIPT, str(tmp_path), "5", str(MIB)]
    result = run(limited, timeout=120)
    assert result.returncode == 2
    assert_one_clear_line(result, r"cannot write the checkpoint .*last\.pt: File too large")
    assert not (tmp_path / "last.pt").exists() and not list(tmp_path.glob(".*.tmp"))
    # The failed write of step 1 is raised by the next save, before step 2 is submitted.
    assert "submitted step 1" in result.stdout and "submitted step 2" not in result.stdout


def test_sigterm_during_a_background_write_waits_for_it_and_saves_the_stop(tmp_path):
    proc = start(tmp_path, 1000)
    try:
        wait_for_write(tmp_path, proc, after=1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    stopped = int(out.split("stopped at step ")[1].split()[0])
    assert consistent(tmp_path / "last.pt") == stopped and consistent(tmp_path / "previous.pt") == stopped - 1
