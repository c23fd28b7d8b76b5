"""DesignSafe under the real launchers, on the synthetic sample (CPU, 2 processes).

The sample runs train from scratch (--no-pretrained: no download here) at 64 px,
so they use a higher learning rate than the task's 1e-4 fine-tuning default
(--lr 1e-3) and --plateau-patience 1, so that the plateau scheduler really
steps within a few epochs and the per-rank learning rates are checked after it.
The 12-epoch accuracy runs are the DesignSafe guide's own commands, run as written by
tests/test_docs_literal.py and checked by ``assert_sample_run_reached_80_percent``.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from conftest import check, horovodrun, in_matrix, read_metrics, run, torchrun, train_here

from trainbridge.data.designsafe_sample import make_sample
from trainbridge.models.resnet import HEAD_PREFIX, resnet34_classifier

LAUNCHERS = {
    "torchrun": lambda args: torchrun(2, args),
    "horovodrun": lambda args: horovodrun(2, "gloo", args),
}
SAMPLE_RUN = ["--task", "designsafe", "--no-pretrained", "--image-size", "64", "--batch-size", "8",
              "--lr", "1e-3", "--plateau-patience", "1", "--no-progress"]
ACCURACY_EPOCHS = 12  # the guide's runs
TIMEOUT = 540  # seconds per multi-process run (about 2-4 min on 2 busy cores); a hang fails the test


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("designsafe") / "sample"
    make_sample(str(root), seed=0)
    return str(root)


def assert_sample_run_reached_80_percent(out: Path) -> None:
    """What a 12-epoch run of ``SAMPLE_RUN`` on 2 ranks must leave in ``out``.

    The guide's commands (docs/guides/designsafe.md) are those runs, under torchrun and horovodrun:
    tests/test_docs_literal.py runs them as written and checks their folders with this.
    """
    rows = [r for r in read_metrics(out) if "event" not in r]
    assert len(rows) == ACCURACY_EPOCHS and all(r["world_size"] == 2 for r in rows)

    # The learning rate each rank will use next, gathered from both processes after every
    # scheduler step, is the same; and the plateau scheduler did step at least once.
    assert all(len(r["next_lr_per_rank"]) == 2 and len(set(r["next_lr_per_rank"])) == 1 for r in rows), rows
    assert any(r["next_lr_per_rank"][0] < r["lr"] for r in rows), [r["lr"] for r in rows]

    # The best model, scored exactly over both ranks' shards, reaches 80% on validation.
    best = max(rows, key=lambda r: (r["val_accuracy"], -r["val_loss"]))  # ties: the lower loss
    report = json.loads((out / "report_val.json").read_text())
    assert report["accuracy"] >= 0.8, (report["accuracy"], [r["val_accuracy"] for r in rows])
    assert report["samples"] == 36 and report["epoch"] == best["epoch"]
    assert sum(map(sum, report["confusion_matrix"])) == 36
    assert set(report["per_class"]) == {"C0", "C2", "C4"}
    test_report = json.loads((out / "report_test.json").read_text())
    assert test_report["samples"] == 18
    for name in ("confusion_val.png", "confusion_test.png", "final.pt"):
        assert (out / name).stat().st_size > 0


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_freeze_backbone_keeps_backbone_bitwise(launcher, sample, tmp_path):
    # "Pretrained" weights from a file: random ones, so that the test needs no download.
    torch.manual_seed(123)
    weights = tmp_path / "resnet34.pth"
    torch.save(resnet34_classifier(3).state_dict(), weights)
    out = tmp_path / "out"
    # At the smallest image size, a quarter of 64 px's pixels: what stays frozen does not depend on it.
    check(run(LAUNCHERS[launcher]([*SAMPLE_RUN[:2], "--data-root", sample, "--image-size", "32", "--batch-size", "8",
                                   "--lr", "1e-3", "--epochs", "2", "--no-progress", "--pretrained-weights",
                                   str(weights), "--freeze-backbone", "--output-dir", str(out)]), timeout=TIMEOUT))
    final = torch.load(out / "final.pt", weights_only=True)["model"]
    loaded = torch.load(weights, weights_only=True)
    backbone = [k for k in final if not k.startswith(HEAD_PREFIX)]
    assert backbone and all(torch.equal(final[k], loaded[k]) for k in backbone)  # BatchNorm statistics too
    # The head trained: it moved away from its initial weights (the loop seeds with --seed, default 1).
    torch.manual_seed(1)
    initial = resnet34_classifier(3, weights_path=str(weights)).state_dict()
    for key in ("fc.0.weight", "fc.2.weight", "fc.2.bias"):
        assert torch.isfinite(final[key]).all() and not torch.equal(final[key], initial[key]), key
    assert all(math.isfinite(r["train_loss"]) for r in read_metrics(out))


def break_layout(root: Path, problem: str) -> str:
    """Damage a copy of the sample; returns the text the error line must contain."""
    if problem == "missing-validation":
        for path in sorted((root / "Validation").rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        (root / "Validation").rmdir()
        return "has no Validation/ folder"
    if problem == "classes-differ":
        (root / "Validation" / "C2").rename(root / "Validation" / "C3")
        return "class folders differ between Train/ and Validation/"
    if problem == "empty-class":
        for path in (root / "Train" / "C4").iterdir():
            path.unlink()
        return "has no images"
    if problem == "unreadable-image":
        bad = root / "Train" / "C0" / "c0_007.png"
        bad.write_bytes(b"not a picture")
        return f"unreadable image file {bad}"
    raise AssertionError(problem)


@pytest.mark.parametrize("problem", ["missing-validation", "classes-differ", "empty-class", "unreadable-image",
                                     "image-size"])
def test_bad_input_is_one_line(problem, sample, tmp_path):
    import shutil

    root = tmp_path / "data"
    shutil.copytree(sample, root)
    size = "31" if problem == "image-size" else "64"
    expected = "--image-size must be at least 32" if problem == "image-size" else break_layout(root, problem)
    result = train_here(["--task", "designsafe", "--data-root", str(root), "--no-pretrained", "--image-size", size,
                         "--output-dir", str(tmp_path / "out")])
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainbridge: error: ") and expected in lines[0], result.stderr


@pytest.mark.parametrize("launcher", in_matrix(list(LAUNCHERS), {"horovodrun"}))
def test_bad_input_under_launchers_fails_fast(launcher, sample, tmp_path):
    import shutil

    root = tmp_path / "data"
    shutil.copytree(sample, root)
    expected = break_layout(root, "classes-differ")
    result = run(LAUNCHERS[launcher]([*SAMPLE_RUN, "--data-root", str(root), "--output-dir", str(tmp_path / "out")]),
                 timeout=180)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    # Every rank finds the problem before any process group starts; rank 0 alone reports it
    # (torchrun repeats that line in its failure summary, indented).
    reported = [line for line in output.splitlines()
                if re.sub(r"^\[[\d,]+\]<std(?:out|err)>:", "", line).startswith("trainbridge: error: ")]
    assert len(reported) == 1 and expected in reported[0], (reported, output[-3000:])
