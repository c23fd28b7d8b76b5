"""A new user's bad inputs: no silent wrong result, no lost checkpoint, no hang, no traceback.

One test per finding of the sweep (the Horovod-facade findings are in tests/test_hvd_*.py),
plus a table of bad command-line values checked in-process, without a launcher.
"""
import json
import os
import shutil
import time

import pytest
import torch
from conftest import (
    SAMPLE,
    TRAIN,
    check,
    copy_of,
    env_ranks,
    load_final,
    plain,
    read_metrics,
    run,
    start_waits,
    train_here,
)
from test_bad_input import assert_one_clear_line

from trainbridge.cli.data import main as data_main
from trainbridge.cli.train import main as train_main
from trainbridge.data.designsafe_sample import make_sample
from trainbridge.launch.rendezvous import free_port

QUICK = [*SAMPLE, "--epochs", "1"]


# ----- the table: every bad value gets its line and exit status 2, before any process group ---------
BAD_VALUES = [
    (["--lr", "inf"], r"--lr must be a positive finite number \(got inf\)"),
    (["--lr", "nan"], r"--lr must be a positive finite number \(got nan\)"),
    (["--lr", "-1"], r"--lr must be a positive finite number"),
    (["--gamma", "0"], r"--gamma must be a positive finite number"),
    (["--momentum", "0.9"], r"--momentum is an SGD option; --optimizer adadelta has no momentum"),
    (["--optimizer", "sgd", "--momentum", "1.5"], r"--momentum must be in \[0, 1\)"),
    (["--threads", "-1"], r"--threads must be at least 0 \(got -1"),
    (["--timeout", "0.001"], r"--timeout must be between 1 and \d+ seconds \(got 0.001\)"),
    (["--timeout", "inf"], r"--timeout must be between 1 and \d+ seconds \(got inf\)"),
    (["--batch-size", "0"], r"--batch-size must be at least 1"),
    (["--fail-rank", "-1"], r"--fail-rank must be at least 0"),
    (["--accumulate", "0"], r"--accumulate must be at least 1"),
    (["--task", "bogus"], r"unknown task 'bogus'"),
    (["--task", "./missing_task.py:Task"], r"task file ./missing_task.py does not exist"),
    (["--task", "os:path"], r"not a subclass of trainbridge.Task"),
]


@pytest.mark.parametrize("args,pattern", BAD_VALUES, ids=[" ".join(a) for a, _ in BAD_VALUES])
def test_bad_value_is_one_line_in_process(args, pattern, tmp_path, capsys):
    code = train_main([*QUICK, "--output-dir", str(tmp_path / "out"), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("trainbridge: error:"), err
    assert __import__("re").search(pattern, err[0]), err[0]


def test_output_dir_that_is_a_file_or_under_one(tmp_path, capsys):
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    for out in (afile, afile / "run"):
        assert train_main([*QUICK, "--output-dir", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{afile} is a file, not a folder" in err[0], err
    assert afile.read_text() == "mine"


@pytest.mark.skipif(os.geteuid() != 0, reason="a read-only bind mount in a private mount namespace needs root")
def test_read_only_output_dir_is_refused_before_training(tmp_path):
    out = tmp_path / "ro"
    out.mkdir()
    # A private mount namespace: the read-only bind mount disappears with the process.
    script = f'mount --bind "{out}" "{out}" && mount -o remount,ro,bind "{out}" && exec "$@"'
    started = time.monotonic()
    result = run(["unshare", "--mount", "sh", "-c", script, "sh", *plain([*QUICK, "--output-dir", str(out)])],
                 timeout=120)
    assert_one_clear_line(result, r"--output-dir .*ro is not writable \(Read-only file system\)")
    assert "epoch 1" not in result.stdout and time.monotonic() - started < 60  # refused before training


# ----- 1. a hidden folder in Train/ is not a class ---------------------------------------------------
def test_hidden_folder_in_train_is_not_a_class(tmp_path):
    data = tmp_path / "data"
    make_sample(str(data), train_per_class=4)
    hidden = data / "Train" / ".ipynb_checkpoints"
    hidden.mkdir()
    shutil.copy(data / "Train" / "C0" / "c0_000.png", hidden / "c0_000-checkpoint.png")
    (data / "Train" / "C2" / ".hidden.png").write_bytes(b"not an image")  # hidden files are no images either
    result = check(run(plain(["--task", "designsafe", "--data-root", str(data), "--no-pretrained", "--image-size", "32",
                              "--batch-size", "6", "--epochs", "1", "--no-progress",
                              "--output-dir", str(tmp_path / "o")]),
                       timeout=300))
    report = json.loads((tmp_path / "o" / "report_val.json").read_text())
    assert report["classes"] == ["C0", "C2", "C4"] and report["samples"] == 36, result.stdout
    from trainbridge.data.imagefolder import load_split

    train = load_split(str(data / "Train"), transform=None)
    assert train.classes == ["C0", "C2", "C4"] and len(train) == 12


def test_corrupt_image_in_a_class_sub_folder_is_named_before_training(tmp_path):
    data = tmp_path / "data"
    make_sample(str(data), train_per_class=4)
    nested = data / "Train" / "C4" / "batch2"
    nested.mkdir()
    (nested / "broken.jpg").write_bytes(b"\xff\xd8 truncated")
    result = run(plain(["--task", "designsafe", "--data-root", str(data), "--no-pretrained", "--image-size", "32",
                        "--no-progress", "--output-dir", str(tmp_path / "o")]), timeout=300)
    assert_one_clear_line(result, r"broken\.jpg")
    assert "epoch 1" not in result.stdout


# ----- 2. a job started by environment variables alone is one job --------------------------------
def test_env_contract_without_a_launcher_is_one_job(tmp_path):
    procs = env_ranks([*TRAIN, *QUICK, "--max-steps", "6", "--output-dir", str(tmp_path)], free_port())
    outputs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    rows = read_metrics(tmp_path)
    assert [r["event"] for r in rows if "event" in r] == ["final"]  # one job, one final row
    assert rows[-1]["world_size"] == 2 and rows[-1]["launcher"] == "env" and rows[-1]["backend"] == "torch"


# ----- 3. changed training options are not resumed silently ----------------------------------------
@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """The folder of a finished 4-step run: the tests below resume from, or start over in, a copy of it."""
    out = tmp_path_factory.mktemp("four_steps")
    check(train_here([*QUICK, "--max-steps", "4", "--output-dir", str(out)]))
    return out


def test_resume_with_changed_options_names_them(tmp_path, four_steps):
    copy_of(four_steps, tmp_path)
    before = (tmp_path / "last.pt").read_bytes()
    result = train_here([*QUICK, "--max-steps", "8", "--lr", "0.5", "--batch-size", "64",
                         "--output-dir", str(tmp_path)])
    assert_one_clear_line(result, r"--lr 1\.0 -> 0\.5.*global batch .* 128 -> 64"
                                  r".*--allow-option-changes.*--resume never")
    assert (tmp_path / "last.pt").read_bytes() == before
    result = check(train_here([*QUICK, "--max-steps", "8", "--lr", "0.5", "--batch-size", "64",
                               "--allow-option-changes", "--output-dir", str(tmp_path)]))
    assert "resuming with changed options" in result.stdout and load_final(tmp_path)["step"] == 8


# ----- 4. a diverging run stops at the first non-finite loss and keeps the finite checkpoint ----------
def test_divergence_stops_with_the_step_and_keeps_finite_checkpoints(tmp_path):
    result = train_here([*QUICK, "--optimizer", "sgd", "--lr", "1e6", "--max-steps", "30", "--checkpoint-every", "1",
                         "--output-dir", str(tmp_path)])
    assert_one_clear_line(result, r"loss became NaN or infinite at step (\d+);.*last\.pt is the last finite checkpoint")
    for name in ("last.pt", "previous.pt"):
        state = torch.load(tmp_path / name, weights_only=True)["model"]
        assert all(torch.isfinite(v).all() for v in state.values())
    assert not (tmp_path / "final.pt").exists() and not (tmp_path / "best.pt").exists()
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():  # valid JSON: no NaN, no Infinity
        json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl"))


# ----- 6. options that would do nothing ------------------------------------------------------------
def test_fail_at_step_on_one_process_is_refused(tmp_path):
    result = train_here([*QUICK, "--fail-at-step", "3", "--output-dir", str(tmp_path)])
    assert_one_clear_line(result, r"--fail-rank 1 does not exist in a job of 1 process"
                                  r".*--fail-at-step would do nothing")


# ----- 7. starting over never destroys the only good model ---------------------------------------------
def test_resume_never_moves_the_finished_run_aside(tmp_path, four_steps):
    copy_of(four_steps, tmp_path)
    files = {name: (tmp_path / name).read_bytes() for name in ("best.pt", "last.pt", "final.pt", "metrics.jsonl")}
    result = check(train_here([*QUICK, "--max-steps", "2", "--resume", "never", "--output-dir", str(tmp_path)]))
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("previous-run-")]
    assert len(aside) == 1 and f"moved to {aside[0]}" in result.stdout
    assert {name: (aside[0] / name).read_bytes() for name in files} == files  # the old run, byte for byte
    assert load_final(tmp_path)["step"] == 2 and len(read_metrics(tmp_path)) == 2


# ----- 8. make-sample never deletes what it did not write ------------------------------------------------
def test_make_sample_again_keeps_the_users_files(tmp_path, capsys):
    out = tmp_path / "sample"
    assert data_main(["make-sample", "designsafe", "--out", str(out)]) == 0
    (out / "Train" / "C0" / "notes.txt").write_text("mine")
    (out / "my_labels.csv").write_text("a,b")
    assert data_main(["make-sample", "designsafe", "--out", str(out), "--seed", "1"]) == 0
    assert (out / "Train" / "C0" / "notes.txt").read_text() == "mine" and (out / "my_labels.csv").exists()
    assert len(list((out / "Train" / "C0").glob("c0_*.png"))) == 40
    assert data_main(["make-sample", "designsafe", "--out", str(out / "my_labels.csv")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"trainbridge: error: --out {out / 'my_labels.csv'} is a file; "
                       f"give a folder to write the sample into")


# ----- 9. a port held by another program: one line per rank, within the timeout ------------------------
def test_port_held_by_another_program_does_not_hang(tmp_path):
    import socket

    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", 0))
    holder.listen(8)  # accepts connections and never answers
    port = holder.getsockname()[1]
    try:
        started = time.monotonic()
        procs = env_ranks([*TRAIN, *QUICK, "--timeout", "5", "--output-dir", str(tmp_path)], port)
        outputs = [p.communicate(timeout=120) for p in procs]
        elapsed = time.monotonic() - started
    finally:
        holder.close()
    # The imports come on top of the join's bound (timeout + 5 s): up to 20 s on a slow, busy 2-core machine.
    assert all(p.returncode != 0 for p in procs) and elapsed < 5 + 5 + 45, (elapsed, outputs)
    errors = [[line for line in err.splitlines() if line.startswith("trainbridge: error:")] for _, err in outputs]
    assert len(errors[0]) == 1 and f"port {port}" in errors[0][0] and "another program holds it" in errors[0][0]
    assert len(errors[1]) == 1 and "MASTER_PORT is not held by another program" in errors[1][0]
    waited = start_waits(errors[1][0])
    assert waited and max(waited) <= 5 + 5 + 1, errors[1][0]
    assert not any("Traceback" in err for _, err in outputs)


# ----- 11. a failure on rank 0 reaches torchrun's summary as rank 0's own line ----------------------------
def test_rank0_failure_is_torchruns_root_cause(tmp_path):
    from conftest import torchrun

    # Only rank 0 writes checkpoints: a file-size limit fails its first write, mid-training.
    limited = ["bash", "-c", 'ulimit -f 512; trap "" XFSZ; exec "$@"', "bash",
               *torchrun(2, [*QUICK, "--max-steps", "12", "--checkpoint-every", "5", "--output-dir", str(tmp_path)])]
    result = run(limited, timeout=180)
    assert result.returncode != 0
    root = result.stderr.split("Root Cause (first observed failure):", 1)[1]
    assert "rank      : 0" in root and "trainbridge: error: cannot write the checkpoint" in root, result.stderr
