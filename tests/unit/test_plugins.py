"""trainbridge.plugins: a user's class named by registry name, module or file, or one line saying why not."""
import pytest

from trainbridge.errors import UserError
from trainbridge.plugins import resolve


def test_a_task_file_that_is_a_directory_is_named_as_one(tmp_path):
    folder = tmp_path / "mytask.py"
    folder.mkdir()
    with pytest.raises(UserError, match=rf"^task file {folder} is a directory, not a \.py file; give the path of a "
                                        rf"\.py file in it as \./file\.py:Name$"):
        resolve(f"{folder}:Task", {}, "task")
    with pytest.raises(UserError, match=rf"^task file {tmp_path / 'none.py'} does not exist; "):
        resolve(f"{tmp_path / 'none.py'}:Task", {}, "task")
