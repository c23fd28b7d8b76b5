#!/usr/bin/env bash
# The API and trainbridge.hvd tests against other torch releases than the development pin.
#
#   bash scripts/test_torch_versions.sh 2.11.0 2.14.1
#
# One venv per version in $TMPDIR (kept for reruns), with that torch and what these tests
# import; trainbridge from this checkout (PYTHONPATH). Not part of `make test`: PyPI has only
# CUDA builds of past torch releases, about 4 GB each with their nvidia packages (about 20
# minutes to download here). The tests that start horovodrun or mpirun, or compare with the
# real Horovod, need Horovod in that venv and are left out.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
for version in "$@"; do
    venv="${TMPDIR:-/tmp}/trainbridge-torch-$version"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q "torch==$version" numpy psutil pytest scikit-learn || { status=1; continue; }
    echo "[torch $version] $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
    PYTHONPATH=$PWD "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_api.py tests/test_hvd_api.py \
        tests/test_hvd_units.py tests/test_hvd_faults.py tests/test_loaders.py \
        -k "not horovodrun and not mpirun and not real_horovod and not migration_table" || status=1
done
exit $status
