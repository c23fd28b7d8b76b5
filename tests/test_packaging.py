"""trainbridge as a package: one version, a core that imports none of the optional packages."""
from __future__ import annotations

import re
from pathlib import Path

from setuptools.config.setupcfg import read_configuration

import trainbridge
from conftest import PYTHON, check, run
from trainbridge.optional import OPTIONAL

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_written_once_and_printed():
    """setup.cfg reads trainbridge.__version__; ``--version`` prints it."""
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
