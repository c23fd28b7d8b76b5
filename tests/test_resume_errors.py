"""Bad checkpoints: one clear line, nothing good overwritten, a fallback when one exists.

Most tests start from the folder of one finished 1-epoch run (``one_epoch``, trained once per
module): each works on a copy of it, and only reads the original.
"""
import shutil

import pytest
import torch
from conftest import PLAIN_SGD, SAMPLE, check, copy_of, load_final, plain, read_metrics, run, train_here
from test_bad_input import assert_one_clear_line

QUICK = [*SAMPLE, *PLAIN_SGD, "--epochs", "2"]


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory):
    """The output folder of ``QUICK`` trained for 1 epoch: not to be written to (copy it with ``copy_of``)."""
    out = tmp_path_factory.mktemp("one_epoch")
    check(train_here(QUICK + ["--epochs", "1", "--output-dir", str(out)]))
    return out


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


def test_corrupt_last_falls_back_to_previous_and_says_so(tmp_path, one_epoch):
    # Epoch 2 on top of the 1-epoch run: last.pt holds epoch 2, previous.pt epoch 1.
    check(train_here(QUICK + ["--output-dir", str(copy_of(one_epoch, tmp_path))]))
    assert (tmp_path / "previous.pt").exists()
    truncate(tmp_path / "last.pt")
    corrupt_bytes = (tmp_path / "last.pt").read_bytes()
    result = check(train_here(QUICK + ["--epochs", "3", "--output-dir", str(tmp_path)]))
    assert "last.pt is corrupt" in result.stdout and "moved it to" in result.stdout
    assert (tmp_path / "last.pt.corrupt").read_bytes() == corrupt_bytes  # kept, not overwritten
    assert "resuming from" in result.stdout and "previous.pt" in result.stdout
    assert load_final(tmp_path)["epoch"] == 3


def test_corrupt_checkpoint_without_fallback_stops(tmp_path, one_epoch):
    copy_of(one_epoch, tmp_path)
    (tmp_path / "previous.pt").unlink(missing_ok=True)
    truncate(tmp_path / "last.pt")
    result = train_here(QUICK + ["--output-dir", str(tmp_path)])
    assert_one_clear_line(result, r"no loadable checkpoint in .*last.pt corrupt.*--resume never")
    assert not (tmp_path / "last.pt").exists() and (tmp_path / "last.pt.corrupt").exists()


def test_resume_path_that_is_corrupt_names_the_file_and_leaves_it(tmp_path, one_epoch):
    bad = tmp_path / "bad.pt"
    shutil.copy(one_epoch / "last.pt", bad)
    truncate(bad)
    before = bad.read_bytes()
    result = train_here(QUICK + ["--resume", str(bad), "--output-dir", str(tmp_path / "b")])
    assert_one_clear_line(result, r"checkpoint .*bad.pt is corrupt or truncated")
    assert bad.read_bytes() == before


def test_checkpoint_of_another_model_names_the_keys(tmp_path, one_epoch):
    copy_of(one_epoch, tmp_path)
    result = train_here(QUICK + ["--model", "convnet-bn", "--output-dir", str(tmp_path)])
    assert_one_clear_line(result, r"is for another model: missing keys: .*1\.weight.*unexpected keys: .*")
    assert torch.load(tmp_path / "last.pt", weights_only=True)["config"]["model"] == "plaincnn"


def test_resume_path_that_does_not_exist(tmp_path):
    result = train_here(QUICK + ["--resume", str(tmp_path / "nope.pt"), "--output-dir", str(tmp_path)])
    assert_one_clear_line(result, r"checkpoint .*nope.pt does not exist")


def test_checkpoint_contents_load_with_weights_only(one_epoch):
    for name in ("last.pt", "best.pt", "final.pt"):
        torch.load(one_epoch / name, weights_only=True)
    ckpt = torch.load(one_epoch / "last.pt", weights_only=True)
    for key in ("model", "optimizer", "scheduler", "epoch", "step_in_epoch", "sampler", "rng", "best", "config",
                "backend", "world_size"):
        assert key in ckpt, key
    assert ckpt["sampler"] == {"seed": 1, "epoch": 1, "position": 0} and ckpt["epoch"] == 1
    final_row = read_metrics(one_epoch)[-1]
    assert len(ckpt["rng"]["torch"]) == 1 and ckpt["best"]["val_accuracy"] == final_row["val_accuracy"]


def test_a_checkpoint_that_cannot_be_written_stops_with_one_line_and_keeps_the_last(tmp_path, one_epoch):
    copy_of(one_epoch, tmp_path)
    good = {p.name: p.read_bytes() for p in tmp_path.glob("*.pt")}
    assert "last.pt" in good
    # The next checkpoint hits a file size limit, as a full disk would: a real failed write
    # (bash's ulimit -f, in KiB; SIGXFSZ ignored so that write() returns EFBIG instead of killing).
    limit_kib = len(good["last.pt"]) // 2048
    resumed = plain(QUICK + ["--epochs", "2", "--output-dir", str(tmp_path)])
    result = run(["bash", "-c", f'ulimit -f {limit_kib}; trap "" XFSZ; exec "$@"', "bash", *resumed], timeout=120)
    assert_one_clear_line(result, r"cannot write the checkpoint .*\.pt: File too large; the checkpoints already in "
                                  r".* are unchanged; free space there or pass another --output-dir")
    assert {p.name: p.read_bytes() for p in tmp_path.glob("*.pt")} == good  # nothing good overwritten
    assert not list(tmp_path.glob(".*.tmp"))  # nor a partial file left to fill the disk
