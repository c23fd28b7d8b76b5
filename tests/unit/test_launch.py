"""trainbridge/launch/__init__.py: report_error's one line, whole when several ranks write at once."""
from __future__ import annotations

import re
import subprocess
import textwrap
import time

from conftest import PYTHON, kill_tree, launcher_env

LINES = 5000
WRITER = textwrap.dedent(f"""
    import pathlib, sys, time
    from trainbridge.launch import report_error
    folder, rank = pathlib.Path(sys.argv[1]), sys.argv[2]
    (folder / f"ready{{rank}}").touch()
    while not (folder / "go").exists():  # both ranks start writing within a millisecond of each other
        time.sleep(0.001)
    for i in range({LINES}):
        report_error(f"rank {{rank}}: line {{i}}")
""")


def test_two_ranks_failing_at_once_never_join_their_lines(tmp_path):
    # Under PYTHONUNBUFFERED (launcher_env sets it, as many job scripts do) print() writes a line's text and its
    # newline in two writes, and the other rank's line on the same stream landed between them: most lines of two
    # such writers came out joined or empty.
    log = tmp_path / "stderr"
    with open(log, "ab") as stream:  # appending, as a launcher's log file takes both ranks' lines
        ranks = [subprocess.Popen([PYTHON, "-c", WRITER, str(tmp_path), str(rank)], stderr=stream,
                                  env=launcher_env(), start_new_session=True) for rank in (0, 1)]
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready{rank}").exists() for rank in (0, 1)):
            assert time.monotonic() < deadline and all(rank.poll() is None for rank in ranks), log.read_text()
            time.sleep(0.05)
        (tmp_path / "go").touch()
        assert [rank.wait(timeout=60) for rank in ranks] == [0, 0], log.read_text()[-2000:]
    finally:
        for rank in ranks:
            kill_tree(rank.pid)
    lines = log.read_text().splitlines()
    whole = [line for line in lines if re.fullmatch(r"trainbridge: error: rank [01]: line \d+", line)]
    assert len(lines) == len(whole) == 2 * LINES, [line for line in lines if line not in whole][:5]
