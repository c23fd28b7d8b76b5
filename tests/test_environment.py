"""The set-up's promises: torchvision imports on the CPU torch; doctor reports the machine."""
import subprocess

from conftest import PYTHON, run


def test_torchvision_imports_in_a_script_that_never_imports_trainbridge():
    code = ("import sys, torchvision, torch; m = torchvision.models.resnet34(); "
            "print(m(torch.randn(1, 3, 64, 64)).shape); assert 'trainbridge' not in sys.modules")
    result = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "torch.Size([1, 1000])" in result.stdout


def test_doctor(tmp_path):
    result = run([PYTHON, "-m", "trainbridge", "doctor"], timeout=60)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for line in ("torch ", "torchvision ", "horovod ", "Gloo (torch)", "NCCL (torch)", "CUDA available",
                 "horovod controllers", "launcher"):
        assert line in out, (line, out)
    assert "horovod controllers  MPI, Gloo" in out
    assert "launcher" in out and "python (rank 0 of 1" in out
