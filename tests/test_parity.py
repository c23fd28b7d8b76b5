"""The central promise: the same weights under every launcher and backend.

plaincnn + SGD, same seed, K steps of per-process batch B on 2 processes, must
match one process with batch 2B to 1e-5 (max absolute difference).
"""
import pytest
import torch
from conftest import (
    PARITY,
    PARITY_BATCH,
    PARITY_STEPS,
    check,
    horovodrun,
    in_matrix,
    load_final,
    mpirun,
    read_metrics,
    run,
    torchrun,
    train_here,
)

K, B = PARITY_STEPS, PARITY_BATCH
COMMON = PARITY

RUNS = {
    "torchrun": lambda a: torchrun(2, a + ["--batch-size", str(B)]),
    "horovodrun-gloo": lambda a: horovodrun(2, "gloo", a + ["--batch-size", str(B)]),
    "horovodrun-mpi": lambda a: horovodrun(2, "mpi", a + ["--batch-size", str(B)]),
    "mpirun-torch": lambda a: mpirun(2, a + ["--batch-size", str(B), "--backend", "torch"]),
    "horovodrun-torch": lambda a: horovodrun(2, "gloo", a + ["--batch-size", str(B), "--backend", "torch"]),
    "spawn": None,  # --nproc 2: started once per session by conftest's parity_spawn_run (test_multihost's reference)
}
EXPECTED_BACKEND = {"torchrun": "torch", "horovodrun-gloo": "horovod", "horovodrun-mpi": "horovod",
                    "mpirun-torch": "torch", "horovodrun-torch": "torch", "spawn": "torch"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("local")
    check(train_here(COMMON + ["--batch-size", str(2 * B), "--backend", "local", "--output-dir", str(out)]))
    return load_final(out)


@pytest.mark.parametrize("name", in_matrix(list(RUNS), {"horovodrun-mpi", "mpirun-torch", "horovodrun-torch", "spawn"}))
def test_two_processes_match_one_process_with_twice_the_batch(name, reference, tmp_path, request):
    if RUNS[name] is None:
        out = request.getfixturevalue("parity_spawn_run")
    else:
        out = tmp_path
        check(run(RUNS[name](COMMON + ["--output-dir", str(out)]), timeout=180))
    final = load_final(out)
    metrics = read_metrics(out)[-1]
    assert (metrics["backend"], metrics["world_size"], final["step"]) == (EXPECTED_BACKEND[name], 2, K)
    assert not any(key.startswith("module.") for key in final["model"])
    assert final["model"].keys() == reference["model"].keys()
    diff = max((final["model"][k] - reference["model"][k]).abs().max().item() for k in final["model"])
    assert diff < 1e-5, f"{name}: max abs weight difference {diff:.3g} vs one process"
    # The weights moved: a run that silently did nothing would also "match".
    moved = max((final["model"][k] - init).abs().max().item() for k, init in initial_weights().items())
    assert moved > 1e-3


def initial_weights():
    from trainbridge.models import build_model
    torch.manual_seed(5)
    return build_model("plaincnn").state_dict()


def test_batchnorm_model_trains_the_same_on_both_backends(tmp_path):
    # DDP runs without its per-forward buffer broadcast (see backends/torch_ddp.py);
    # Horovod never had one. Both must still end with the same weights and the same
    # BatchNorm statistics (rank 0's). BatchNorm normalizes each rank's own batch,
    # so one process with batch 2B is no reference here: the other backend is.
    args = ["--model", "convnet-bn", "--optimizer", "sgd", "--lr", "0.05", "--max-steps", str(K),
            "--dataset", "mnist-sample", "--seed", "5", "--batch-size", str(B), "--no-progress"]
    check(run(torchrun(2, args + ["--output-dir", str(tmp_path / "torch")]), timeout=180))
    check(run(horovodrun(2, "gloo", args + ["--output-dir", str(tmp_path / "horovod")]), timeout=180))
    ddp, hvd = load_final(tmp_path / "torch")["model"], load_final(tmp_path / "horovod")["model"]
    assert ddp.keys() == hvd.keys() and any(k.endswith("running_var") for k in ddp)
    diff = {k: (ddp[k].double() - hvd[k].double()).abs().max().item() for k in ddp}
    assert max(diff.values()) < 1e-5, {k: d for k, d in diff.items() if d >= 1e-5}
    assert all(int(ddp[k]) == K for k in ddp if k.endswith("num_batches_tracked"))
    # The statistics moved from their initial zeros and ones: a run that never updated them would also "match".
    assert max(ddp[k].abs().max().item() for k in ddp if k.endswith("running_mean")) > 1e-3
