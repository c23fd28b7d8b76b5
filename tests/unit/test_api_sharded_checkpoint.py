"""The folder replacement of trainbridge/api/sharded_checkpoint.py: what a finished checkpoint folder replaces."""
from trainbridge.api.sharded_checkpoint import _replace, holds_dtensors, is_sharded_checkpoint


def folder(path, text):
    path.mkdir()
    (path / "state.pt").write_text(text)
    return path


def test_a_new_folder_replaces_the_old_which_goes_to_keep_previous(tmp_path):
    folder(tmp_path / "last", "old")
    (tmp_path / "previous").write_text("a file from an unsharded run")
    _replace(str(folder(tmp_path / ".last.tmp-1", "new")), str(tmp_path / "last"), str(tmp_path / "previous"))
    assert (tmp_path / "last" / "state.pt").read_text() == "new"
    assert (tmp_path / "previous" / "state.pt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "previous"]


def test_without_keep_previous_the_old_folder_is_removed(tmp_path):
    folder(tmp_path / "last", "old")
    _replace(str(folder(tmp_path / ".last.tmp-1", "new")), str(tmp_path / "last"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]
    assert is_sharded_checkpoint(str(tmp_path / "last")) and not is_sharded_checkpoint(str(tmp_path / "nothing"))


def test_plain_tensors_are_no_dtensors():
    import torch

    assert not holds_dtensors({"a": [torch.ones(2)], "b": 3})
