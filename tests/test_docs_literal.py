"""The command blocks of the quickstart and the guides run as written, in order, as a user
pastes them into one terminal in a fresh folder beside the set-up's ``.venv``.

A ``bash`` fence preceded by ``<!-- test: shell -->`` is run; the marked ``python`` block of the
same page is the ``train.py`` its commands start ("save it as train.py"). Every marked block of
a page runs in one shell, so a block may use what an earlier one made (an activated venv, a
folder). Blocks that need a cluster, a download or the set-up itself (``make``, ``pip install``)
are not marked; ``tests/test_docs.py`` checks that every page has the blocks it is meant to have
marked. As root, Open MPI needs ``--allow-run-as-root``, which the quickstart says; the test gives
it the equivalent environment variables instead of editing the commands.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import List

import pytest

from conftest import run

ROOT = Path(__file__).resolve().parents[1]
SHELL_MARKER = "<!-- test: shell -->"
RUN_MARKER = "<!-- test: run -->"
PAGES = {  # page -> the output folders its commands must leave a finished run in
    "docs/quickstart.md": ["runs/python", "runs/torchrun", "runs/horovodrun", "runs/mpirun"],
    "docs/guides/own-loop.md": ["runs/own-python", "runs/own-spawn", "runs/own-torchrun", "runs/own-hvd-gloo",
                                "runs/own-hvd-mpi", "runs/own-mpirun", "runs/own-restarts"],
    "docs/guides/own-task.md": ["runs/wave", "runs/wave-ddp"],
}
pytestmark = pytest.mark.e2e


def shell_blocks(page: Path) -> List[str]:
    return re.findall(rf"^{re.escape(SHELL_MARKER)}\n```bash\n(.*?)^```$", page.read_text(), re.MULTILINE | re.DOTALL)


def python_blocks(page: Path) -> List[str]:
    return re.findall(rf"^{re.escape(RUN_MARKER)}\n```python\n(.*?)^```$", page.read_text(), re.MULTILINE | re.DOTALL)


@pytest.mark.parametrize("page", list(PAGES))
def test_the_pages_commands_run_as_written_in_order(page, tmp_path):
    blocks = shell_blocks(ROOT / page)
    assert blocks, f"{page} has no block marked {SHELL_MARKER}"
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    for code in python_blocks(ROOT / page):
        (tmp_path / "train.py").write_text(code)
    script = "set -euo pipefail\n" + "\n".join(blocks)
    env = {"PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"}  # `trainbridge` as after `pip install`
    if os.geteuid() == 0:
        env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    result = run(["bash", "-c", script], timeout=900, env=env, cwd=str(tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"exit {result.returncode}\n{output[-6000:]}"
    assert "Traceback" not in output and "trainbridge: error" not in output, output[-6000:]
    for folder in PAGES[page]:
        assert (tmp_path / folder / "final.pt").is_file(), f"{folder} holds no finished run:\n{output[-3000:]}"
