"""trainbridge.training.config: the options of ``trainbridge train`` and their checks before any training."""
import os

import pytest

from trainbridge.errors import UserError
from trainbridge.training.config import check_output_dir


def test_the_output_dir_is_probed_with_a_file_made_new_never_through_a_link(tmp_path):
    precious = tmp_path / "precious"
    precious.write_bytes(b"root's own")
    (tmp_path / "out").mkdir()
    os.symlink(precious, tmp_path / "out" / f".write-test-{os.getpid()}")  # the probe's name, once predictable
    check_output_dir(str(tmp_path / "out"))
    assert precious.read_bytes() == b"root's own"
    assert os.listdir(tmp_path / "out") == [f".write-test-{os.getpid()}"]


def test_an_output_dir_below_a_file_is_one_line(tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(UserError, match=r"--output-dir .*a_file/out: .*a_file is a file, not a folder"):
        check_output_dir(str(tmp_path / "a_file" / "out"))
