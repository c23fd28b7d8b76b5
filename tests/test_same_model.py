"""Common code whose model must not depend on the launcher or the world size ends with one process's weights.

tests/api_scripts/same_model.py runs every program of tests/api_scripts/same_model_programs/
in one job (float64, a fixed global batch): each must end within 1e-9 of one plain python
process, every rank holding rank 0's weights bit for bit, and pass its module's own check.
Each launcher is started once; each program is checked by its own test.
"""
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    HOROVODRUN,
    MPIRUN,
    MPIRUN_FLAGS,
    PYTHON,
    TORCHRUN,
    check,
    launch_once,
    max_abs_diff,
    one_process_reference,
    run,
)

SCRIPTS = Path(__file__).resolve().parent / "api_scripts"
SCRIPT = str(SCRIPTS / "same_model.py")
sys.path.insert(0, str(SCRIPTS))
from same_model import programs  # noqa: E402

PROGRAMS = programs()
TIMEOUT = 300
TOLERANCE = 1e-9

# name -> (command for the script's arguments, world size, backend the job must pick)
LAUNCHERS = {
    "torchrun-2": (lambda a: [TORCHRUN, "--standalone", "--nproc-per-node=2", SCRIPT, *a], 2, "torch"),
    "torchrun-3": (lambda a: [TORCHRUN, "--standalone", "--nproc-per-node=3", SCRIPT, *a], 3, "torch"),
    "horovodrun-gloo": (lambda a: [HOROVODRUN, "-np", "2", "--gloo", PYTHON, SCRIPT, *a], 2, "horovod"),
    "horovodrun-mpi": (lambda a: [HOROVODRUN, "-np", "2", "--mpi", PYTHON, SCRIPT, *a], 2, "horovod"),
    "mpirun": (lambda a: [MPIRUN, *MPIRUN_FLAGS, "-np", "2", PYTHON, SCRIPT, *a], 2, "horovod"),
}
# make test runs every program under torchrun-2 and horovodrun-gloo, one launch per backend; the rest is the
# launcher matrix, which make test-e2e runs.
MATRIX = {"torchrun-3", "horovodrun-mpi", "mpirun"}


def load(out: Path, program: str) -> dict:
    return torch.load(out / f"{program}.pt", weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One plain python process (the local backend) with the whole global batch."""
    return one_process_reference(tmp_path_factory.mktemp("same_model_local"), SCRIPT, PROGRAMS, TIMEOUT)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """``launched(name)``: (output dir, result) of the script under that launcher, started once per module."""
    commands = {name: command for name, (command, _, _) in LAUNCHERS.items()}
    return launch_once(tmp_path_factory, "same_model", commands, TIMEOUT)


@pytest.mark.parametrize("launcher,program", [
    pytest.param(name, program, id=f"{name}-{program}", marks=[pytest.mark.matrix] if name in MATRIX else [])
    for name in LAUNCHERS for program in PROGRAMS])
def test_program_matches_one_process(launcher, program, reference, launched):
    out, result = launched(launcher)
    saved, ref = load(out, program), reference[program]
    _, world_size, backend = LAUNCHERS[launcher]
    # The world size and backend the job saw: ranks that each trained alone would also "match".
    assert (saved["world_size"], saved["backend"]) == (world_size, backend)
    assert saved["final"].keys() == ref["final"].keys()
    assert not [key for key in saved["final"] if key.startswith(("module.", "_orig_mod."))]
    assert all(value.dtype == torch.float64 for value in saved["final"].values() if value.is_floating_point())
    assert max_abs_diff(saved["initial"], ref["initial"]) == 0.0
    assert saved["cross_rank_max_diff"] == 0.0, f"{launcher} {program}: ranks' weights differ"
    diff = max_abs_diff(saved["final"], ref["final"])
    assert diff <= TOLERANCE, f"{launcher} {program}: max abs weight difference {diff:.3g} vs one process"
    assert max_abs_diff(saved["final"], saved["initial"]) > 1e-3  # the weights moved
    PROGRAMS[program].check(saved, ref)


def test_augmentation_resumed_at_another_world_size_continues_exactly(reference, launched, tmp_path):
    # torchrun 2's checkpoint of program augment, mid-epoch, resumed by one plain process: each sample's crops,
    # flips and noise continue as in one uninterrupted process, so the weights end where that process's do.
    augment = PROGRAMS["augment"]
    out, _ = launched("torchrun-2")
    shutil.copy(out / f"augment-step{augment.SAVE_AT}.pt", tmp_path)
    result = check(run([PYTHON, SCRIPT, "--output-dir", str(tmp_path), "--programs", "augment"], timeout=TIMEOUT))
    assert "was written by 2 ranks, this job has 1" in result.stdout, result.stdout[-3000:]
    assert f"augment: resumed at step {augment.SAVE_AT}, epoch 1, sample 24" in result.stdout, result.stdout[-3000:]
    saved = load(tmp_path, "augment")
    assert (saved["world_size"], saved["steps"], saved["resumed"]) == (1, 10, True)
    diff = max_abs_diff(saved["final"], reference["augment"]["final"])
    assert diff <= TOLERANCE, f"resumed on 1 rank from 2 ranks' checkpoint: {diff:.3g} from one process"


@pytest.mark.parametrize("launcher", ["python", "torchrun-3"])
def test_sharded_checkpoint_resumed_at_another_world_size_continues_exactly(launcher, reference, launched, tmp_path):
    # torchrun 2's sharded checkpoint of program sharded (a folder of both ranks' shards), resumed by one plain
    # process and by 3 ranks (each reads the parts of the saved shards its own shards cover).
    sharded = PROGRAMS["sharded"]
    out, _ = launched("torchrun-2")
    shutil.copytree(out / f"sharded-step{sharded.SAVE_AT}", tmp_path / f"sharded-step{sharded.SAVE_AT}")
    args = ["--output-dir", str(tmp_path), "--programs", "sharded"]
    command = [PYTHON, SCRIPT, *args] if launcher == "python" else LAUNCHERS[launcher][0](args)
    result = check(run(command, timeout=TIMEOUT))
    assert f"sharded: resumed at step {sharded.SAVE_AT}, epoch 1, sample 12" in result.stdout, result.stdout[-3000:]
    saved = load(tmp_path, "sharded")
    assert (saved["world_size"], saved["steps"], saved["resumed"]) == ({"python": 1}.get(launcher, 3), 6, True)
    diff = max_abs_diff(saved["final"], reference["sharded"]["final"])
    assert diff <= TOLERANCE, f"resumed on {launcher} from 2 ranks' sharded checkpoint: {diff:.3g} from one process"
