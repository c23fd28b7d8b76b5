"""trainbridge.hvd.elastic.commit_file: where a torchrun job's elastic commits survive a restart, written
and read back safely."""
import os
import tempfile

import pytest
import torch
from other_user import as_other_user, needs_another_user, other_uid, shared_dir  # noqa: F401 - a fixture
from test_api_files import flip_bit

from trainbridge.errors import UserError
from trainbridge.hvd.elastic import commit_file
from trainbridge.runtime.atomic_files import save_atomically


def test_a_commit_with_a_flipped_bit_is_ignored_with_one_line(tmp_path, capsys):
    path = str(tmp_path / "state.pt")
    commit_file.save({"weights": torch.full((4,), 3.0), "epoch": 3}, path, job="run-1")
    assert commit_file.load(path, job="run-1")["epoch"] == 3
    flip_bit(path, "data/0", byte=3, bit=6)
    capsys.readouterr()
    assert commit_file.load(path, job="run-1") is None
    assert capsys.readouterr().out == (f"hvd.elastic: ignoring {path}: its record archive/data/0 does not match the "
                                       f"CRC-32 written with it; starting from the initial state\n")


@pytest.fixture
def default_folder(shared_dir, monkeypatch):  # noqa: F811 - the fixture
    """The default commit path of torchrun run id "run-1", with the shared temporary directory ``shared_dir``."""
    monkeypatch.setattr(tempfile, "tempdir", shared_dir)
    monkeypatch.delenv("TRAINBRIDGE_ELASTIC_DIR", raising=False)
    path = commit_file.commit_path({"TORCHELASTIC_RUN_ID": "run-1"})
    assert path == os.path.join(shared_dir, f"trainbridge-elastic-{os.geteuid()}-run-1", "state.pt")
    return path


def test_the_default_folder_is_made_for_this_user_alone(default_folder):
    commit_file.save({"epoch": 3}, default_folder, job="run-1")
    assert os.stat(os.path.dirname(default_folder)).st_mode & 0o777 == 0o700
    assert commit_file.load(default_folder, job="run-1") == {"epoch": 3}
    commit_file.remove(default_folder)
    assert not os.path.exists(os.path.dirname(default_folder))


@needs_another_user
def test_a_default_folder_planted_by_another_user_is_neither_read_nor_written(default_folder, shared_dir):  # noqa: F811
    folder = os.path.dirname(default_folder)
    precious = os.path.join(shared_dir, "precious")
    with open(precious, "wb") as f:
        f.write(b"root's own")
    os.chmod(precious, 0o600)
    planted = os.path.join(shared_dir, "planted.pt")  # a commit of this job's id, with the other user's weights
    save_atomically({"job": "run-1", "state": {"weights": torch.full((2,), 1000.0), "epoch": 5}}, planted)
    os.chmod(planted, 0o644)
    as_other_user(f"mkdir -m 777 {folder} && cp {planted} {default_folder} && "
                  f"for n in 0 1 2 3; do ln -s {precious} {folder}/.state.pt.$(hostname)-{os.getpid()}-$n.tmp; done")
    before = sorted(os.listdir(folder))
    refused = rf"^hvd\.elastic: the commit folder {folder} belongs to another user \(uid {other_uid()}\): .*; remove " \
              rf"it, or set TRAINBRIDGE_ELASTIC_DIR to a folder of your own$"
    with pytest.raises(UserError, match=refused):
        commit_file.load(default_folder, job="run-1")
    with pytest.raises(UserError, match=refused):
        commit_file.save({"weights": torch.zeros(2), "epoch": 3}, default_folder, job="run-1")
    with open(precious, "rb") as f:
        assert f.read() == b"root's own"
    assert sorted(os.listdir(folder)) == before


@needs_another_user
def test_a_default_folder_that_another_user_linked_elsewhere_is_one_line(default_folder):
    folder = os.path.dirname(default_folder)
    as_other_user(f"ln -s /dev/null {folder}")
    with pytest.raises(UserError, match=rf"^hvd\.elastic: the commit folder {folder} is a symbolic link: "):
        commit_file.save({"epoch": 3}, default_folder, job="run-1")
