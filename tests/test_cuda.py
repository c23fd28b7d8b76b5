"""The CUDA paths, run for real on a GPU: nccl, AMP fp16 and bf16, pinned non-blocking batches, checkpoints of
GPU state, trainbridge.hvd on CUDA tensors, bitwise reruns and resumes with --deterministic.

On a machine without CUDA every test here is skipped, with that reason in pytest's summary;
``scripts/gpu_check.sh`` runs them on a GPU machine, and ``benchmarks/GPU.md`` records what they gave.
Each test starts real processes (torchrun or plain python), each with a timeout.
"""
import re
from pathlib import Path

import pytest
import torch
from conftest import PYTHON, TORCHRUN, check, read_metrics, run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (scripts/gpu_check.sh runs these on a GPU machine)")

REPO = Path(__file__).resolve().parents[1]
OWN_LOOP = REPO / "examples" / "own_loop.py"
CUDA_PATHS = REPO / "tests" / "api_scripts" / "cuda_paths.py"
HVD_CUDA = REPO / "tests" / "hvd_scripts" / "cuda_collectives.py"
TIMEOUT = 90
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def torchrun(nproc: int, *args) -> list:
    return [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", *map(str, args)]


def weights(path: Path) -> dict:
    return torch.load(path, weights_only=True, map_location="cpu")["model"]


def largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a.values(), b.values()))


# ----- the public API -----------------------------------------------------------
def test_one_gpu_process_and_torchrun_with_one_rank_train_the_same_weights(tmp_path):
    """Plain python (local backend) and torchrun (DDP over nccl) on one GPU, the same global batch: bitwise."""
    plain = check(run([PYTHON, str(OWN_LOOP), "--output-dir", str(tmp_path / "plain")], timeout=TIMEOUT))
    launched = check(run(torchrun(1, OWN_LOOP, "--output-dir", tmp_path / "torchrun"), timeout=TIMEOUT))
    assert "backend local, device cuda:0" in plain.stdout, plain.stdout[-2000:]
    assert "under torchrun: backend torch, device cuda:0" in launched.stdout, launched.stdout[-2000:]
    difference = largest_difference(weights(tmp_path / "plain" / "final.pt"),
                                    weights(tmp_path / "torchrun" / "final.pt"))
    assert difference == 0.0, f"plain python and torchrun on one GPU differ by {difference:.3g}"
    accuracy = float(re.findall(r"val_accuracy (\S+)", launched.stdout)[-1])
    assert accuracy > 0.8, launched.stdout[-2000:]  # it learned: the CPU's run of this example ends at 0.8485


def test_the_gpu_trains_the_cpus_weights_in_float64(tmp_path):
    """The same loop on the GPU and on the CPU (CUDA hidden) in float64: equal up to summation order."""
    for where, env in (("gpu", {}), ("cpu", {"CUDA_VISIBLE_DEVICES": ""})):
        result = check(run([PYTHON, str(OWN_LOOP), "--float64", "--output-dir", str(tmp_path / where)],
                           timeout=TIMEOUT, env=env))
        assert f"device {'cuda:0' if where == 'gpu' else 'cpu'}" in result.stdout, result.stdout[-2000:]
    difference = largest_difference(weights(tmp_path / "gpu" / "final.pt"), weights(tmp_path / "cpu" / "final.pt"))
    assert difference < 1e-9, f"GPU and CPU float64 weights differ by {difference:.3g}"


def parse(pattern: str, text: str) -> dict:
    match = re.search(pattern, text)
    assert match, f"no line matching {pattern!r} in:\n{text[-3000:]}"
    return match.groupdict()


@pytest.mark.parametrize("launcher,amp", [("torchrun", "off"), ("python", "off"), ("torchrun", "fp16"),
                                          ("torchrun", "bf16")])
def test_api_cuda_paths(launcher, amp, tmp_path):
    """nccl under torchrun; pinned, non-blocking batches; AMP through prepare and autocast; GPU checkpoints."""
    command = torchrun(1, CUDA_PATHS, tmp_path, amp) if launcher == "torchrun" else [PYTHON, str(CUDA_PATHS),
                                                                                    str(tmp_path), amp]
    out = check(run(command, timeout=TIMEOUT)).stdout
    job = parse(r"JOB Job\(backend=(?P<backend>\w+),.*device=(?P<device>\S+), launcher=\w+\) pg=(?P<pg>\w+)", out)
    assert job == ({"backend": "torch", "device": "cuda:0", "pg": "nccl"} if launcher == "torchrun"
                   else {"backend": "local", "device": "cuda:0", "pg": "none"})
    assert parse(r"ALLREDUCE device=(?P<device>\S+) value=(?P<value>\S+)", out) == {"device": "cpu", "value": "1.0"}
    loader = parse(r"LOADER pin_memory=(?P<pin>\w+) workers=(?P<workers>\d+) batch_device=(?P<x>\S+) "
                   r"labels_device=(?P<y>\S+)", out)
    assert loader == {"pin": "True", "workers": "2", "x": "cuda:0", "y": "cuda:0"}
    train = parse(r"TRAIN amp=\w+ scaler=(?P<scaler>\w+) scale=(?P<scale>\S+) out_dtype=torch\.(?P<dtype>\w+) "
                  r"first_loss=(?P<first>\S+) last_loss=(?P<last>\S+) finite=(?P<finite>\w+)", out)
    assert train["dtype"] == {"off": "float32", "fp16": "float16", "bf16": "bfloat16"}[amp]
    assert train["scaler"] == str(amp == "fp16")
    if amp == "fp16":
        assert 0 < float(train["scale"]) < float("inf")
    assert train["finite"] == "True" and float(train["last"]) < 0.75 * float(train["first"]), train
    saves = re.findall(r"SAVE background=(\w+) equal=(\w+) file_device=(\S+) restored_device=(\S+)", out)
    assert saves == [("False", "True", "cpu", "cuda:0"), ("True", "True", "cpu", "cuda:0")], out[-3000:]


def test_more_local_ranks_than_gpus_is_one_line(tmp_path):
    result = run(torchrun(GPUS + 1, OWN_LOOP, "--output-dir", tmp_path), timeout=TIMEOUT)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if "has no GPU" in line]
    assert lines and "start at most one process per GPU" in lines[0], result.stderr[-3000:]
    # No traceback from a rank (torchrun prints its own).
    assert 'own_loop.py", line' not in result.stderr, result.stderr[-3000:]


# ----- trainbridge train ------------------------------------------------------------
MNIST = ["-m", "trainbridge.train", "--dataset", "mnist-sample", "--seed", "7", "--no-progress", "--batch-size", "32",
         "--backend", "local"]


@pytest.mark.parametrize("amp", ["off", "fp16"])
def test_a_resumed_gpu_run_is_bitwise_the_uninterrupted_one_with_deterministic(amp, tmp_path):
    """The default model has dropout (CUDA's RNG) and convolutions (cuDNN): --deterministic makes both repeatable."""
    args = [*MNIST, "--amp", amp, "--deterministic"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    check(run([PYTHON, *args, "--max-steps", "8", "--output-dir", str(whole)], timeout=TIMEOUT))
    check(run([PYTHON, *args, "--max-steps", "4", "--output-dir", str(split)], timeout=TIMEOUT))
    check(run([PYTHON, *args, "--max-steps", "8", "--output-dir", str(split)], timeout=TIMEOUT))
    assert read_metrics(whole)[-1]["device"] == "cuda:0"
    a = torch.load(whole / "last.pt", weights_only=True, map_location="cpu")
    b = torch.load(split / "last.pt", weights_only=True, map_location="cpu")
    difference = largest_difference(a["model"], b["model"])
    assert difference == 0.0, f"--amp {amp}: resumed run differs from the uninterrupted one by {difference:.3g}"


def test_hvd_collectives_on_cuda_tensors():
    """One GPU per rank, as Horovod's GPU recipe has it: every rank that has a GPU, and plain python."""
    for command in (torchrun(GPUS, HVD_CUDA), [PYTHON, str(HVD_CUDA)]):
        out = run(command, timeout=TIMEOUT).stdout
        results = re.findall(r"RESULT (\d+) (PASS|FAIL) (\w+)", out)
        failed = [r for r in results if r[1] != "PASS"]
        ranks = GPUS if command[0] == TORCHRUN else 1
        assert not failed and len(results) == 6 * ranks, out[-4000:]
        assert re.search(r"INFO rank=0 size=\d+ real_horovod=False cuda_built=True nccl_built=[1-9]", out), out[-2000:]
