"""Sparse gradients under Horovod where only a launch shows it: a table some rank left out of a backward pass.

The rest of the sparse story runs elsewhere: a recommender with SparseAdam beside Adam under every
launcher (tests/api_scripts/same_model_programs/sparse.py), the torch backend's buckets in one process
(tests/unit/test_backends_torch_ddp.py), shm_allreduce="on" refused (tests/test_misuse.py).
"""
import json
import re
from pathlib import Path

from conftest import HOROVODRUN, PYTHON, check, run

SCRIPT = str(Path(__file__).resolve().parent / "api_scripts" / "sparse_unused.py")
SPARSE, DENSE = "torch.sparse_coo", "torch.strided"


def test_a_table_one_rank_left_out_is_averaged_sparse_and_each_optimizer_broadcast_under_horovod():
    result = check(run([HOROVODRUN, "-np", "2", "--gloo", PYTHON, SCRIPT], timeout=120))
    line = next(line for line in result.stdout.splitlines() if '"steps"' in line)
    per_rank = json.loads(re.sub(r"^\[\d+\]<stdout>:", "", line))
    states = [rank["state"] for rank in per_rank]
    assert len(states[0]) == 4 and states[1] == states[0], states  # 2 tables, 2 head tensors: rank 0's state
    used = {"users.weight": SPARSE, "extra.weight": SPARSE, "head.weight": DENSE, "head.bias": DENSE}
    for steps in (rank["steps"] for rank in per_rank):  # every rank: one process's average, tables sparse
        assert all(s["diff"] < 1e-12 for s in steps), steps  # float64; inf where only one side has a gradient
        # Step 1: rank 1 did not use "extra" and added no rows; step 2: no rank did, so it has no gradient.
        assert [s["layouts"] for s in steps] == [used, used, {**used, "extra.weight": None}], steps
