#!/usr/bin/env bash
# The API and trainbridge.hvd tests against other torch releases than the development pin.
#
#   bash scripts/test_torch_versions.sh 2.11.0 2.14.1
#
# One venv per version in $TMPDIR (kept for reruns; REMOVE_VENVS=1 deletes each after its
# tests, as CI does), with that torch and what these tests import; trainbridge from this
# checkout (PYTHONPATH). PyPI has only CUDA builds of these releases: torch and its nvidia
# packages are about 3.3 GB per version, which imports on a CPU machine (measured here: about
# 50 MB/s from PyPI). The tests that start horovodrun or mpirun, or compare with the real
# Horovod, need Horovod in that venv and are left out.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
for version in "$@"; do
    venv="${TMPDIR:-/tmp}/trainbridge-torch-$version"
    start=$SECONDS
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==$version" numpy psutil pytest \
        pytest-timeout scikit-learn || { status=1; continue; }
    echo "[torch $version] $("$venv/bin/python" -c 'import torch; print(torch.__version__)') installed in $((SECONDS - start)) s"
    start=$SECONDS
    PYTHONPATH=$PWD "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_api.py tests/test_hvd_api.py \
        tests/test_hvd_units.py tests/test_hvd_faults.py tests/test_loaders.py \
        -k "not horovodrun and not mpirun and not real_horovod and not migration_table" || status=1
    echo "[torch $version] tests took $((SECONDS - start)) s"
    [ "${REMOVE_VENVS:-0}" = 1 ] && rm -rf "$venv"
done
exit $status
