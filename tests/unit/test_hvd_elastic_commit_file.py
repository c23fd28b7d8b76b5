"""trainbridge.hvd.elastic.commit_file: where a torchrun job's elastic commits survive a restart, written
and read back safely."""
import torch
from test_api_files import flip_bit

from trainbridge.hvd.elastic import commit_file


def test_a_commit_with_a_flipped_bit_is_ignored_with_one_line(tmp_path, capsys):
    path = str(tmp_path / "state.pt")
    commit_file.save({"weights": torch.full((4,), 3.0), "epoch": 3}, path, job="run-1")
    assert commit_file.load(path, job="run-1")["epoch"] == 3
    flip_bit(path, "data/0", byte=3, bit=6)
    capsys.readouterr()
    assert commit_file.load(path, job="run-1") is None
    assert capsys.readouterr().out == (f"hvd.elastic: ignoring {path}: its record archive/data/0 does not match the "
                                       f"CRC-32 written with it; starting from the initial state\n")
