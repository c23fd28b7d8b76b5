"""``trainbridge build-horovod``: build Horovod against the torch of this Python, install it, check it.

Horovod's last release (0.28.1) does not build against torch >= 2.1 as published:
its CMake files ask for C++14, torch's headers need C++17 (upstream issues #3996
and #4014; the fix, PR #3998, was never released). ``pip install horovod`` then
either fails or, without PyTorch's headers at build time, installs a Horovod with
no PyTorch operations. This command downloads the sdist, raises the C++ standard
to 17, builds a wheel with the PyTorch extension, the Gloo controller and, where
``mpicc`` is found, the MPI controller, installs it into this Python, and checks
it as ``trainbridge doctor`` does. The wheel is cached per Python and torch
version, so a second environment with the same pair installs in seconds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import List, Optional

import torch

from ..errors import UserError

DEFAULT_VERSION = "0.28.1"
CMAKE_FILES = ("CMakeLists.txt", "horovod/torch/CMakeLists.txt")


def pip(*args: str) -> List[str]:
    return [sys.executable, "-m", "pip", *args]


def run(command: List[str], what: str, cwd: Optional[str] = None, env: Optional[dict] = None) -> None:
    result = subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        sys.stderr.write(result.stdout[-4000:])
        raise UserError(f"build-horovod: {what} failed (exit {result.returncode}; its output is above)")


def problem_in_a_fresh_interpreter() -> Optional[str]:
    """``horovod_problem()`` in a new process: this one may hold the Horovod it had before the install."""
    code = "from trainbridge.backends.horovod import horovod_problem as p; print(p() or 'ok')"
    result = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else f"exit {result.returncode}"
    return None if line == "ok" else line


def build_wheel(version: str, wheel_dir: Path, jobs: int) -> None:
    with tempfile.TemporaryDirectory(prefix="horovod-build-") as build:
        print(f"[build-horovod] downloading the horovod=={version} sdist", flush=True)
        run(
            pip("download", "-q", "--no-deps", "--no-binary", ":all:", f"horovod=={version}", "-d", build),
            f"pip download horovod=={version}",
        )
        with tarfile.open(next(Path(build).glob("horovod-*.tar.gz"))) as sdist:
            try:
                sdist.extractall(build, filter="data")
            except TypeError:  # Python before 3.11.4 has no extraction filters
                sdist.extractall(build)
        source = Path(build) / f"horovod-{version}"
        for name in CMAKE_FILES:  # the C++17 fix of upstream PR #3998
            path = source / name
            text = path.read_text()
            if "set(CMAKE_CXX_STANDARD 14)" not in text and "set(CMAKE_CXX_STANDARD 17)" not in text:
                raise UserError(
                    f"build-horovod: {name} of horovod {version} sets no C++ standard this command "
                    f"knows; build that version by hand"
                )
            path.write_text(text.replace("set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)"))
        mpi = shutil.which("mpicc") is not None
        env = {
            **os.environ,
            "HOROVOD_WITH_PYTORCH": "1",
            "HOROVOD_WITHOUT_TENSORFLOW": "1",
            "HOROVOD_WITHOUT_MXNET": "1",
            "HOROVOD_WITH_GLOO": "1",
            ("HOROVOD_WITH_MPI" if mpi else "HOROVOD_WITHOUT_MPI"): "1",
            # Horovod's bundled gloo declares a CMake minimum that CMake 4 refuses.
            "CMAKE_POLICY_VERSION_MINIMUM": "3.5",
            "MAKEFLAGS": f"-j{jobs}",
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        }
        print(
            f"[build-horovod] building against torch {torch.__version__} with Gloo"
            f"{' and MPI' if mpi else ' (no mpicc found: without MPI)'}; a few minutes",
            flush=True,
        )
        wheel_dir.mkdir(parents=True, exist_ok=True)
        run(
            pip("wheel", "-q", "--no-build-isolation", "--no-deps", ".", "-w", str(wheel_dir)),
            "building Horovod",
            cwd=str(source),
            env=env,
        )


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="trainbridge build-horovod", description=__doc__.splitlines()[0])
    p.add_argument("--version", default=DEFAULT_VERSION, help=f"Horovod release (default {DEFAULT_VERSION})")
    p.add_argument(
        "--cache",
        default=os.path.join(os.path.expanduser("~"), ".cache", "trainbridge"),
        help="where built wheels are kept (default ~/.cache/trainbridge)",
    )
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile jobs (default: cores)")
    p.add_argument("--force", action="store_true", help="build and install even if this Horovod already works")
    args = p.parse_args(argv)
    try:
        problem = problem_in_a_fresh_interpreter()
        if problem is None and not args.force:
            print("[build-horovod] this Python's Horovod already runs PyTorch jobs; --force rebuilds it")
            return 0
        tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
        wheel_dir = Path(args.cache) / f"horovod-{args.version}-{tag}"
        if not list(wheel_dir.glob("horovod-*.whl")):
            # --no-build-isolation builds with this Python's own packages: torch, and these.
            run(pip("install", "-q", "packaging", "wheel", "setuptools"), "installing the build tools")
            if shutil.which("cmake") is None:
                run(pip("install", "-q", "cmake<4"), "installing cmake")
            build_wheel(args.version, wheel_dir, args.jobs)
        wheel = str(next(wheel_dir.glob("horovod-*.whl")))
        print(f"[build-horovod] installing {wheel}", flush=True)
        run(pip("install", "-q", "--force-reinstall", "--no-deps", wheel), "installing the wheel")
        # Horovod's own dependencies (cloudpickle, psutil, pyyaml), without touching torch.
        run(pip("install", "-q", wheel), "installing Horovod's dependencies")
        problem = problem_in_a_fresh_interpreter()
        if problem is not None:
            raise UserError(f"build-horovod: the installed Horovod still cannot run: {problem}")
        print(
            f"[build-horovod] Horovod {args.version} runs PyTorch jobs here (trainbridge doctor shows its controllers)"
        )
        return 0
    except UserError as exc:
        print(f"trainbridge: error: {exc}", file=sys.stderr)
        return 2
