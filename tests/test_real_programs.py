"""Ports of real programs on the public API end with the same weights under every launcher.

tests/api_scripts/real_programs.py runs, in one process job, a word language model
(LSTM, carried hidden state, clipping), a DCGAN (two prepared models, three backward
passes per step, a rank-0 preview), a Hugging Face style classifier (dict batches,
padding collate, gradient accumulation under no_sync, warm-up schedule) and a model
with unused parameters (find_unused_parameters=True). All in float64 with a fixed
global batch: every launcher and world size must end within 1e-9 of one plain
python process, with every rank holding rank 0's weights bit for bit.
Each launcher is started once; its four programs are checked by separate tests.
"""
import json
import re
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

SCRIPT = str(Path(__file__).resolve().parent / "api_scripts" / "real_programs.py")
PROGRAMS = ("lm", "gan", "hf", "branch")
TIMEOUT = 180
TOLERANCE = 1e-9
PREVIEW_STEPS = list(range(4, 61, 4))  # the GAN's 60 steps, a preview every 4 on rank 0

# name -> (command for the script's arguments, world size, backend the job must pick)
LAUNCHERS = {
    "torchrun-2": (lambda a: [TORCHRUN, "--standalone", "--nproc-per-node=2", SCRIPT, *a], 2, "torch"),
    "torchrun-3": (lambda a: [TORCHRUN, "--standalone", "--nproc-per-node=3", SCRIPT, *a], 3, "torch"),
    "horovodrun-gloo": (lambda a: [HOROVODRUN, "-np", "2", "--gloo", PYTHON, SCRIPT, *a], 2, "horovod"),
    "horovodrun-mpi": (lambda a: [HOROVODRUN, "-np", "2", "--mpi", PYTHON, SCRIPT, *a], 2, "horovod"),
    "mpirun": (lambda a: [MPIRUN, *MPIRUN_FLAGS, "-np", "2", PYTHON, SCRIPT, *a], 2, "horovod"),  # auto: Horovod
    "mpirun-torch": (lambda a: [MPIRUN, *MPIRUN_FLAGS, "-np", "2", PYTHON, SCRIPT, *a, "--backend", "torch"], 2,
                     "torch"),
}
# make test runs the programs under torchrun-2 and horovodrun-gloo, one launch per backend; the rest is the
# launcher matrix (conftest.in_matrix), which make test-e2e runs.
MATRIX = {"torchrun-3", "horovodrun-mpi", "mpirun", "mpirun-torch"}


def load(out: Path, program: str) -> dict:
    return torch.load(out / f"{program}.pt", weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One plain python process (the local backend) with the whole global batch."""
    return one_process_reference(tmp_path_factory.mktemp("real_programs_local"), SCRIPT, PROGRAMS, TIMEOUT)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """``launched(name)``: (output dir, result) of the script under that launcher, started once per module."""
    commands = {name: command for name, (command, _, _) in LAUNCHERS.items()}
    return launch_once(tmp_path_factory, "real_programs", commands, TIMEOUT)


# ----- per program: the same weights as one process, on every rank ---------------------------------
def check_lm(saved, ref):
    # The loss each step, averaged over the ranks, is the one process's loss over the global batch.
    assert len(saved["losses"]) == 24
    assert max(abs(a - b) for a, b in zip(saved["losses"], ref["losses"])) <= TOLERANCE


def check_gan(saved, ref):
    assert saved["steps"] == 60
    # The rank-0-only previews happened on rank 0 alone (the other ranks went on without it).
    assert [extra["previews"] for extra in saved["per_rank"]] == [PREVIEW_STEPS] + [[]] * (saved["world_size"] - 1)


def check_hf(saved, ref):
    # 2 epochs of 41 micro-batches of 24 (1001 samples: 17 left out per epoch), 2 per step, the last one alone.
    assert len(saved["norms"]) == len(ref["norms"]) == 42
    # job.clip_grad_norm_'s total norm is the same on every rank and the one process's.
    for extra in saved["per_rank"]:
        assert extra["norms"] == saved["norms"] and extra["lrs"] == ref["lrs"]
    assert max(abs(a - b) for a, b in zip(saved["norms"], ref["norms"])) <= TOLERANCE


def check_branch(saved, ref):
    # aux_head had no gradient (None, not zeros) exactly on the steps no rank used it, on every rank.
    expected = [step % 2 == 1 for step in range(30)]
    assert ref["aux_grad_none"] == expected
    assert [extra["aux_grad_none"] for extra in saved["per_rank"]] == [expected] * saved["world_size"]


CHECKS = {"lm": check_lm, "gan": check_gan, "hf": check_hf, "branch": check_branch}


@pytest.mark.parametrize("launcher,program", [
    pytest.param(name, program, id=f"{name}-{program}", marks=[pytest.mark.matrix] if name in MATRIX else [])
    for name in LAUNCHERS for program in PROGRAMS])
def test_program_matches_one_process(launcher, program, reference, launched):
    out, _ = launched(launcher)
    saved, ref = load(out, program), reference[program]
    _, world_size, backend = LAUNCHERS[launcher]
    # The world size and backend the job saw: ranks that each trained alone would also "match".
    assert (saved["world_size"], saved["backend"]) == (world_size, backend)
    assert saved["final"].keys() == ref["final"].keys()
    assert not [key for key in saved["final"] if key.startswith("module.")]
    assert all(value.dtype == torch.float64 for value in saved["final"].values() if value.is_floating_point())
    # Rank 0 started where the one process started (prepare gave every rank rank 0's weights) ...
    assert max_abs_diff(saved["initial"], ref["initial"]) == 0.0
    # ... every rank ended with rank 0's weights, bit for bit ...
    assert saved["cross_rank_max_diff"] == 0.0, f"{launcher} {program}: ranks' weights differ"
    # ... and with the one process's.
    diff = max_abs_diff(saved["final"], ref["final"])
    assert diff <= TOLERANCE, f"{launcher} {program}: max abs weight difference {diff:.3g} vs one process"
    # The weights moved: a run that silently did nothing would also "match" a reference that did nothing.
    assert max_abs_diff(saved["final"], saved["initial"]) > 1e-3
    CHECKS[program](saved, ref)


# ----- the GAN's preview: on rank 0 only, without a hang, on the generator of that step --------------
@pytest.mark.parametrize("launcher", ["torchrun-2", "horovodrun-gloo"])
def test_gan_preview_runs_on_rank_0_only(launcher, reference, launched):
    out, result = launched(launcher)
    assert sorted(p.name for p in out.glob("gan_preview_*.pt")) == \
        sorted(f"gan_preview_rank0_step{step}.pt" for step in PREVIEW_STEPS)
    assert re.findall(r"gan: preview at step (\d+) on rank (\d+)", result.stdout) == \
        [(str(step), "0") for step in PREVIEW_STEPS]
    for step in PREVIEW_STEPS:
        name = f"gan_preview_rank0_step{step}.pt"
        preview = torch.load(out / name, weights_only=True)
        expected = torch.load(reference["out"] / name, weights_only=True)
        assert preview.shape == (16, 2) and (preview - expected).abs().max().item() <= TOLERANCE


# ----- attribute and state_dict forwarding through the DDP wrapper -------------------------------------
def test_prepared_ddp_model_forwards_init_hidden_and_plain_state_dict_keys_under_torchrun(reference, launched):
    out, result = launched("torchrun-2")
    saved = load(out, "lm")
    # The script called model.init_hidden on a real DDP wrapper, and its state_dict() had the user's keys
    # (asserted in the script, which would have exited non-zero).
    assert saved["prepared_is_ddp"] is True and saved["prepared_type"] == "PreparedDDP"
    assert "lm: prepared model is PreparedDDP (a DDP wrapper: True)" in result.stdout
    keys = list(saved["final"])
    assert keys == list(reference["lm"]["final"]) and keys[0] == "encoder.weight"
    assert not [key for key in keys if key.startswith("module.")]


# ----- mistakes with a prepared model ------------------------------------------------------------
MISUSE = str(Path(__file__).resolve().parent / "api_scripts" / "prepared_misuse.py")
MISUSE_LAUNCHERS = {
    "torchrun": lambda mode: [TORCHRUN, "--standalone", "--nproc-per-node=2", MISUSE, mode],
    "horovodrun-gloo": lambda mode: [HOROVODRUN, "-np", "2", "--gloo", PYTHON, MISUSE, mode],
}


@pytest.mark.parametrize("launcher", list(MISUSE_LAUNCHERS))
def test_a_rank_0_forward_with_gradients_and_no_backward_just_works(launcher):
    # (Declared unused parameters are covered by the "branch" program under every launcher.)
    result = check(run(MISUSE_LAUNCHERS[launcher]("preview"), timeout=120))
    assert "finished" in result.stdout


@pytest.mark.parametrize("launcher", list(MISUSE_LAUNCHERS))
def test_unused_parameters_not_declared_end_in_one_line_naming_the_option(launcher):
    # The script's timeout is 60 s: the line must come from the check, not from the watchdog.
    result = run(MISUSE_LAUNCHERS[launcher]("unused"), timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "finished" not in result.stdout, output[-3000:]
    # torchrun repeats a worker's last line in its summary: count the distinct messages.
    lines = sorted({line[line.index("trainbridge: error:"):] for line in output.splitlines()
                    if "trainbridge: error:" in line})
    # One line with the cause, from the rank that skipped the layer; the other rank may add
    # its own one line, that a peer failed (the launcher names the first as the root cause).
    causes = [line for line in lines if "find_unused_parameters=True" in line]
    assert len(causes) == 1 and ("rank 1" in causes[0] or "head.weight" in causes[0]), output[-3000:]
    assert all(line in causes or "another rank" in line for line in lines), output[-3000:]
    assert "prepared_misuse.py\", line" not in output, output[-3000:]  # no traceback through the user's code


AMP_CLIP = str(Path(__file__).resolve().parent / "api_scripts" / "amp_clip.py")


@pytest.mark.parametrize("launcher", ["torchrun", "horovodrun-gloo"])
def test_clip_grad_norm_takes_the_fp16_loss_scale_out_first(launcher):
    cmd = {"torchrun": [TORCHRUN, "--standalone", "--nproc-per-node=2", AMP_CLIP],
           "horovodrun-gloo": [HOROVODRUN, "-np", "2", "--gloo", PYTHON, AMP_CLIP]}[launcher]
    result = check(run(cmd, timeout=120))
    line = next(line for line in result.stdout.splitlines() if '"rank"' in line)
    rows = json.loads(line[line.index("[{"):])  # horovodrun prefixes "[0]<stdout>:"
    assert sorted(row["rank"] for row in rows) == [0, 1]
    for row in rows:
        assert row["scale"] > 1  # the gradients were scaled: a clip that forgot it would see scale x norm
        assert row["returned"] == pytest.approx(row["expected"], rel=1e-6)
        assert row["applied"] <= 0.01 * (1 + 1e-5) < row["returned"]
    assert rows[0]["returned"] == rows[1]["returned"]  # averaged gradients: the same norm on every rank
