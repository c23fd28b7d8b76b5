"""A bad --task file ends in one line ``trainbridge: error: ...`` naming the problem and the fix.

Exit status 2 (under torchrun: rank 0's, and its line alone), no traceback, nothing trained.
What can work does: metrics given as Python numbers, and a task without a validation split,
which trains without evaluating. The small task files are written to tmp_path. Torchrun runs a
representative few (one before the process group starts, one after, one at the first step);
the others run as one process, in the test process (``conftest.train_here``).
"""
import re
import subprocess
from pathlib import Path
from typing import Optional

import pytest
import torch
from conftest import TORCHRUN, check, load_final, read_metrics, run, torchrun, train_here

GOOD = '''import torch
from torch import nn
from torch.utils.data import TensorDataset

import trainbridge as tb


class Small(tb.Task):
    name = "small"
    default_optimizer = "adam"
    default_lr = 1e-2

    def load_data(self, cfg, note):
        generator = torch.Generator().manual_seed(0)
        x = torch.rand(48, 2, generator=generator)
        y = (x.sum(dim=1) > 1).long()
        self.splits = {"train": TensorDataset(x[:32], y[:32]), "val": TensorDataset(x[32:], y[32:])}
        return "small: 32 train / 16 val"

    @property
    def train_dataset(self):
        return self.splits["train"]

    def eval_dataset(self, split):
        return self.splits.get(split)

    def build_model(self, cfg):
        return nn.Linear(2, 2)
'''
END = GOOD.count("\n") + 2  # the line of a statement appended after a blank line
ARGS = ["--epochs", "2", "--batch-size", "8", "--no-progress"]
NO_VAL = ("return self.splits.get(split)", "return None")
PER_SAMPLE_LOSS = '''
    def loss(self, outputs, targets, reduction="mean"):
        return nn.functional.cross_entropy(outputs, targets, reduction="none")
'''


def edited(*replacements, prefix: str = "", suffix: str = "") -> str:
    source = GOOD
    for old, new in replacements:
        assert old in source, old
        source = source.replace(old, new)
    return prefix + source + suffix


def with_metrics(expression: str) -> str:
    return edited(suffix=f"\n    def metrics(self, outputs, targets):\n        return {expression}\n")


def task_file(tmp_path: Path, source: str) -> str:
    # Its own name: a process caches a loaded task file by name, and in-process tests share the process.
    path = tmp_path / f"{re.sub(r'[^a-z0-9]+', '_', tmp_path.name.lower())}.py"
    path.write_text(source)
    return f"{path}:Small"


def launcher_report_removed(stderr: str) -> str:
    """stderr without torchrun's own ending: the launcher prints a traceback of its ChildFailedError
    (and the rank's line again, as the root cause) whenever a rank fails."""
    return stderr.split(f'Traceback (most recent call last):\n  File "{TORCHRUN}"')[0]


def assert_one_line(result: subprocess.CompletedProcess, pattern: str, out: Path, launcher: str) -> None:
    lines = [line for line in result.stderr.splitlines() if line.startswith("trainbridge: error:")]
    assert len(lines) == 1, result.stderr[-4000:]
    assert re.search(pattern, lines[0]), lines[0]
    if launcher == "torchrun":
        assert result.returncode != 0 and re.search(r"exitcode\s*: 2 ", result.stderr), result.stderr[-3000:]
    else:
        assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in launcher_report_removed(result.stderr), result.stderr[-4000:]
    assert not (out / "last.pt").exists() and not (out / "final.pt").exists()  # refused before any training


def train(tmp_path: Path, source: str, launcher: str, extra: Optional[list] = None) -> subprocess.CompletedProcess:
    args = ["--task", task_file(tmp_path, source), *ARGS, "--output-dir", str(tmp_path / "out"), *(extra or [])]
    if launcher == "torchrun":
        return run(torchrun(2, args), timeout=150)
    return train_here(args)


# name: (task source, extra options, the line's pattern)
CASES = {
    "syntax error": (
        edited(suffix="\ndef broken(:\n    pass\n"), [],
        rf"task file \S+\.py, line {END}: syntax error \(invalid syntax\); correct it "
        rf"\(python -m py_compile \S+\.py shows the spot\)"),
    "import error": (
        edited(prefix="import not_a_real_module_xyz\n"), [],
        r"task file \S+\.py, line 1: No module named 'not_a_real_module_xyz'; install the package that "
        r"provides 'not_a_real_module_xyz' into this Python \(\S+python\S*\), or remove the import"),
    "exception at import": (
        edited(suffix='\nraise RuntimeError("no data folder configured")\n'), [],
        rf"task file \S+\.py, line {END}: importing it raised RuntimeError: no data folder configured; "
        rf"fix the file \(python \S+\.py shows the traceback\)"),
    "sys.exit(0) at import": (
        edited(suffix="\nimport sys\nsys.exit(0)\n"), [],
        rf"task file \S+\.py, line {END + 1}: calls sys.exit\(0\) while being imported, so nothing would be "
        rf"trained; put script code under if __name__ == '__main__':"),
    "abstract class": (
        edited(("def build_model", "def make_model"), ("def eval_dataset", "def eval_split")), [],
        r"Small does not define build_model, eval_dataset; define them in the class"),
    "load_data still called prepare": (
        edited(("def load_data", "def prepare")), [],
        r"Small.prepare is now called load_data; rename the method"),
    "build_model returns None": (
        edited(("return nn.Linear(2, 2)", "nn.Linear(2, 2)")), [],
        r"Small.build_model returned None \(a missing return\?\), not a torch.nn.Module; return the model itself"),
    "per-sample loss": (
        edited(suffix=PER_SAMPLE_LOSS), [],
        r"Small.loss\(\.\.\., reduction='sum'\) returned a tensor of shape \(2,\), not one number; return a tensor "
        r"reduced over the batch"),
    "per-sample training loss, no validation split": (
        edited(NO_VAL, suffix=PER_SAMPLE_LOSS), [],
        r"Small.loss\(\.\.\., reduction='mean'\) returned a tensor of shape \(8,\), not one number"),
    "metric as a list": (
        with_metrics('{"accuracy": (outputs.argmax(1) == targets).tolist()}'), [],
        r"Small.metrics: 'accuracy' is a list of 2 values; give each metric as one number per batch, the sum over "
        r"its samples"),
    "metric per sample": (
        with_metrics('{"accuracy": outputs.argmax(1) == targets}'), [],
        r"Small.metrics: 'accuracy' is a tensor of shape \(2,\); give each metric as one number per batch"),
    "empty validation set": (
        edited(('"val": TensorDataset(x[32:], y[32:])', '"val": TensorDataset(x[:0], y[:0])')), [],
        r"Small.eval_dataset\('val'\) has no samples, so no epoch could be evaluated; give it samples, or return "
        r"None to train without validation"),
    "plateau without a validation split": (
        edited(NO_VAL), ["--scheduler", "plateau"],
        r"--scheduler plateau steps on the validation loss, but Small.eval_dataset\('val'\) is None; "
        r"use --scheduler step"),
}
UNDER_TORCHRUN = ("syntax error", "empty validation set", "per-sample training loss, no validation split")


@pytest.mark.parametrize("case", [c for c in CASES if c not in UNDER_TORCHRUN])
def test_bad_task_is_one_line(case, tmp_path):
    source, extra, pattern = CASES[case]
    assert_one_line(train(tmp_path, source, "plain", extra), pattern, tmp_path / "out", "plain")


@pytest.mark.parametrize("case", UNDER_TORCHRUN)
def test_bad_task_is_one_line_from_rank_0_under_torchrun(case, tmp_path):
    source, extra, pattern = CASES[case]
    assert_one_line(train(tmp_path, source, "torchrun", extra), pattern, tmp_path / "out", "torchrun")


def test_metrics_as_python_numbers_are_summed(tmp_path):
    source = with_metrics('{"accuracy": float((outputs.argmax(1) == targets).sum()), "seen": len(targets)}')
    result = check(train(tmp_path, source, "plain"))
    assert "Traceback" not in result.stderr
    last = read_metrics(tmp_path / "out")[-1]
    model = torch.nn.Linear(2, 2)
    model.load_state_dict(load_final(tmp_path / "out")["model"])
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(48, 2, generator=generator)
    y = (x.sum(dim=1) > 1).long()
    with torch.no_grad():
        accuracy = (model(x[32:]).argmax(1) == y[32:]).double().mean().item()
    assert abs(last["val_accuracy"] - accuracy) < 1e-9 and last["val_seen"] == 1.0, last


def test_no_validation_split_trains_without_evaluating(tmp_path):
    result = check(train(tmp_path, edited(NO_VAL), "plain"))
    out = tmp_path / "out"
    rows = read_metrics(out)
    assert "Traceback" not in result.stderr and "done: train_loss" in result.stdout, result.stdout
    assert [r["epoch"] for r in rows if "event" not in r] == [1, 2] and rows[-1]["event"] == "final"
    assert not [k for r in rows for k in r if k.startswith("val_")], rows
    assert (out / "final.pt").exists() and (out / "last.pt").exists() and not (out / "best.pt").exists()


PATH_OPTION = '''
import dataclasses
import pathlib

from trainbridge.tasks import option


class WithPath(Small):
    @dataclasses.dataclass
    class Options:
        notes_dir: pathlib.Path = option(pathlib.Path("notes"), help="a folder", same_on_resume=True)
'''


def test_a_path_option_is_saved_as_its_string_and_the_run_resumes(tmp_path):
    # Before: the checkpoint held a pathlib.Path, which torch.load(weights_only=True) refuses, so the
    # resume called a good last.pt "corrupt or truncated" and moved it aside.
    task = task_file(tmp_path, GOOD + PATH_OPTION).replace(":Small", ":WithPath")
    out = tmp_path / "out"
    args = ["--task", task, "--batch-size", "8", "--no-progress", "--notes-dir", str(tmp_path / "notes"),
            "--output-dir", str(out)]
    check(train_here([*args, "--epochs", "1"]))
    saved = torch.load(out / "last.pt", weights_only=True)["config"]["task_options"]
    assert saved == {"notes_dir": str(tmp_path / "notes")}, saved
    resumed = check(train_here([*args, "--epochs", "2"]))
    assert "resuming from" in resumed.stdout and "corrupt" not in resumed.stdout + resumed.stderr, resumed.stdout
    assert not list(out.glob("*.corrupt")) and load_final(out)["epoch"] == 2
