"""trainbridge as a package: one version, a core that imports none of the optional packages."""
from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import PYTHON, check, run
from setuptools.config.setupcfg import read_configuration

import trainbridge
from trainbridge.optional import OPTIONAL

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_written_once_and_printed():
    """setup.cfg reads trainbridge/version.py, as trainbridge.__version__ does; ``--version`` prints it."""
    assert read_configuration(ROOT / "setup.cfg")["metadata"]["version"] == trainbridge.__version__
    result = check(run([PYTHON, "-m", "trainbridge", "--version"], timeout=60))
    assert result.stdout == f"trainbridge {trainbridge.__version__}\n"


def test_the_core_imports_no_optional_package():
    """The API, trainbridge.hvd and ``trainbridge doctor`` work with every optional package missing."""
    code = (f"import sys\nfor name in {sorted(OPTIONAL)!r}: sys.modules[name] = None\n"
            "import trainbridge, trainbridge.hvd\n"
            "from trainbridge.cli import main\n"
            "sys.exit(main(['doctor']))\n")
    result = check(run([PYTHON, "-c", code], timeout=60))
    assert re.search(rf"^trainbridge +{re.escape(trainbridge.__version__)} \(", result.stdout, re.M), result.stdout
    assert 'missing: torchvision (pip install "trainbridge[tasks]")' in result.stdout
    assert 'mpi4py (pip install "trainbridge[mpi]")' in result.stdout


def installed(python: Path) -> dict:
    """``{name: version}`` of the distributions installed for ``python``."""
    result = check(run([str(python), "-m", "pip", "list", "--format=json", "--disable-pip-version-check"],
                       timeout=120))
    return {entry["name"].lower(): entry["version"] for entry in json.loads(result.stdout)}


@pytest.mark.e2e  # a whole product install: a fresh venv, torch copied in, the wheel built and installed
def test_the_wheel_installs_beside_the_users_torch_and_keeps_it(tmp_path: Path):
    """A user's environment with its own torch: a fresh venv with the development pin. ``pip install`` of
    trainbridge's wheel adds only the core's numpy and psutil, leaves that torch alone, and the core runs."""
    venv = tmp_path / "venv"
    check(run([PYTHON, "-m", "venv", str(venv)], timeout=120))
    python = venv / "bin" / "python"
    check(run([str(python), "-m", "pip", "install", "-q", f"torch=={torch.__version__}"], timeout=900))
    before = installed(python)
    dist = tmp_path / "dist"
    check(run([PYTHON, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(ROOT)],
              timeout=300))
    wheel = next(dist.glob("trainbridge-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "trainbridge/cli/build_horovod.py" in names and not [n for n in names if "/compat/" in n], names
    check(run([str(python), "-m", "pip", "install", "-q", str(wheel)], timeout=600))
    after = installed(python)
    assert after["torch"] == before["torch"] == torch.__version__
    assert set(after) - set(before) == {"trainbridge", "numpy", "psutil"} - set(before), set(after) - set(before)
    # The core, in that environment: the API trains, doctor names what is missing, a task says what to install.
    code = ("import torch, trainbridge as tb\n"
            "job = tb.init()\n"
            "model, optimizer = job.prepare(torch.nn.Linear(4, 2),\n"
            "                               torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1))\n"
            "data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(2, (32,)))\n"
            "for x, y in job.train_loader(data, batch_size=8):\n"
            "    optimizer.zero_grad()\n"
            "    job.backward(torch.nn.functional.cross_entropy(model(x), y))\n"
            "    job.step(optimizer)\n"
            "print('TRAINED', job.backend_name)\n")
    assert "TRAINED local" in check(run([str(python), "-c", code], timeout=120, cwd=str(tmp_path))).stdout
    doctor = check(run([str(venv / "bin" / "trainbridge"), "doctor"], timeout=120, cwd=str(tmp_path)))
    assert 'missing: torchvision (pip install "trainbridge[tasks]")' in doctor.stdout, doctor.stdout
    train = run([str(venv / "bin" / "trainbridge"), "train", "--max-steps", "1", "--no-progress",
                 "--output-dir", str(tmp_path / "run")], timeout=120, cwd=str(tmp_path))
    assert train.returncode == 2 and 'pip install "trainbridge[tasks]" adds it' in train.stderr, train.stderr
    assert "Traceback" not in train.stderr
