"""Checkpoints in the way of another writer or of the file system: one line, nothing good lost, nothing left over.

Two jobs in one --output-dir (the second stops at once, touching nothing), two writers of
one path (no collision), and saves that cannot succeed: a read-only place, a path that is
a directory, a value that cannot be pickled.
"""
import subprocess
import textwrap

import pytest
import torch
from conftest import PLAIN_SGD, PYTHON, SAMPLE, Job, launcher_env, plain, run, torchrun, train_here
from test_bad_input import assert_one_clear_line

QUICK = [*SAMPLE, *PLAIN_SGD]
IN_USE = (r"--output-dir .* is in use by another job \(host .*, pid {pid}\): this one would resume from its live "
          r"checkpoints and write over them; wait for it to finish, or pass another --output-dir")


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder holding a good checkpoint, made read-only by a bind mount (root ignores permission bits)."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    torch.save({"w": torch.ones(2)}, folder / "good.pt")
    bound = subprocess.run(["mount", "--bind", str(folder), str(folder)], capture_output=True, text=True)
    if bound.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {bound.stderr.strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], check=True, capture_output=True)
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_second_job_in_a_busy_output_dir_stops_at_once_and_touches_nothing(tmp_path):
    out = tmp_path / "out"
    first = Job(plain(QUICK + ["--epochs", "200", "--output-dir", str(out)]), tmp_path / "first.log")
    try:
        first.wait_for_output("[trainbridge] epoch 1 step", timeout=120)  # last.pt exists and is being rewritten
        held = IN_USE.format(pid=first.proc.pid)
        # The same global batch at 2 ranks: without the lock this run would resume from the live last.pt
        # (and, with --max-steps, soon write over it).
        second = run(torchrun(2, QUICK + ["--batch-size", "50", "--epochs", "200", "--max-steps", "1",
                                          "--output-dir", str(out)]), timeout=90)
        assert_one_clear_line(second, held)
        assert "resuming from" not in second.stdout
        fresh = train_here(QUICK + ["--resume", "never", "--max-steps", "1", "--output-dir", str(out)])
        assert_one_clear_line(fresh, held)
        assert not list(out.glob("previous-run-*")) and (out / "last.pt").exists()  # nothing moved aside
        assert first.proc.poll() is None, first.output()[-3000:]
    finally:
        first.kill()  # SIGKILL: the kernel drops the dead job's lock
        first.wait(timeout=30)
    after_crash = Job(plain(QUICK + ["--epochs", "200", "--output-dir", str(out)]), tmp_path / "after.log")
    try:
        after_crash.wait_for_output("resuming from", timeout=120)
    finally:
        after_crash.kill()
        after_crash.wait(timeout=30)


WRITER = textwrap.dedent("""
    import sys, torch, trainbridge as tb
    job = tb.init()
    path, background = sys.argv[1], sys.argv[2] == "background"
    for step in range(40):
        job.save({"w": torch.full((2 ** 18,), float(step)), "step": step}, path, keep_previous=path + ".previous",
                 background=background)
    job.shutdown()
    print("saved 40", flush=True)
""")


def test_two_writers_of_one_path_never_collide(tmp_path):
    path = tmp_path / "last.pt"
    writers = [subprocess.Popen([PYTHON, "-c", WRITER, str(path), mode], env=launcher_env(), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
               for mode in ("foreground", "background")]
    try:
        results = [w.communicate(timeout=120) for w in writers]
    finally:
        for w in writers:
            w.kill()
    for writer, (out, err) in zip(writers, results):
        assert writer.returncode == 0 and "saved 40" in out, err
    for name in ("last.pt", "last.pt.previous"):
        state = torch.load(tmp_path / name, weights_only=True)
        assert bool((state["w"] == state["step"]).all())  # whole, one writer's
    assert not list(tmp_path.glob(".*.tmp"))


SAVER = textwrap.dedent("""
    import sys, torch, trainbridge as tb

    class Holder:  # a type loads allow, holding a lambda that pickle refuses
        def __init__(self):
            self.fn = lambda x: x

    torch.serialization.add_safe_globals([Holder])
    job = tb.init()
    path, what, background = sys.argv[1], sys.argv[2], sys.argv[3] == "background"
    state = {"w": torch.zeros(4), **({"holder": Holder()} if what == "lambda" else {})}
    job.save(state, path, keep_previous=path + ".previous", background=background)
    job.shutdown()
    print("saved", flush=True)
""")


def save(path, what: str, mode: str) -> subprocess.CompletedProcess:
    return run([PYTHON, "-c", SAVER, str(path), what, mode], timeout=60)


def files(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("mode", ["foreground", "background"])
def test_save_to_a_read_only_place_is_one_line(read_only_dir, mode):
    before = files(read_only_dir)
    result = save(read_only_dir / "good.pt", "plain", mode)
    assert_one_clear_line(result, r"cannot write the checkpoint .*good\.pt: Read-only file system; the checkpoints "
                                  r"already in .* are unchanged; make .* writable or save to another folder")
    assert files(read_only_dir) == before


@pytest.mark.parametrize("mode", ["foreground", "background"])
def test_save_to_a_path_that_is_a_directory_is_one_line(tmp_path, mode):
    target = tmp_path / "ckpt.pt"
    target.mkdir()
    (target / "inside.txt").write_text("mine")
    before = files(tmp_path)
    result = save(target, "plain", mode)
    assert_one_clear_line(result, r"cannot write the checkpoint .*ckpt\.pt: .*ckpt\.pt is an existing directory, "
                                  r"not a file; nothing was written .*give a file path")
    assert files(tmp_path) == before and not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("mode", ["foreground", "background"])
def test_save_of_a_value_that_cannot_be_pickled_is_one_line(tmp_path, mode):
    good = tmp_path / "last.pt"
    torch.save({"w": torch.ones(4)}, good)
    before = files(tmp_path)
    result = save(good, "lambda", mode)
    assert_one_clear_line(result, r"cannot write the checkpoint .*last\.pt: a value in it cannot be pickled "
                                  r"\(.*lambda.*\); the checkpoints already in .* are unchanged; save plain values")
    assert files(tmp_path) == before and not list(tmp_path.glob(".*.tmp"))


def test_read_only_output_dir_stops_before_training(read_only_dir):
    result = run(torchrun(2, QUICK + ["--epochs", "1", "--output-dir", str(read_only_dir)]), timeout=90)
    assert_one_clear_line(result, r"--output-dir .*read-only is not writable \(Read-only file system\); pass a folder")
    assert "epoch 1" not in result.stdout
