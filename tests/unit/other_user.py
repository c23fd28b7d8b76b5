"""Another local user, for the checks of files in shared places: ``nobody``, through ``su``, where this
test runs as root (else the tests that need it are skipped). Everything it makes lives in a
shared folder of the test's own (mode 1777, as /tmp), removed afterwards."""
from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile

import pytest

OTHER = "nobody"


def other_uid() -> int:
    return pwd.getpwnam(OTHER).pw_uid


def can_act_as_another_user() -> bool:
    try:
        other_uid()
    except KeyError:
        return False
    return os.geteuid() == 0 and shutil.which("su") is not None


needs_another_user = pytest.mark.skipif(not can_act_as_another_user(), reason=f"needs root and a user {OTHER!r}")


def as_other_user(command: str) -> None:
    """Run the shell ``command`` as the other user; fail the test if it fails."""
    result = subprocess.run(["su", "-s", "/bin/sh", OTHER, "-c", command], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, (command, result.stdout, result.stderr)


@pytest.fixture
def shared_dir():
    """A folder every local user may write, like /tmp (sticky), outside pytest's private tmp_path; removed after."""
    path = tempfile.mkdtemp(prefix="trainbridge-shared-", dir="/tmp")
    os.chmod(path, 0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path)
