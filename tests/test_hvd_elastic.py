"""``hvd.elastic`` under ``torchrun --max-restarts``: a SIGKILLed worker resumes from the last commit, and the
restarted ranks hold the same weights and optimizer state (momentum and weight decay) from the sync on."""
import re
from pathlib import Path

import pytest
from conftest import TORCHRUN, check, run

SCRIPT = Path(__file__).parent / "hvd_scripts" / "elastic_mnist.py"


# Another program where one checks it under torchrun in make test: a restart resumes from the last commit with
# the values of tests/test_hvd_faults.py.
@pytest.mark.matrix
def test_elastic_run_resumes_from_last_commit_after_a_crash(tmp_path):
    result = check(run([TORCHRUN, "--standalone", "--max-restarts=1", "--nproc-per-node=2", str(SCRIPT),
                        "--crash-at-batch", "7", "--batches-per-commit", "3"], timeout=240,
                       env={"TRAINBRIDGE_ELASTIC_DIR": str(tmp_path)}))
    out = result.stdout
    assert "CRASH rank=1 epoch=1 batch=7" in out, out[-3000:]
    commits_before_crash = re.findall(r"COMMIT attempt=0 epoch=(\d+) batch=(\d+)", out)
    assert commits_before_crash[-1] == ("1", "6"), commits_before_crash
    # Both restarted workers start at the last commit, not at the beginning, with rank 0's weights and
    # optimizer state bit for bit (rank 1's optimizer was a fresh one before the sync).
    starts = re.findall(r"START attempt=1 rank=(\d) epoch=(\d+) batch=(\d+) state=(\w+)", out)
    assert sorted((r, e, b) for r, e, b, _ in starts) == [("0", "1", "6"), ("1", "1", "6")], out[-3000:]
    assert starts[0][3] == starts[1][3], f"the ranks' weights or optimizer state differ after the sync: {starts}"
    assert "resumed from the last commit" in out
    done = re.findall(r"DONE rank=(\d) checksum=(-?\d+\.\d+) accuracy=(\d\.\d+) state=(\w+)", out)
    assert sorted(r for r, *_ in done) == ["0", "1"], out[-3000:]
    assert done[0][1] == done[1][1] and done[0][3] == done[1][3], f"the ranks finished apart: {done}"
    assert (tmp_path / "state.pt").exists()
