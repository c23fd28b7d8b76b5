#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian machine (see ../shared/ENVIRONMENT.md):
#   1. Open MPI from Debian, when mpirun is missing; SLURM and sshd for the
#      two-host tests, when missing;
#   2. .venv with torch==2.13.0, torchvision==0.28.0 (made importable on the CPU
#      torch), mpi4py and Horovod 0.28.1 built from the sdist with the C++17 fix;
#   3. trainbridge itself, editable, with every extra but horovod (.[all]: the
#      tasks' packages, mpi4py, and what the tests, the bench and the docs need).
# A second run takes seconds: each step checks before it acts, and the built
# Horovod wheel is cached in $TRAINBRIDGE_CACHE (default ~/.cache/trainbridge).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
CACHE=${TRAINBRIDGE_CACHE:-$HOME/.cache/trainbridge}
TORCH_VERSION=2.13.0
TORCHVISION_VERSION=0.28.0
HOROVOD_VERSION=0.28.1
log() { echo "[setup] $*"; }

# --- 1. Open MPI -------------------------------------------------------------
if ! command -v mpirun >/dev/null 2>&1 || ! command -v mpicc >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
    log "installing Open MPI from Debian packages"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
fi

# --- 1b. SLURM and sshd for the two-host tests (tests/test_multihost.py) -------
# The tests run their own slurmctld/slurmd and sshd inside network namespaces;
# Debian's packages start nothing here (no systemd). Skipped where apt-get is
# missing or the user is neither root nor a sudoer: the tests then skip with a reason.
if ! command -v slurmctld >/dev/null 2>&1 || ! command -v slurmd >/dev/null 2>&1 \
   || ! command -v srun >/dev/null 2>&1 || [ ! -x /usr/sbin/sshd ] || ! command -v chromium >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
    if command -v apt-get >/dev/null 2>&1 && { [ -z "$SUDO" ] || sudo -n true 2>/dev/null; }; then
        log "installing SLURM (slurmctld, slurmd, client), openssh-server and Chromium from Debian packages"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
            slurmctld slurmd slurm-client openssh-server openssh-client iproute2 util-linux chromium >/dev/null
    else
        log "SLURM/sshd not installed (no apt-get or no root): the two-host tests will skip"
    fi
fi

# --- 2. virtual environment --------------------------------------------------
[ -x "$VENV/bin/python" ] || { log "creating $VENV"; $PY -m venv "$VENV"; }
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip install -q --disable-pip-version-check)
have() { "$VPY" -c "import importlib.metadata as m, sys; sys.exit(0 if m.version('$1').split('+')[0] == '$2' else 1)" 2>/dev/null; }

have torch "$TORCH_VERSION" || { log "installing torch==$TORCH_VERSION"; "${PIP[@]}" "torch==$TORCH_VERSION"; }
# torchvision's pin on torch==2.13.0 is satisfied by the local CPU build, so
# this installs nothing CUDA-related.
have torchvision "$TORCHVISION_VERSION" || { log "installing torchvision==$TORCHVISION_VERSION"; "${PIP[@]}" "torchvision==$TORCHVISION_VERSION"; }

# torchvision's CUDA-only _C.so does not load on the CPU torch, and its
# _meta_registrations.py then fails on the missing nms/qnms schemas. A .pth
# hook defines those two schemas right before that module runs, in every
# interpreter of the venv (also scripts that never import trainbridge).
SITE=$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp "$ROOT/trainbridge/compat/torchvision_cpu_ops.py" "$SITE/_trainbridge_torchvision_cpu_ops.py"
echo "import _trainbridge_torchvision_cpu_ops; _trainbridge_torchvision_cpu_ops.install()" > "$SITE/_trainbridge_torchvision_cpu_ops.pth"
"$VPY" -c "import torchvision" || { echo "[setup] import torchvision still fails" >&2; exit 1; }

"$VPY" -c "import mpi4py" 2>/dev/null || { log "installing mpi4py"; "${PIP[@]}" mpi4py; }

# --- Horovod 0.28.1 with the C++17 fix (upstream PR #3998) -------------------
if ! "$VPY" -c "import horovod.torch" 2>/dev/null; then
    TAG=$("$VPY" -c "import sys, torch; print(f'py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}')")
    WHEELDIR="$CACHE/horovod-$HOROVOD_VERSION-$TAG"
    if ! ls "$WHEELDIR"/horovod-*.whl >/dev/null 2>&1; then
        log "building Horovod $HOROVOD_VERSION (about 3 minutes on 2 cores; cached in $WHEELDIR)"
        "${PIP[@]}" packaging wheel setuptools
        # Horovod's bundled gloo needs CMake < 4 (it declares a minimum below 3.5).
        command -v cmake >/dev/null 2>&1 || "${PIP[@]}" "cmake<4"
        BUILD=$(mktemp -d)
        "$VPY" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$BUILD"
        tar -xzf "$BUILD"/horovod-*.tar.gz -C "$BUILD"
        SRC=$(echo "$BUILD"/horovod-$HOROVOD_VERSION)
        sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
        grep -q 'CMAKE_CXX_STANDARD 17' "$SRC/horovod/torch/CMakeLists.txt" || { echo "[setup] C++17 patch did not apply" >&2; exit 1; }
        mkdir -p "$WHEELDIR"
        ( cd "$SRC" && PATH="$VENV/bin:$PATH" \
          HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
          HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS="-j$(nproc)" \
          "$VPY" -m pip wheel -q --no-build-isolation --no-deps . -w "$WHEELDIR" )
        rm -rf "$BUILD"
    fi
    log "installing Horovod from $WHEELDIR"
    "${PIP[@]}" "$WHEELDIR"/horovod-*.whl
fi

# --- 3. trainbridge, editable ------------------------------------------------
if ! "$VPY" -c "import trainbridge, sys; sys.exit(0 if trainbridge.__file__.startswith('$ROOT') else 1)" 2>/dev/null \
   || [ setup.cfg -nt "$VENV/.trainbridge-installed" ]; then
    log "installing trainbridge (editable) with .[all]"
    # The pins keep the torch and torchvision installed above (setup.cfg only bounds them from below).
    "${PIP[@]}" -e ".[all]" "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
    touch "$VENV/.trainbridge-installed"
fi
log "ready: $VENV"
