"""The command blocks of the quickstart and the guides run as written, in order, as a user
pastes them into one terminal in a fresh folder beside the set-up's ``.venv``.

A ``bash`` fence preceded by ``<!-- test: shell -->`` is run; the marked ``python`` block of the
same page is the ``train.py`` its commands start ("save it as train.py"). Every marked block of
a page runs in one shell, so a block may use what an earlier one made (an activated venv, a
folder). Blocks that need a cluster, a download, placeholders or the set-up itself (``make``,
``pip install``, whose wheel ``tests/test_packaging.py`` installs) are not marked. As root, Open
MPI needs ``--allow-run-as-root``, which the quickstart says; the test gives it the equivalent
environment variables instead of editing the commands.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import List

import pytest
from conftest import run
from test_designsafe_launchers import assert_sample_run_reached_80_percent
from test_docs import marked_blocks

ROOT = Path(__file__).resolve().parents[1]
SHELL_MARKER = "<!-- test: shell -->"
PAGES = {  # page -> the output folders its commands must leave a finished run in, and lines they must print
    "docs/quickstart.md": (["runs/python", "runs/torchrun", "runs/horovodrun", "runs/mpirun"], []),
    "docs/guides/own-loop.md": (["runs/own-python", "runs/own-spawn", "runs/own-torchrun", "runs/own-hvd-gloo",
                                 "runs/own-hvd-mpi", "runs/own-mpirun", "runs/own-restarts"], []),
    "docs/guides/own-task.md": (["runs/wave", "runs/wave-ddp"], []),
    # The failure each command injects does happen, and each run finishes after it.
    "docs/guides/fault-tolerance.md": (["runs/ft", "runs/elastic"],
                                       ["--fail-at-step: rank 1 exits abruptly before step 25"] * 2),
    "docs/guides/designsafe.md": (["runs/designsafe-sample", "runs/designsafe-sample-hvd"],
                                  ["is a SYNTHETIC sample"] * 2
                                  + ["confusion matrix (rows: true, columns: predicted)"] * 2),
}
# What a page's finished runs must also show, folder by folder: the guide's DesignSafe runs (torchrun,
# horovodrun) are the sample's accuracy and learning-rate runs, so they are checked here, not run again.
RUN_CHECKS = {"docs/guides/designsafe.md": assert_sample_run_reached_80_percent}
# Lines a page's commands may print, by design. The torchrun restart of the fault-tolerance page: the rank that
# survives the injected failure may report it, in the one line of a dead peer, before torchrun's SIGTERM reaches
# it (a race) and torchrun starts the workers again. Horovod elastic's survivors recover inside the run: no line.
EXPECTED_ERRORS = {
    "docs/guides/fault-tolerance.md": re.compile(
        r"^trainbridge: error: rank 0: a collective failed \(.*\); another rank died, stalled or called a "
        r"different operation .*\n", re.MULTILINE),
}
# A page alone took 13-205 s on a slow 2-core machine (CI, 2026-11-27); make test-e2e runs them one at a time.
PAGE_LIMIT = 900
pytestmark = pytest.mark.e2e


def shell_blocks(page: Path) -> List[str]:
    return re.findall(rf"^{re.escape(SHELL_MARKER)}\n```bash\n(.*?)^```$", page.read_text(), re.MULTILINE | re.DOTALL)


@pytest.mark.timeout(PAGE_LIMIT + 60)  # the run's own limit fires first, with the stacks of its processes
@pytest.mark.parametrize("page", list(PAGES))
def test_the_pages_commands_run_as_written_in_order(page, tmp_path):
    blocks = shell_blocks(ROOT / page)
    assert blocks, f"{page} has no block marked {SHELL_MARKER}"
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    for code in marked_blocks(ROOT / page):
        (tmp_path / "train.py").write_text(code)
    script = "set -euo pipefail\n" + "\n".join(blocks)
    env = {"PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"}  # `trainbridge` as after `pip install`
    if os.geteuid() == 0:
        env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    result = run(["bash", "-c", script], timeout=PAGE_LIMIT, env=env, cwd=str(tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"exit {result.returncode}\n{output[-6000:]}"
    unexpected = EXPECTED_ERRORS[page].sub("", output) if page in EXPECTED_ERRORS else output
    assert "Traceback" not in unexpected and "trainbridge: error" not in unexpected, unexpected[-6000:]
    folders, lines = PAGES[page]
    for folder in folders:
        assert (tmp_path / folder / "final.pt").is_file(), f"{folder} holds no finished run:\n{output[-3000:]}"
    for line in set(lines):
        assert output.count(line) >= lines.count(line), (line, output[-3000:])
    for folder in folders if page in RUN_CHECKS else []:
        RUN_CHECKS[page](tmp_path / folder)
