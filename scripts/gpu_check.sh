#!/usr/bin/env bash
# The GPU checks recorded in benchmarks/GPU.md, in one run, on a machine with CUDA.
#
#   bash scripts/gpu_check.sh OUTDIR
#   ONLY="tests bench" PYTEST_ARGS=--timeout=100 TESTS_LIMIT=250 bash scripts/gpu_check.sh OUTDIR
#   ONLY=bench_designsafe DS_REPEATS=3 DS_ROWS="torch_gloo trainbridge_loop" bash scripts/gpu_check.sh OUTDIR
#
# No set-up: it uses the machine's own python3 with its torch (and Accelerate,
# Lightning, nvidia-ml-py for the peer rows), and trainbridge from this checkout.
# Each step has a time limit and writes OUTDIR/<step>.log; a failed step does not
# stop the next. Steps: the machine (GPU, driver, torch, CUDA, nccl, cuDNN), the
# CUDA tests (tests/test_cuda.py), whether two GPU runs agree bitwise without
# --deterministic, the checkpoint writer's cost on GPU state, and the bench's
# peer rows on the GPU for both workloads (bench.md, bench.json and bench-designsafe.md copied to OUTDIR).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${1:-runs/gpu}")
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # packages the machine lacks (mlxtend), brought as wheels
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu-check-site .whl/*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/gpu-check-site
fi

step() {  # step NAME LIMIT_SECONDS COMMAND...
    local name=$1 limit=$2 start rc
    shift 2
    [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $name "* ]] || return 0  # ONLY="tests bench": just those steps
    echo "=== $name (limit ${limit}s): $*"
    start=$(date +%s)
    timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "=== $name: exit $rc after $(($(date +%s) - start)) s"
    tail -n "${TAIL:-12}" "$OUT/$name.log"
}

step machine 60 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv; nproc; \
  $PY -c 'import torch, sys; print(\"python\", sys.version.split()[0], \"torch\", torch.__version__, \"cuda\", torch.version.cuda, \
  \"nccl\", \".\".join(map(str, torch.cuda.nccl.version())), \"cudnn\", torch.backends.cudnn.version(), \
  \"gpus\", torch.cuda.device_count(), torch.cuda.get_device_name(0), \"bf16\", torch.cuda.is_bf16_supported())'; \
  $PY -m pip list 2>/dev/null | grep -iE '^(accelerate|lightning|lightning-fabric|nvidia-ml-py|mpi4py|horovod|torchvision) '; \
  $PY -c 'import horovod' 2>&1 | tail -1; $PY -m trainbridge doctor"

# One rank over nccl, with nccl's warnings: what the tests below build on.
step nccl 60 env NCCL_DEBUG=WARN "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 examples/own_loop.py --epochs 1 \
    --output-dir "$(mktemp -d)/nccl"

step tests "${TESTS_LIMIT:-420}" "$PY" -m pytest -v -p no:cacheprovider --durations=0 ${PYTEST_ARGS:-} tests/test_cuda.py

# Two identical runs of the default MNIST model (dropout, convolutions) without and with --deterministic.
determinism() {
    local dir mode run start
    dir=$(mktemp -d)
    for mode in default deterministic; do
        start=$(date +%s.%N)
        for run in 1 2; do
            "$PY" -m trainbridge.train --dataset mnist-sample --seed 7 --no-progress --batch-size 32 --max-steps 40 \
                --backend local $([ $mode = deterministic ] && echo --deterministic) --output-dir "$dir/$mode$run" \
                >/dev/null || return 1
        done
        echo "$mode kernels: two runs in $("$PY" -c "import time; print(round(time.time() - $start, 1))") s"
        echo -n "$mode kernels, two identical runs: "
        "$PY" scripts/compare_weights.py "$dir/${mode}1/last.pt" "$dir/${mode}2/last.pt" || return 1
    done
}
export -f determinism
export PY
step determinism 90 bash -c determinism

step checkpoint_cost 90 "$PY" benchmarks/checkpoint_cost.py --model resnet34 --steps 40 --every 5 --repeats 3

step bench "${BENCH_LIMIT:-200}" "$PY" -m benchmarks --nproc 1 --workload mnist-convnet --repeats 2 --settle 0 --noisy-retries 0 \
    --timeout 90 --out runs/gpu-bench --only torch_gloo --only trainbridge_loop --only ddp_tutorial --only accelerate \
    --only fabric
cp runs/gpu-bench/bench.md runs/gpu-bench/bench.json "$OUT/" 2>/dev/null || true

# The workload that gives the GPU real work: ResNet34 on DesignSafe-sized pictures (decoded and augmented on the host).
step bench_designsafe "${BENCH_LIMIT:-250}" "$PY" -m benchmarks --nproc 1 --workload designsafe-resnet34 --repeats "${DS_REPEATS:-1}" \
    --settle 0 --noisy-retries 0 --timeout 90 --out runs/gpu-bench-designsafe \
    $(printf -- '--only %s ' ${DS_ROWS:-torch_gloo trainbridge_loop ddp_tutorial accelerate fabric})
cp runs/gpu-bench-designsafe/bench.md "$OUT/bench-designsafe.md" 2>/dev/null || true
