#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian machine (see ../shared/ENVIRONMENT.md):
#   1. Open MPI from Debian, when mpirun is missing; SLURM and sshd for the
#      two-host tests, when missing;
#   2. .venv with torch==2.13.0, torchvision==0.28.0 (made importable on the CPU
#      torch) and mpi4py;
#   3. trainbridge itself, editable, with every extra but horovod (.[all]: the
#      tasks' packages, mpi4py, and what the tests, the bench and the docs need);
#   4. Horovod 0.28.1 from its sdist with the C++17 fix: `trainbridge build-horovod`.
# A second run takes seconds: each step checks before it acts, and the built
# Horovod wheel is cached in $TRAINBRIDGE_CACHE (default ~/.cache/trainbridge).
#
#   bash scripts/setup.sh        everything: what the tests, the bench and the docs need
#   bash scripts/setup.sh run    only what the main job needs (make run): steps 2 and 3
#                                with the tasks extra; a later full set-up adds the rest
set -euo pipefail
PROFILE=${1:-all}
case "$PROFILE" in run|all) ;; *) echo "usage: bash scripts/setup.sh [run|all]" >&2; exit 2 ;; esac
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
if [ "$PROFILE" = all ]; then
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
fi  # PROFILE = all

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
cp "$ROOT/scripts/torchvision_cpu_ops.py" "$SITE/_trainbridge_torchvision_cpu_ops.py"
echo "import _trainbridge_torchvision_cpu_ops; _trainbridge_torchvision_cpu_ops.install()" > "$SITE/_trainbridge_torchvision_cpu_ops.pth"
"$VPY" -c "import torchvision" || { echo "[setup] import torchvision still fails" >&2; exit 1; }

[ "$PROFILE" = run ] || "$VPY" -c "import mpi4py" 2>/dev/null || { log "installing mpi4py"; "${PIP[@]}" mpi4py; }

# --- 3. trainbridge, editable ------------------------------------------------
EXTRAS=all; [ "$PROFILE" = run ] && EXTRAS=tasks
MARKER="$VENV/.trainbridge-installed-$EXTRAS"  # a full set-up after "run" still adds the other extras
if ! "$VPY" -c "import trainbridge, sys; sys.exit(0 if trainbridge.__file__.startswith('$ROOT') else 1)" 2>/dev/null \
   || [ setup.cfg -nt "$MARKER" ]; then
    log "installing trainbridge (editable) with .[$EXTRAS]"
    # The pins keep the torch and torchvision installed above (setup.cfg only bounds them from below).
    "${PIP[@]}" -e ".[$EXTRAS]" "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
    touch "$MARKER"
fi
# --- 4. Horovod, built against this torch (the command users run too) ----------
[ "$PROFILE" = run ] || "$VPY" -m trainbridge build-horovod --version "$HOROVOD_VERSION" --cache "$CACHE"
log "ready: $VENV"
