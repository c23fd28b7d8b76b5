"""``hvd.elastic`` under ``torchrun --max-restarts``: a hard crash resumes from the last commit."""
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
    # Both restarted workers start at the last commit, not at the beginning.
    assert re.findall(r"START attempt=1 epoch=(\d+) batch=(\d+)", out) == [("1", "6")] * 2, out[-3000:]
    assert "resumed from the last commit" in out
    # The ranks share one stdout: a line can run into the other rank's ("...accuracy=0.2930DONE rank=1 ...").
    done = re.findall(r"DONE rank=(\d) checksum=(-?\d+\.\d+) accuracy=(\d\.\d+)", out)
    assert sorted(r for r, _, _ in done) == ["0", "1"], out[-3000:]
    assert done[0][1] == done[1][1], f"ranks finished with different parameters: {done}"
    assert (tmp_path / "state.pt").exists()
