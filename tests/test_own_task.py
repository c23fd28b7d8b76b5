"""A user's Task loaded by file path: a regression with its own loss, metric and option, under real launchers."""
from pathlib import Path

import pytest
import torch
from conftest import check, horovodrun, in_matrix, load_final, read_metrics, run, torchrun, train_here
from torch import nn

from trainbridge.cli.train import main as train_main

ROOT = Path(__file__).resolve().parents[1]
TASK = f"{ROOT}/examples/own_task.py:Wave"
# 1000 training points, a global batch of 50: 20 steps per epoch under every world size.
ARGS = ["--task", TASK, "--epochs", "2", "--noise", "0.1", "--no-progress"]


def wave_val(noise: float):
    """The task's validation split, rebuilt here from the same recipe (seeded generator)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(1200, 1, generator=generator) * 2 - 1
    y = torch.sin(3 * x) + noise * torch.randn(x.shape, generator=generator)
    return x[1000:], y[1000:]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("wave-1")
    check(train_here([*ARGS, "--batch-size", "50", "--output-dir", str(out)]))
    return out


def test_regression_metrics_are_the_tasks_own_and_exact(one_process):
    final, rows = load_final(one_process), read_metrics(one_process)
    model = nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 1))
    model.load_state_dict(final["model"])
    x, y = wave_val(0.1)
    with torch.no_grad():
        out = model(x)
    last = rows[-1]
    assert "val_accuracy" not in last and final["step"] == 40
    assert abs(last["val_mae"] - (out - y).abs().mean().item()) < 1e-6
    assert abs(last["val_loss"] - nn.functional.mse_loss(out, y).item()) < 1e-6
    # best.pt is chosen by the lowest validation loss when a task reports no accuracy
    best = torch.load(one_process / "best.pt", weights_only=True)
    assert best["best"]["val_loss"] == min(r["val_loss"] for r in rows if "next_lr_per_rank" in r)


@pytest.mark.parametrize("launcher", in_matrix(["torchrun", "horovodrun"], {"horovodrun"}))
def test_user_task_by_file_path_under_launchers(launcher, one_process, tmp_path):
    args = [*ARGS, "--batch-size", "25", "--output-dir", str(tmp_path)]
    cmd = torchrun(2, args) if launcher == "torchrun" else horovodrun(2, "gloo", args)
    check(run(cmd, timeout=300))
    final, reference = load_final(tmp_path), load_final(one_process)
    assert read_metrics(tmp_path)[-1]["world_size"] == 2 and final["step"] == 40
    # 2 ranks x 25 = the one process's batch of 50: the same samples per step
    diff = max((final["model"][k] - reference["model"][k]).abs().max().item() for k in reference["model"])
    assert diff < 1e-5, diff


def test_unknown_task_is_one_line(tmp_path, capsys):
    # Refused while the options are read, before any job starts: trainbridge train's main, in this process.
    for spec, words in ((f"{tmp_path}/missing.py:Task", "does not exist"), ("os:path", "not a subclass"),
                        (f"{ROOT}/examples/own_task.py:Nope", "has no 'Nope'")):
        code = train_main(["--task", spec, "--output-dir", str(tmp_path)])
        stderr = capsys.readouterr().err
        lines = stderr.strip().splitlines()
        assert code == 2 and len(lines) == 1 and words in lines[0], stderr
        assert lines[0].startswith("trainbridge: error:")
