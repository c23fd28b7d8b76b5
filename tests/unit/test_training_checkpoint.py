"""trainbridge.training.checkpoint: which checkpoint a run resumes from, one job per output
directory, and setting an earlier run's files aside."""
import os
import socket

import pytest
import torch
from other_user import as_other_user, needs_another_user, other_uid, shared_dir  # noqa: F401 - a fixture
from python_child import run_python
from test_api_files import flip_bit

from trainbridge.api.files import atomic_save
from trainbridge.errors import UserError
from trainbridge.training.checkpoint import (
    FORMAT,
    LOCK,
    choose_resume,
    load_model_state,
    lock_output_dir,
    read_checkpoint,
    set_aside_previous_run,
)


class Notes(list):
    """The ``note`` callback: what the run would print."""

    def __call__(self, line: str) -> None:
        self.append(line)


def layout(step: int) -> dict:
    """A checkpoint of this release's layout (what the loop reads from one) at ``step``."""
    progress = {"epoch": 0, "position": 0, "step": step, "samples": 0, "best_accuracy": None, "best_loss": None,
                "best_epoch": None}
    return {"format": FORMAT, "step": step, "model": {"w": torch.full((2,), float(step))}, "optimizer": {},
            "scheduler": {}, "progress": progress, "config": {}, "world_size": 1}


def write_checkpoint(path, step: int) -> None:
    atomic_save(layout(step), str(path))


def write_corrupt(path) -> None:
    path.write_bytes(b"PK\x03\x04 not a whole zip")


# ----- choose_resume ----------------------------------------------------------------------------
def test_never_starts_afresh_whatever_is_there(tmp_path):
    write_checkpoint(tmp_path / "last.pt", 5)
    assert choose_resume("never", str(tmp_path), Notes()) == (None, None)


def test_auto_in_an_empty_folder_starts_afresh(tmp_path):
    notes = Notes()
    assert choose_resume("auto", str(tmp_path / "not-yet"), notes) == (None, None)
    assert notes == []


def test_auto_takes_last_before_previous(tmp_path):
    write_checkpoint(tmp_path / "last.pt", 5)
    write_checkpoint(tmp_path / "previous.pt", 4)
    path, checkpoint = choose_resume("auto", str(tmp_path), Notes())
    assert path == str(tmp_path / "last.pt") and checkpoint["step"] == 5


def test_auto_takes_previous_when_there_is_no_last(tmp_path):
    write_checkpoint(tmp_path / "previous.pt", 4)
    path, checkpoint = choose_resume("auto", str(tmp_path), Notes())
    assert path == str(tmp_path / "previous.pt") and checkpoint["step"] == 4


def test_auto_moves_a_corrupt_last_aside_says_so_and_takes_previous(tmp_path):
    write_corrupt(tmp_path / "last.pt")
    write_checkpoint(tmp_path / "previous.pt", 4)
    notes = Notes()
    path, checkpoint = choose_resume("auto", str(tmp_path), notes)
    assert path == str(tmp_path / "previous.pt") and checkpoint["step"] == 4
    assert sorted(os.listdir(tmp_path)) == ["last.pt.corrupt", "previous.pt"]
    assert len(notes) == 1 and "last.pt is corrupt or truncated" in notes[0]
    assert notes[0].endswith(f"moved it to {tmp_path / 'last.pt.corrupt'}; resuming from {path} instead")


def test_a_file_set_aside_earlier_is_never_overwritten_by_the_next(tmp_path):
    write_corrupt(tmp_path / "last.pt.corrupt")
    (tmp_path / "last.pt.corrupt.2").write_bytes(b"second")
    write_checkpoint(tmp_path / "last.pt", 5)
    data = (tmp_path / "last.pt").read_bytes()
    (tmp_path / "last.pt").write_bytes(data[: len(data) // 2])
    write_checkpoint(tmp_path / "previous.pt", 4)
    notes = Notes()
    assert choose_resume("auto", str(tmp_path), notes)[1]["step"] == 4
    assert (tmp_path / "last.pt.corrupt").read_bytes() == b"PK\x03\x04 not a whole zip"
    assert (tmp_path / "last.pt.corrupt.2").read_bytes() == b"second"
    assert (tmp_path / "last.pt.corrupt.3").read_bytes() == data[: len(data) // 2]
    assert notes[0].endswith(f"moved it to {tmp_path / 'last.pt.corrupt.3'}; resuming from "
                             f"{tmp_path / 'previous.pt'} instead")


def test_a_bit_flipped_in_last_resumes_from_previous_and_names_both(tmp_path):
    write_checkpoint(tmp_path / "last.pt", 5)
    write_checkpoint(tmp_path / "previous.pt", 4)
    flip_bit(tmp_path / "last.pt", "data/0", byte=3, bit=6)  # the first weight's exponent: 5.0 becomes 1.7e38
    notes = Notes()
    path, checkpoint = choose_resume("auto", str(tmp_path), notes)
    assert path == str(tmp_path / "previous.pt") and checkpoint["step"] == 4
    assert notes == [f"[trainbridge] checkpoint {tmp_path / 'last.pt'} is corrupt: its record archive/data/0 does not "
                     f"match the CRC-32 written with it (a bit changed on disk or in transit); delete it or pass "
                     f"--resume with another file; moved it to {tmp_path / 'last.pt.corrupt'}; resuming from "
                     f"{tmp_path / 'previous.pt'} instead"]


# The process runs out of file descriptors (EMFILE) just before choose_resume; with {release}, a thread
# closes some of them 0.1 s later, as a passing shortage ends.
OUT_OF_DESCRIPTORS = """
    import os, resource, threading
    from trainbridge.errors import UserError
    from trainbridge.training.checkpoint import choose_resume
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    if {release}:
        threading.Timer(0.1, lambda: [os.close(fd) for fd in held[:8]]).start()
    try:
        path, checkpoint = choose_resume("auto", {directory!r}, note=print)
        print("resumed", path, checkpoint["step"])
    except UserError as exc:
        print("error", exc)
"""


def test_a_read_that_fails_for_a_passing_reason_moves_nothing_and_is_one_line(tmp_path):
    write_checkpoint(tmp_path / "last.pt", 5)
    write_checkpoint(tmp_path / "previous.pt", 4)
    before = {name: (tmp_path / name).read_bytes() for name in ("last.pt", "previous.pt")}
    result = run_python(OUT_OF_DESCRIPTORS.format(directory=str(tmp_path), release=False))
    assert result.returncode == 0, result
    assert result.stdout.strip() == (
        f"error cannot read the checkpoint {tmp_path / 'last.pt'} (Too many open files; tried 3 times); it is left "
        f"where it is, nothing was moved; close files this process holds open or raise the open-file limit "
        f"(ulimit -n), then try again"), result.stdout
    assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == before


def test_a_passing_read_error_that_clears_is_retried(tmp_path):
    write_checkpoint(tmp_path / "last.pt", 5)
    write_checkpoint(tmp_path / "previous.pt", 4)
    result = run_python(OUT_OF_DESCRIPTORS.format(directory=str(tmp_path), release=True))
    assert result.returncode == 0, result
    assert result.stdout.strip() == f"resumed {tmp_path / 'last.pt'} 5", result.stdout
    assert sorted(os.listdir(tmp_path)) == ["last.pt", "previous.pt"]


def test_auto_with_every_file_corrupt_is_one_line_and_moves_both_aside(tmp_path):
    write_corrupt(tmp_path / "last.pt")
    write_corrupt(tmp_path / "previous.pt")
    with pytest.raises(UserError, match=r"no loadable checkpoint in .*: .*last\.pt, .*previous\.pt corrupt .*"
                                        r"use --resume never"):
        choose_resume("auto", str(tmp_path), Notes())
    assert sorted(os.listdir(tmp_path)) == ["last.pt.corrupt", "previous.pt.corrupt"]


def test_auto_never_moves_a_readable_file_that_is_not_a_trainbridge_checkpoint(tmp_path):
    torch.save({"w": torch.ones(1)}, tmp_path / "last.pt")  # someone's weights, readable
    write_checkpoint(tmp_path / "previous.pt", 4)
    with pytest.raises(UserError, match="is not a trainbridge checkpoint"):
        choose_resume("auto", str(tmp_path), Notes())
    assert sorted(os.listdir(tmp_path)) == ["last.pt", "previous.pt"]


def test_a_path_is_loaded_or_named_in_one_line(tmp_path):
    write_checkpoint(tmp_path / "elsewhere.pt", 9)
    path, checkpoint = choose_resume(str(tmp_path / "elsewhere.pt"), str(tmp_path / "out"), Notes())
    assert path == str(tmp_path / "elsewhere.pt") and checkpoint["step"] == 9
    with pytest.raises(UserError, match=r"missing\.pt does not exist; check the path, or use --resume auto/never"):
        choose_resume(str(tmp_path / "missing.pt"), str(tmp_path), Notes())
    write_corrupt(tmp_path / "bad.pt")
    with pytest.raises(UserError, match="corrupt or truncated .*pass --resume with another file"):
        choose_resume(str(tmp_path / "bad.pt"), str(tmp_path), Notes())
    assert (tmp_path / "bad.pt").exists()  # a file named by the user is never moved


def test_read_checkpoint_wants_the_format_tag(tmp_path):
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(UserError, match=f"no format tag {FORMAT!r}"):
        read_checkpoint(str(tmp_path / "list.pt"))


def test_a_checkpoint_of_another_layout_under_the_format_tag_is_one_line_and_never_moved(tmp_path):
    other = layout(5)
    del other["scheduler"]
    other["optimizer"] = []
    other["progress"]["steps"] = other["progress"].pop("step")
    other["progress"]["epoch"] = "1"
    atomic_save(other, str(tmp_path / "last.pt"))
    write_checkpoint(tmp_path / "previous.pt", 4)
    with pytest.raises(UserError, match=rf"^checkpoint {tmp_path / 'last.pt'} has the format tag {FORMAT!r} but not "
                                        r"its layout \(missing scheduler; optimizer is a list, not a dict; progress "
                                        r"counters missing: step; unknown progress counters: steps; progress counters "
                                        r"not whole numbers: epoch\): written by another version of trainbridge, or "
                                        r"changed by hand; resume with the release that wrote it, or use --resume "
                                        r"never to start over$"):
        choose_resume("auto", str(tmp_path), Notes())
    assert sorted(os.listdir(tmp_path)) == ["last.pt", "previous.pt"]


def test_load_model_state_names_the_keys_of_another_model():
    model = torch.nn.Linear(2, 3)
    load_model_state(model, {"weight": torch.zeros(3, 2), "bias": torch.ones(3)}, "ckpt.pt")
    assert torch.equal(model.bias, torch.ones(3))
    with pytest.raises(UserError, match=r"checkpoint ckpt\.pt is for another model: missing keys: bias; .*"
                                        r"shape mismatches: weight; use the --model it was trained with"):
        load_model_state(model, {"weight": torch.zeros(1, 2)}, "ckpt.pt")


# ----- lock_output_dir --------------------------------------------------------------------------
LOCK_IN_CHILD = """
    from trainbridge.errors import UserError
    from trainbridge.training.checkpoint import lock_output_dir
    try:
        lock_output_dir({directory!r}, note=print)
        print("locked")
    except UserError as exc:
        print(exc)
"""


def test_a_second_job_in_the_folder_is_refused_and_a_dead_jobs_lock_is_free(tmp_path):
    directory = str(tmp_path / "out")
    ended = run_python(LOCK_IN_CHILD.format(directory=directory))  # takes the lock and ends
    assert ended.returncode == 0 and ended.stdout.strip() == "locked", ended
    notes = Notes()
    lock_output_dir(directory, notes)  # the kernel dropped the child's lock
    lock_output_dir(directory, notes)  # this process again: nothing to do
    assert notes == []
    holder = f"host {socket.gethostname()}, pid {os.getpid()}"
    # Not read here: closing any descriptor of the lock file in this process would drop its POSIX lock.
    refused = run_python(LOCK_IN_CHILD.format(directory=directory))
    assert refused.returncode == 0, refused
    assert refused.stdout.strip() == (f"--output-dir {directory} is in use by another job ({holder}): this one would "
                                      f"resume from its live checkpoints and write over them; wait for it to finish, "
                                      f"or pass another --output-dir")
    assert (tmp_path / "out" / LOCK).read_text() == holder + "\n"  # (this drops the lock, as documented)


def test_an_output_dir_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(UserError, match=r"--output-dir .*a_file/out is not writable \(.*\); pass a folder"):
        lock_output_dir(str(tmp_path / "a_file" / "out"), Notes())


def test_the_lock_file_is_never_opened_through_a_link(tmp_path):
    precious = tmp_path / "precious"
    precious.write_bytes(b"root's own")
    (tmp_path / "out").mkdir()
    os.symlink(precious, tmp_path / "out" / LOCK)
    with pytest.raises(UserError, match=rf"--output-dir {tmp_path / 'out'}: cannot open its lock file "
                                        rf"{tmp_path / 'out' / LOCK} \(it is a symbolic link\); remove it, or pass "
                                        rf"another --output-dir$"):
        lock_output_dir(str(tmp_path / "out"), Notes())
    assert precious.read_bytes() == b"root's own"


def test_an_output_dir_every_user_can_write_is_refused(tmp_path):
    (tmp_path / "runs").mkdir()
    os.chmod(tmp_path / "runs", 0o1777)
    with pytest.raises(UserError, match=rf"^--output-dir {tmp_path / 'runs'} can be written by every user \(mode "
                                        rf"1777\): another local user could plant a last\.pt there for this job to "
                                        rf"resume from, or redirect its writes; pass a folder of your own \(e\.g\. "
                                        rf"{tmp_path / 'runs' / 'runs'}, made by this job\)$"):
        lock_output_dir(str(tmp_path / "runs"), Notes())
    assert os.listdir(tmp_path / "runs") == []


@needs_another_user
def test_an_output_dir_another_user_made_is_refused_and_nothing_there_is_touched(shared_dir):  # noqa: F811
    precious = os.path.join(shared_dir, "precious")
    with open(precious, "wb") as f:
        f.write(b"root's own")
    os.chmod(precious, 0o600)
    runs = os.path.join(shared_dir, "runs")
    as_other_user(f"mkdir -m 755 {runs} && ln -s {precious} {runs}/{LOCK} && echo planted > {runs}/last.pt")
    with pytest.raises(UserError, match=rf"^--output-dir {runs} belongs to another user \(uid {other_uid()}\): "):
        lock_output_dir(runs, Notes())
    with open(precious, "rb") as f:
        assert f.read() == b"root's own"
    assert sorted(os.listdir(runs)) == [LOCK, "last.pt"]


@needs_another_user
def test_a_last_pt_of_another_user_is_never_resumed_from(tmp_path):
    write_checkpoint(tmp_path / "last.pt", 1000)  # say, planted by a member of the folder's group
    write_checkpoint(tmp_path / "previous.pt", 4)
    os.chown(tmp_path / "last.pt", other_uid(), -1)
    lock_output_dir(str(tmp_path), Notes())
    with pytest.raises(UserError, match=rf"^checkpoint {tmp_path / 'last.pt'} belongs to another user \(uid "
                                        rf"{other_uid()}\): this job's user did not write it, and resuming would "
                                        rf"train on whatever weights it holds; nothing was moved; move it away, or "
                                        rf"pass --resume {tmp_path / 'last.pt'} if you trust it$"):
        choose_resume("auto", str(tmp_path), Notes())
    assert sorted(os.listdir(tmp_path)) == [LOCK, "last.pt", "previous.pt"]
    assert choose_resume(str(tmp_path / "last.pt"), str(tmp_path), Notes())[1]["step"] == 1000  # trusted by name


# ----- set_aside_previous_run -------------------------------------------------------------------
def test_nothing_to_set_aside_in_an_empty_or_unrelated_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    notes = Notes()
    assert set_aside_previous_run(str(tmp_path), notes) is None
    assert os.listdir(tmp_path) == ["notes.txt"] and notes == []


def test_an_earlier_runs_files_move_to_a_folder_of_their_own(tmp_path):
    run_files = ["last.pt", "previous.pt", "best.pt", "final.pt", "metrics.jsonl", "report_val.json",
                 "confusion_val.png", "last.pt.corrupt"]
    kept = ["notes.txt", ".failed-at-step-3", LOCK]  # the user's, and the restarted run's own
    for name in run_files + kept:
        (tmp_path / name).write_text(name)
    notes = Notes()
    aside = set_aside_previous_run(str(tmp_path), notes)
    assert os.path.dirname(aside) == str(tmp_path) and os.path.basename(aside).startswith("previous-run-")
    assert sorted(os.listdir(aside)) == sorted(run_files)
    assert all((tmp_path / os.path.basename(aside) / name).read_text() == name for name in run_files)
    assert sorted(os.listdir(tmp_path)) == sorted(kept + [os.path.basename(aside)])
    assert notes == [f"[trainbridge] starting afresh: the earlier run's files in {tmp_path} were moved to {aside}"]


def test_two_fresh_starts_within_a_second_get_two_folders(tmp_path, monkeypatch):
    monkeypatch.setattr("time.strftime", lambda fmt: "20250101-000000")
    (tmp_path / "last.pt").write_text("first")
    first = set_aside_previous_run(str(tmp_path), Notes())
    (tmp_path / "last.pt").write_text("second")
    second = set_aside_previous_run(str(tmp_path), Notes())
    assert first.endswith("previous-run-20250101-000000") and second == first + ".2"
    assert (tmp_path / os.path.basename(second) / "last.pt").read_text() == "second"
