"""trainbridge.runtime.safe_files: new files never made through a link, private folders checked for their
owner and mode, against another local user where the machine has one (``other_user``)."""
import os

import pytest
from other_user import as_other_user, needs_another_user, other_uid, shared_dir  # noqa: F401 - a fixture

from trainbridge.errors import UserError
from trainbridge.runtime.safe_files import create_new, private_directory

FIX = "use another folder"


def test_create_new_never_opens_an_existing_file_or_follows_a_link(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"precious")
    os.symlink(target, tmp_path / "link")
    with pytest.raises(FileExistsError):
        create_new(str(tmp_path / "link"))
    with pytest.raises(FileExistsError):
        create_new(str(target))
    assert target.read_bytes() == b"precious"
    with create_new(str(tmp_path / "new")) as f:
        f.write(b"mine")
    assert (tmp_path / "new").read_bytes() == b"mine"


def test_a_private_folder_is_made_with_mode_0700_and_accepted_again(tmp_path):
    private_directory(str(tmp_path / "mine"), "the folder", FIX)
    private_directory(str(tmp_path / "mine"), "the folder", FIX)
    assert os.stat(tmp_path / "mine").st_mode & 0o777 == 0o700


def test_a_private_folder_that_is_a_link_or_open_to_others_is_one_line(tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(UserError, match=r"^the folder .*/link is a symbolic link: another local user could plant "
                                        r"files there or redirect this job's writes; nothing was read or written "
                                        r"there; use another folder$"):
        private_directory(str(tmp_path / "link"), "the folder", FIX)
    (tmp_path / "open").mkdir()
    os.chmod(tmp_path / "open", 0o755)
    with pytest.raises(UserError, match=r"the folder .*/open is open to other users \(mode 755\)"):
        private_directory(str(tmp_path / "open"), "the folder", FIX)
    (tmp_path / "file").write_text("")
    os.chmod(tmp_path / "file", 0o600)
    with pytest.raises(UserError, match=r"the folder .*/file is not a folder"):
        private_directory(str(tmp_path / "file"), "the folder", FIX)


@needs_another_user
def test_a_folder_another_user_made_first_is_refused(shared_dir):  # noqa: F811 - the fixture
    folder = os.path.join(shared_dir, "planted")
    as_other_user(f"mkdir -m 700 {folder}")
    with pytest.raises(UserError, match=rf"the folder {folder} belongs to another user \(uid {other_uid()}\)"):
        private_directory(folder, "the folder", FIX)

