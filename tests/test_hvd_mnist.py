"""The one-line migration: Horovod's MNIST example gives the same accuracy under torchrun and horovodrun.

examples/horovod_mnist.py is Horovod's pytorch_mnist.py with ``import trainbridge.hvd as hvd``.
It runs as-is under torchrun (our torch backend). Under horovodrun the test runs the
*original* script, with ``import horovod.torch as hvd`` put back, on the real Horovod.
"""
import re
from pathlib import Path

import pytest
from conftest import HOROVODRUN, PYTHON, TORCHRUN, check, run

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "horovod_mnist.py"
ARGS = ["--epochs", "3", "--lr", "0.05", "--dataset", "mnist-sample", "--log-interval", "1000"]
TEST_LINE = re.compile(r"Test set: Average loss: ([\d.]+), Accuracy: ([\d.]+)%")


def final_metrics(output: str):
    lines = TEST_LINE.findall(output)
    assert len(lines) == 3, f"expected one test line per epoch:\n{output[-3000:]}"
    loss, accuracy = lines[-1]
    return float(loss), float(accuracy)


@pytest.mark.matrix  # against the real Horovod
def test_horovod_mnist_example_same_accuracy_under_torchrun_and_horovodrun(tmp_path):
    source = EXAMPLE.read_text()
    migrated_line = "\nimport trainbridge.hvd as hvd\n"
    assert source.count(migrated_line) == 1, "the example must import trainbridge.hvd exactly once"
    original = tmp_path / "pytorch_mnist.py"
    original.write_text(source.replace(migrated_line, "\nimport horovod.torch as hvd\n"))

    migrated = check(run([TORCHRUN, "--standalone", "--nproc-per-node=2", str(EXAMPLE), *ARGS], timeout=240))
    horovod = check(run([HOROVODRUN, "-np", "2", "--gloo", PYTHON, str(original), *ARGS], timeout=240))

    torch_loss, torch_accuracy = final_metrics(migrated.stdout)
    horovod_loss, horovod_accuracy = final_metrics(horovod.stdout)
    print(f"torchrun (trainbridge.hvd): loss {torch_loss}, accuracy {torch_accuracy}%; "
          f"horovodrun (horovod.torch): loss {horovod_loss}, accuracy {horovod_accuracy}%")
    assert torch_accuracy > 80.0, migrated.stdout[-2000:]
    # Same seeds, same shards, same averaged gradients: the runs agree to print precision.
    assert abs(torch_accuracy - horovod_accuracy) <= 0.5 and abs(torch_loss - horovod_loss) <= 0.01
